"""Episodes started from a template row (``LRAGENT_PROMPT_TEMPLATE=1``) are the episodes computed without it
(tiny model, byte tokenizer, CPU), and the openings' shared tokens are copied, not computed."""

from __future__ import annotations

import pytest
from conftest import tiny_multi_lora
from test_batched_executor import ByteTokenizer, _tasks

from eval_suite.evaluate.batched_executor import BatchedExecutor
from eval_suite.evaluate.prompt_template import MIN_SHARED_TOKENS, PromptTemplate, prompt_template_enabled
from lragent.agents import AgentConfig, get_spec
from lragent.agents.prompts import initial_text
from lragent.engine import Engine


def _run(monkeypatch, template: bool, scheme: str, temperature: float, fed: int, budget: int, constrained: bool,
         ahead: bool = False):  # fmt: skip
    monkeypatch.setenv("LRAGENT_PROMPT_TEMPLATE", "1" if template else "0")
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    spec = get_spec("hotpotqa")
    cfg = AgentConfig(max_steps=3, thought_tokens=6, action_type_tokens=3, argument_tokens=4, reflect_tokens=3)
    ex = BatchedExecutor(model, ByteTokenizer(), batch=3, capacity=4096, temperature=temperature, top_p=0.75,
                         droidspeak_layers=[1, 2], eos_token_ids=[], prefill_in_decode=fed,
                         feed_budget=budget, launch_ahead=ahead)  # fmt: skip
    results = {t.key: r for t, r in ex.run(_tasks(spec, cfg, 5, scheme, constrained))}
    return ex, results


@pytest.mark.parametrize(
    ("scheme", "temperature", "fed", "budget", "constrained", "ahead"),
    [
        ("non_shared", 0.0, 0, 0, False, False),
        ("base_lr_shared", 0.9, 0, 0, False, False),
        ("full_shared", 0.9, 0, 0, True, False),
        ("base_shared", 0.9, 0, 0, False, False),
        ("droidspeak", 0.9, 0, 0, True, False),
        ("non_shared", 0.9, 32, 5, False, False),  # the rest of each opening fed through the decode steps
        ("base_lr_shared", 0.9, 32, 64, True, True),  # and rows opened while the next steps are already queued
    ],
)
def test_episodes_from_a_template_row_are_the_episodes_without_it(monkeypatch, scheme, temperature, fed, budget,
                                                                   constrained, ahead):  # fmt: skip
    plain_ex, plain = _run(monkeypatch, False, scheme, temperature, fed, budget, constrained, ahead)
    ex, templ = _run(monkeypatch, True, scheme, temperature, fed, budget, constrained, ahead)
    assert templ.keys() == plain.keys()
    for key in plain:
        assert templ[key].trajectory == plain[key].trajectory, key
        assert templ[key].answer == plain[key].answer and templ[key].num_tokens == plain[key].num_tokens, key
    # every opening copied what it shares with the first one (the first: all but its last token), nothing else
    spec = get_spec("hotpotqa")
    openings = [initial_text(spec, f"Q{i}: is it {i}?").encode() for i in range(5)]
    shared = [next(n for n in range(len(o)) if n == len(o) - 1 or o[n] != openings[0][n]) for o in openings]
    assert shared[0] == len(openings[0]) - 1 and min(shared) >= MIN_SHARED_TOKENS
    assert ex.template_tokens == sum(shared) and plain_ex.template_tokens == 0

    # the copied tokens are the ones no longer computed: by the plan role, and under non_shared by every role at its
    # first call (each computes the whole context in its own caches)
    def prefill(res: dict, roles: list[str]) -> int:
        return sum(r.role_stats[role].prefill_tokens for r in res.values() for role in roles if role in r.role_stats)

    assert prefill(plain, ["plan"]) - prefill(templ, ["plan"]) == sum(shared)
    spared = sum(
        n * sum(1 for stats in plain[key].role_stats.values() if stats.calls) if scheme == "non_shared" else n
        for key, n in zip(sorted(plain, key=lambda k: int(k[2])), shared, strict=True)
    )
    assert spared > sum(shared) or scheme != "non_shared"
    every = ["plan", "action", "reflect"]
    assert prefill(plain, every) - prefill(templ, every) == spared


def test_an_opening_of_another_role_or_too_short_a_share_is_appended_whole():
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    eng = Engine(model, "base_lr_shared", rows=3, capacity=256, eos_token_ids=[])
    template = PromptTemplate(row=2)
    first = list(range(1, 41))
    assert template.open(eng, 0, first, role=0) == [40]  # made from this opening: all but its last token copied
    assert eng.ids(2) == first and eng.ids(0) == first[:-1] and template.copied_tokens == 39
    assert template.open(eng, 1, first[:10] + [99] * 20, role=0) == first[:10] + [99] * 20  # 10 < MIN_SHARED_TOKENS
    assert template.open(eng, 1, first[:20] + [7], role=1) == first[:20] + [7]  # the template holds role 0's caches
    assert eng.ids(1) == [] and template.copied_tokens == 39
    eng.append(0, [40])
    with pytest.raises(ValueError, match="row 0 is not empty: a template only opens a new episode's row"):
        template.open(eng, 0, first, role=0)


def test_the_switch_reads_0_or_1_and_names_a_bad_value(monkeypatch):
    monkeypatch.delenv("LRAGENT_PROMPT_TEMPLATE", raising=False)
    assert prompt_template_enabled() is False
    monkeypatch.setenv("LRAGENT_PROMPT_TEMPLATE", "1")
    assert prompt_template_enabled() is True
    monkeypatch.setenv("LRAGENT_PROMPT_TEMPLATE", "yes")
    with pytest.raises(ValueError, match=r"LRAGENT_PROMPT_TEMPLATE='yes': allowed 0 \(off\) or 1"):
        prompt_template_enabled()


def test_the_share_counts_from_the_first_token_and_a_share_of_the_minimum_is_copied():
    """An opening whose first token differs shares nothing, whatever follows; one that shares exactly
    MIN_SHARED_TOKENS is copied; the copied count adds up over the rows opened."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    eng = Engine(model, "base_lr_shared", rows=4, capacity=256, eos_token_ids=[])
    template = PromptTemplate(row=3)
    first = list(range(1, 41))
    assert template.open(eng, 0, first, role=0) == [40] and template.copied_tokens == 39
    other_start = [99, *first[1:30], 7]
    assert template.open(eng, 1, other_start, role=0) == other_start and eng.ids(1) == []
    edge = [*first[:MIN_SHARED_TOKENS], 98, 97]
    assert template.open(eng, 2, edge, role=0) == [98, 97] and eng.ids(2) == first[:MIN_SHARED_TOKENS]
    assert template.copied_tokens == 39 + MIN_SHARED_TOKENS
