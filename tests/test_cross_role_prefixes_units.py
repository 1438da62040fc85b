"""datamodules/cross_role_prefixes.py on hand-made examples: the prefix hash, which example can start another's
context, each row's sources, and the chains ``cross_role_groups`` links (order, caps, share, refusals)."""

from __future__ import annotations

import pytest

from datamodules.cross_role_prefixes import (
    _can_source,
    cross_role_groups,
    prefix_hashes,
    prefix_sources,
    starts_with,
    whole_length,
)
from datamodules.records import TokenizedExample

EOS = 0
M = (1 << 61) - 1
B = 1_000_003


def ex(ids: list[int], ctx: int, role: int, segments: tuple = ()) -> TokenizedExample:
    return TokenizedExample(input_ids=ids, context_len=ctx, prefix_len=0, role_id=role, source="t", segments=segments)


def test_prefix_hashes_values():
    assert prefix_hashes([]) == [0]
    assert prefix_hashes([0]) == [0, 1]
    assert prefix_hashes([1]) == [0, 2]
    assert prefix_hashes([1, 2]) == [0, 2, 2 * B + 3]
    assert prefix_hashes((4, 0, 7)) == [0, 5, 5 * B + 1, (5 * B + 1) * B + 8]
    big = [M, M - 2, 123]  # wraps modulo 2**61 - 1
    h = prefix_hashes(big)
    assert h == [0, (M + 1) % M, ((M + 1) % M * B + M - 1) % M, ((((M + 1) % M * B + M - 1) % M) * B + 124) % M]
    assert h[1] == 1 and all(0 <= x < M for x in h)
    # a hash of a prefix does not depend on what follows it
    assert prefix_hashes([3, 1, 4, 1, 5])[:3] == prefix_hashes([3, 1, 9])[:3]
    assert prefix_hashes([3, 1])[-1] != prefix_hashes([1, 3])[-1]


def test_whole_length_and_can_source():
    assert whole_length(ex([5, 6, 7, EOS], 2, 0)) == 3
    assert whole_length(ex([EOS], 0, 0)) == 0
    assert _can_source(ex([5, 6, 7, EOS], 2, 0)) is True
    assert _can_source(ex([5, 6, 7, EOS], 3, 0)) is False  # no output tokens: whole length == context
    assert _can_source(ex([5, 6, 7, EOS], 4, 0)) is False
    assert _can_source(ex([5, 6, 7, EOS], 2, 0, segments=((1, (2, EOS)),))) is False  # packed


def test_starts_with_its_conditions():
    source = ex([5, 6, 7, EOS], 2, 0)  # whole example 5 6 7
    assert starts_with(ex([5, 6, 7, 8, 9, EOS], 4, 1), source) is True
    assert starts_with(ex([5, 6, 7, 8, 9, EOS], 4, 0), source) is False  # same role
    assert starts_with(ex([5, 6, 7, 8, 9, EOS], 3, 1), source) is False  # k == context: not inside the context
    assert starts_with(ex([5, 6, 7, 8, 9, EOS], 5, 1), source) is True
    assert starts_with(ex([5, 6, 8, 8, 9, EOS], 4, 1), source) is False  # differs at the last shared token
    assert starts_with(ex([4, 6, 7, 8, 9, EOS], 4, 1), source) is False  # differs at the first
    assert starts_with(ex([5, 6, 7, 8, 9, EOS], 4, 1), ex([5, 6, 7, EOS], 3, 0)) is False  # source with no output
    packed = ex([5, 6, 7, EOS], 2, 0, segments=((1, (6, 7, EOS)),))
    assert starts_with(ex([5, 6, 7, 8, 9, EOS], 4, 1), packed) is False
    # a consumer given as a tuple: compared as lists
    assert starts_with(ex((5, 6, 7, 8, 9, EOS), 4, 1), ex((5, 6, 7, 1), 2, 0)) is True


def test_prefix_sources_longest_first_then_by_row():
    batch = [
        ex([5, 6, 7, EOS], 2, 0),  # 0: plan, whole 5 6 7
        ex([5, 6, 7, 8, 9, 3, EOS], 5, 1),  # 1: action: starts with rows 0 (k 3), 2 (k 2), 3 (k 2)
        ex([5, 6, EOS], 1, 2),  # 2: reflect, whole 5 6
        ex([5, 6, EOS], 1, 0),  # 3: plan, whole 5 6 (same k as row 2: by row)
        ex([5, 6, 7, EOS], 2, 1),  # 4: action: its context (2 tokens) holds no whole example of 2 tokens
    ]
    assert prefix_sources(batch) == [[], [(0, 3), (2, 2), (3, 2)], [], [], []]
    assert prefix_sources([]) == []
    assert prefix_sources([batch[1]]) == [[]]
    # a row is never its own source, even where its text would qualify against another role's copy of itself
    twin = [ex([5, 6, 7, 8, EOS], 4, 0), ex([5, 6, 7, 8, EOS], 4, 1)]
    assert prefix_sources(twin) == [[], []]


