"""scripts/prefix_reuse_share.py: the longest other-role whole example that starts a context, before its split."""

from __future__ import annotations

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def share():
    return load_script("prefix_reuse_share")


def test_reusable_lengths_by_hand(share) -> None:
    eos = 0
    examples = [
        (0, [5, 6, 7, eos], 2),  # plan: whole example 5 6 7 (3 tokens)
        (0, [5, 6, eos], 1),  # plan: whole example 5 6
        (1, [5, 6, 7, 8, 9, eos], 4),  # action: starts with both plan examples; the longest fitting its split is 3
        (1, [5, 6, 7, 8, 9, 1, eos], 2),  # action: split 2 leaves room for "5 6" only
        (2, [5, 6, 7, 8, 9, 2, eos], 5),  # reflect: starts with the first action's whole example (5 tokens)
        (0, [5, 6, 7, 8, 9, 3, eos], 6),  # plan: the same-role examples do not count; the action example does
        (2, [6, 5, eos], 2),  # no example starts it
    ]
    assert share.reusable_lengths(examples) == [0, 0, 3, 2, 5, 5, 0]