def test_prefix_sources_ties_by_row_whatever_the_batch_order():
    batch = [
        ex([1, 2, 3, 4, 5, 6, EOS], 5, 1),  # 0: consumer
        ex([1, 2, 9], 1, 2),  # 1: whole 1 2 (k 2)
        ex([1, 2, 3, 8], 2, 0),  # 2: whole 1 2 3 (k 3)
        ex([1, 2, 7], 1, 0),  # 3: whole 1 2 (k 2)
    ]
    assert prefix_sources(batch)[0] == [(2, 3), (1, 2), (3, 2)]


@pytest.mark.parametrize(
    "max_group, share, message",
    [
        (0, 0.0, "max_group must be >= 1, got 0"),
        (-3, 0.0, "max_group must be >= 1, got -3"),
        (2, -0.01, "min_length_share must be in [0, 1], got -0.01"),
        (2, 1.01, "min_length_share must be in [0, 1], got 1.01"),
    ],
)
def test_cross_role_groups_refuses_bad_settings(max_group, share, message):
    with pytest.raises(ValueError) as err:
        cross_role_groups([ex([1, 2, EOS], 1, 0)], max_group, share)
    assert str(err.value) == message


def chain3():
    """plan -> action -> reflect: each context starts with the previous role's whole example."""
    return [
        ex([1, 2, 3, EOS], 2, 0),  # 0: plan, whole 1 2 3 (3 tokens)
        ex([1, 2, 3, 4, 5, 6, EOS], 5, 1),  # 1: action, context 1 2 3 4 5, whole 1..6
        ex([1, 2, 3, 4, 5, 6, 7, 8, EOS], 7, 2),  # 2: reflect, context 1..7
    ]


def test_groups_link_a_whole_chain_up_to_max_group():
    assert cross_role_groups(chain3(), 3) == [[0, 1, 2]]
    assert cross_role_groups(chain3(), 4) == [[0, 1, 2]]
    # at 2: the longest consumer (reflect) takes its longest source (action) first; plan is left alone
    assert cross_role_groups(chain3(), 2) == [[0], [1, 2]]
    assert cross_role_groups(chain3()) == [[0], [1, 2]]  # the default max_group
    assert cross_role_groups(chain3(), 1) == [[0], [1], [2]]
    assert cross_role_groups([], 2) == []


def test_groups_min_length_share_bounds_the_chain():
    # lengths (with EOS) 4, 7, 9: the whole chain's share is 4/9 = 0.444; the pair action->reflect 7/9 = 0.778
    assert cross_role_groups(chain3(), 3, 4 / 9) == [[0, 1, 2]]
    assert cross_role_groups(chain3(), 3, 4 / 9 + 1e-9) == [[0], [1, 2]]
    assert cross_role_groups(chain3(), 3, 7 / 9) == [[0], [1, 2]]
    assert cross_role_groups(chain3(), 3, 7 / 9 + 1e-9) == [[0], [1], [2]]  # and plan->action alone: 4/7 = 0.571
    assert cross_role_groups(chain3(), 3, 1.0) == [[0], [1], [2]]
    assert cross_role_groups(chain3(), 3, 0.0) == [[0, 1, 2]]


def test_groups_pick_the_longest_source_then_a_shorter_one():
    examples = [
        ex([1, 2, EOS], 1, 0),  # 0: plan, whole 1 2
        ex([1, 2, 3, 4, EOS], 3, 2),  # 1: reflect, context 1 2 3, whole 1 2 3 4
        ex([1, 2, 3, 4, 5, 6, EOS], 5, 1),  # 2: action, context 1..5: sources 1 (k 4) and 0 (k 2)
        ex([1, 2, 3, 4, 5, 6, EOS], 5, 1),  # 3: a second identical action: source 1 is taken, so 0 (k 2)
    ]
    assert cross_role_groups(examples, 2) == [[0, 3], [1, 2]]
    # a source serves one consumer: a third identical action finds none left
    examples.append(ex([1, 2, 3, 4, 5, 6, EOS], 5, 1))
    assert cross_role_groups(examples, 2) == [[0, 3], [1, 2], [4]]


def test_groups_consumers_go_longest_first_then_by_index():
    examples = [
        ex([1, 2, EOS], 1, 0),  # 0: the one source, whole 1 2
        ex([1, 2, 3, 4, EOS], 3, 1),  # 1: consumer, 5 tokens
        ex([1, 2, 3, 4, 5, EOS], 3, 1),  # 2: consumer, 6 tokens: the longest takes the source
        ex([1, 2, 3, 4, 5, EOS], 3, 1),  # 3: consumer, 6 tokens, after 2
    ]
    assert cross_role_groups(examples, 2) == [[0, 2], [1], [3]]
    examples[3] = ex([1, 2, 3, 4, 5, 6, EOS], 3, 1)  # now 3 is the longest
    assert cross_role_groups(examples, 2) == [[0, 3], [1], [2]]


def test_groups_need_the_whole_source_inside_the_context():
    examples = [ex([1, 2, 3, EOS], 2, 0), ex([1, 2, 3, 4, EOS], 3, 1)]  # k 3 == context 3
    assert cross_role_groups(examples, 2) == [[0], [1]]
    examples[1] = ex([1, 2, 3, 4, EOS], 4, 1)  # k 3 < context 4
    assert cross_role_groups(examples, 2) == [[0, 1]]


def test_groups_skip_the_same_role_a_packed_example_and_a_different_text():
    consumer = ex([1, 2, 3, 4, 5, EOS], 4, 1)
    assert cross_role_groups([ex([1, 2, EOS], 1, 1), consumer], 2) == [[0], [1]]  # same role
    packed = ex([1, 2, EOS], 1, 0, segments=((1, (2, EOS)),))
    assert cross_role_groups([packed, consumer], 2) == [[0], [1]]
    assert cross_role_groups([ex([1, 3, EOS], 1, 0), consumer], 2) == [[0], [1]]  # other text
    assert cross_role_groups([ex([1, 2, EOS], 2, 0), consumer], 2) == [[0], [1]]  # no output: not a source
    assert cross_role_groups([ex([1, 2, EOS], 1, 0), consumer], 2) == [[0, 1]]
    # a same-role copy listed first does not hide another role's copy of the same text
    assert cross_role_groups([ex([1, 2, EOS], 1, 1), ex([1, 2, EOS], 1, 0), consumer], 2) == [[0], [1, 2]]


def test_groups_the_size_cap_counts_both_chains():
    # two pairs (plan->action) and (reflect2->...): joining a chain of 2 onto a chain of 2 needs max_group 4
    examples = [
        ex([1, 2, EOS], 1, 0),  # 0: plan
        ex([1, 2, 3, 4, EOS], 3, 1),  # 1: action: source 0 (k 2)
        ex([1, 2, 3, 4, 5, 6, EOS], 5, 2),  # 2: reflect: source 1 (k 4) or 0 (k 2)
    ]
    assert cross_role_groups(examples, 2) == [[0], [1, 2]]  # reflect (longest) first takes action
    assert cross_role_groups(examples, 3) == [[0, 1, 2]]


def test_groups_a_chain_grows_at_both_ends_within_the_cap():
    # the chain's root is its last consumer: a link made later at its head counts the whole chain
    examples = [
        ex([1, 2, EOS], 1, 0),  # 0 plan
        ex([1, 2, 3, 4, EOS], 3, 1),  # 1 action: source 0
        ex([1, 2, 3, 4, 5, 6, EOS], 5, 2),  # 2 reflect: source 1
        ex([1, 2, 3, 4, 5, 6, 7, 8, EOS], 7, 0),  # 3 plan again: source 2
    ]
    assert cross_role_groups(examples, 4) == [[0, 1, 2, 3]]
    assert cross_role_groups(examples, 3) == [[0], [1, 2, 3]]
    assert cross_role_groups(examples, 2) == [[0, 1], [2, 3]]
    # the share against the chain's longest (its root), not against the consumer being linked
    lens = [3, 5, 7, 9]
    assert cross_role_groups(examples, 4, 3 / 9) == [[0, 1, 2, 3]]
    assert cross_role_groups(examples, 4, 3 / 7 + 1e-9) == [[0], [1, 2, 3]]
    assert lens == [len(e.input_ids) for e in examples]


def test_groups_cover_every_index_once_on_a_bigger_set():
    examples = []
    for i in range(6):
        base = [10 + i, 20 + i]
        examples += [
            ex([*base, 1, EOS], 2, 0),
            ex([*base, 1, 2, 3, EOS], 4, 1),
            ex([*base, 1, 2, 3, 4, 5, EOS], 6, 2),
        ]
    groups = cross_role_groups(examples, 3)
    assert sorted(i for g in groups for i in g) == list(range(len(examples)))
    assert sorted(groups) == [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(6)]
    assert cross_role_groups(examples, 2) == [g for i in range(6) for g in ([3 * i], [3 * i + 1, 3 * i + 2])]
