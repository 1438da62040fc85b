"""The batched executor runs the same episodes as the sequential one (tiny model, byte tokenizer, CPU).

Each episode's rows in the batch are independent, sampling noise depends only on the episode seed and the token
index, and constrained choices are scored on the episode's own row; so a batch of episodes (rows refilled as
episodes end) must produce exactly the trajectories and answers of running them one after another.
"""

from __future__ import annotations

import pytest
from conftest import tiny_multi_lora

from eval_suite.evaluate.batched_executor import BatchedExecutor
from eval_suite.evaluate.executors import EpisodeTask, SequentialExecutor
from lragent.agents import AgentConfig, AgentLoop, SessionPolicy, get_spec
from lragent.agents.constraints import YES_NO
from lragent.session import MultiAgentSession


class ByteTokenizer:
    """One token per UTF-8 byte (the tiny models have a 256-token vocabulary)."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", "replace")


def _tasks(spec, cfg, n: int, scheme: str, constrained: bool) -> list[EpisodeTask]:
    loop = AgentLoop(None, spec, cfg)
    tasks = []
    for i in range(n):
        kwargs = {"action_types": ["Search", "Finish"], "answer_options": YES_NO} if constrained else {}
        episode = loop.episode(f"Q{i}: is it {i}?", lambda a, b, i=i: f"obs {i} {a}", **kwargs)
        tasks.append(EpisodeTask(key=(scheme, 0, str(i)), scheme=scheme, seed=1000 + i, question=None, episode=episode))
    return tasks


@pytest.mark.parametrize(
    ("scheme", "temperature", "constrained", "fed", "budget"),
    [
        ("base_lr_shared", 0.0, False, 0, 0),
        ("non_shared", 0.9, False, 0, 0),
        ("droidspeak", 0.9, True, 0, 0),
        ("non_shared", 0.9, False, 32, 0),  # agent calls' new tokens fed through the decode step
        ("base_lr_shared", 0.9, True, 32, 0),
        ("base_lr_shared", 0.9, False, 32, 5),  # with 5 extra token rows per step for them (too few: lent in turn)
        ("droidspeak", 0.9, True, 32, 64),
    ],
)
def test_batched_equals_sequential(scheme, temperature, constrained, fed, budget):
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    tok = ByteTokenizer()
    spec = get_spec("hotpotqa")
    cfg = AgentConfig(max_steps=3, thought_tokens=6, action_type_tokens=3, argument_tokens=4, reflect_tokens=3)

    def factory(task: EpisodeTask):
        def new_session():
            return MultiAgentSession(model, task.scheme, tokenizer=tok, eos_token_ids=[], droidspeak_layers=[1, 2])

        return SessionPolicy(new_session, temperature=temperature, top_p=0.75, seed=task.seed)

    seq = {t.key: r for t, r in SequentialExecutor(factory).run(_tasks(spec, cfg, 5, scheme, constrained))}
    batched_ex = BatchedExecutor(model, tok, batch=3, capacity=4096, temperature=temperature, top_p=0.75,
                                 droidspeak_layers=[1, 2], eos_token_ids=[], prefill_in_decode=fed,
                                 feed_budget=budget)  # fmt: skip
    bat = {t.key: r for t, r in batched_ex.run(_tasks(spec, cfg, 5, scheme, constrained))}
    assert seq.keys() == bat.keys()
    for key in seq:
        assert bat[key].trajectory == seq[key].trajectory, key
        assert bat[key].answer == seq[key].answer
        assert bat[key].num_tokens == seq[key].num_tokens


@pytest.mark.parametrize(("invariant", "budget"), [(False, 0), (True, 0), (False, 3), (True, 3)])
def test_batch_invariant_decodes_every_step_at_the_full_width(monkeypatch, invariant: bool, budget: int) -> None:
    """batch_invariant: an engine of `batch` rows even for fewer tasks, and every decode step at that width (GPU
    kernels choose their summation order by the width); the episodes are the same as without it. Without it the
    width follows the busy rows (the control: the widths seen then are not all the batch). With extra token rows for
    fed tokens (`feed_budget`), batch-invariant steps all have them (one width); otherwise only while some row feeds."""
    from lragent.engine import Engine

    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    tok = ByteTokenizer()
    spec = get_spec("hotpotqa")
    cfg = AgentConfig(max_steps=2, thought_tokens=5, action_type_tokens=3, argument_tokens=4, reflect_tokens=3)
    widths: list[int] = []
    rows_seen: list[int] = []
    step, init = Engine._decode_step, Engine.__init__

    extras: list[int] = []

    def spy_step(self, b, sampling, max_len, extra=0):
        widths.append(b)
        extras.append(extra)
        return step(self, b, sampling, max_len, extra)

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        rows_seen.append(self.rows)

    monkeypatch.setattr(Engine, "_decode_step", spy_step)
    monkeypatch.setattr(Engine, "__init__", spy_init)
    fed = {"prefill_in_decode": 32, "feed_budget": budget} if budget else {}
    ex = BatchedExecutor(model, tok, batch=4, capacity=4096, temperature=0.9, top_p=0.75, eos_token_ids=[],
                         batch_invariant=invariant, **fed)  # fmt: skip
    got = {t.key: r.trajectory for t, r in ex.run(_tasks(spec, cfg, 3, "base_lr_shared", False))}
    plain = BatchedExecutor(model, tok, batch=4, capacity=4096, temperature=0.9, top_p=0.75, eos_token_ids=[])
    monkeypatch.setattr(Engine, "_decode_step", step)
    ref = {t.key: r.trajectory for t, r in plain.run(_tasks(spec, cfg, 3, "base_lr_shared", False))}
    assert got == ref  # the same episodes either way (on the CPU the widths do not change the numbers)
    assert widths
    if invariant:
        assert rows_seen[0] == 4 and set(widths) == {4}  # 3 tasks, yet 4 rows, every step at width 4
        assert set(extras) == {budget}  # and every step with the same extra rows
    else:
        assert rows_seen[0] == 3  # rows for the tasks
        assert budget or min(widths) < 3  # the width shrinks with the busy rows (this schedule's tail, without extra)
        assert set(extras) == {0, budget}  # extra rows only while some row feeds


def test_concurrent_schemes_run_the_episodes_of_one_scheme_at_a_time() -> None:
    """Every scheme on its own engine at once (the host serving one while the device runs the others) runs exactly
    the episodes of one scheme at a time: each engine sees the same calls in the same order. Three schemes of
    unequal task counts, fewer rows than tasks (rows refilled), sampling at 0.9, calls fed through the decode step."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    tok = ByteTokenizer()
    spec = get_spec("hotpotqa")
    cfg = AgentConfig(max_steps=3, thought_tokens=6, action_type_tokens=3, argument_tokens=4, reflect_tokens=3)
    counts = {"non_shared": 3, "base_lr_shared": 4, "droidspeak": 2}

    def tasks() -> list[EpisodeTask]:
        return [t for s, n in counts.items() for t in _tasks(spec, cfg, n, s, constrained=s == "droidspeak")]

    def run(concurrent: bool) -> tuple[dict, list]:
        ex = BatchedExecutor(model, tok, batch=2, capacity=4096, temperature=0.9, top_p=0.75, droidspeak_layers=[1, 2],
                             eos_token_ids=[], prefill_in_decode=32, feed_budget=5,
                             concurrent_schemes=concurrent)  # fmt: skip
        order, out = [], {}
        for task, result in ex.run(tasks()):
            order.append(task.key[0])
            out[task.key] = result
        return out, order

    one, one_order = run(False)
    together, order = run(True)
    assert one.keys() == together.keys() and len(one) == sum(counts.values())
    for key in one:
        assert together[key].trajectory == one[key].trajectory, key
        assert together[key].answer == one[key].answer
        assert together[key].num_tokens == one[key].num_tokens
    # one at a time finishes every episode of a scheme before the next starts; together they interleave
    assert one_order == sorted(one_order, key=list(counts).index)
    assert order != one_order


def test_launch_ahead_queues_the_rows_still_generating_before_answering_and_runs_the_same_episodes(
    monkeypatch,
) -> None:
    """With ``launch_ahead`` the executor queues the next steps of the rows still generating right after a collect
    that ended some rows' calls, before it answers them (their tools, prompts and next starts): the device decodes
    while the host works. The episodes are those of the plain loop: more tasks than rows, sampling at 0.9, calls fed
    through the decode step."""
    from lragent.engine import Engine

    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    tok = ByteTokenizer()
    spec = get_spec("hotpotqa")
    cfg = AgentConfig(max_steps=2, thought_tokens=5, action_type_tokens=3, argument_tokens=3, reflect_tokens=3)

    def run(ahead: bool) -> tuple[dict, list]:
        ex = BatchedExecutor(model, tok, batch=2, capacity=4096, temperature=0.9, top_p=0.75, eos_token_ids=[],
                             prefill_in_decode=32, feed_budget=5, launch_ahead=ahead)  # fmt: skip
        events: list = []
        for name in ("launch", "collect", "advance"):
            real = getattr(Engine, name)
            monkeypatch.setattr(Engine, name, lambda self, *a, _r=real, _n=name, **k: (
                events.append((_n, len(self._pending))), _r(self, *a, **k))[1])  # fmt: skip
        real_answer = ex._timed_answer
        monkeypatch.setattr(ex, "_timed_answer", lambda *a: (events.append(("answer", None)), real_answer(*a))[1])
        tasks = _tasks(spec, cfg, 4, "base_lr_shared", constrained=False)
        out = {task.key: result for task, result in ex.run(tasks)}
        monkeypatch.undo()
        return out, events

    plain, plain_events = run(False)
    ahead, events = run(True)
    assert plain.keys() == ahead.keys() and len(plain) == 4
    for key in plain:
        assert ahead[key].trajectory == plain[key].trajectory, key
        assert ahead[key].num_tokens == plain[key].num_tokens
    assert not any(name == "launch" for name, _ in plain_events)  # the plain loop: advance (launch + collect) only
    assert not any(name == "advance" for name, _ in events)
    # after a collect, the rows still generating are launched before the first answer of the rows that finished
    overlapped = [i for i in range(1, len(events) - 1) if events[i - 1][0] == "collect" and events[i][0] == "launch"
                  and events[i + 1][0] == "answer"]  # fmt: skip
    assert overlapped, events[:40]
    assert all(events[i][1] > 0 for i in overlapped)


def test_one_scheme_at_a_time_holds_one_engine_at_a_time(monkeypatch) -> None:
    """Run one scheme at a time, the executor has let the previous scheme's engine go when it makes the next one (the
    memory plan and the study's estimate count one engine: two alive at once would need both schemes' caches)."""
    import gc
    import weakref

    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    spec = get_spec("hotpotqa")
    cfg = AgentConfig(max_steps=2, thought_tokens=4, action_type_tokens=3, argument_tokens=3, reflect_tokens=3)
    ex = BatchedExecutor(model, ByteTokenizer(), batch=2, capacity=4096, temperature=0.9, top_p=0.75,
                         eos_token_ids=[])  # fmt: skip
    made: list[weakref.ref] = []
    alive_at_creation: list[int] = []
    real = ex._engine

    def engine(scheme, rows):
        gc.collect()
        alive_at_creation.append(sum(r() is not None for r in made))
        eng = real(scheme, rows)
        made.append(weakref.ref(eng))
        return eng

    monkeypatch.setattr(ex, "_engine", engine)
    tasks = [t for s in ("non_shared", "base_lr_shared", "full_shared") for t in _tasks(spec, cfg, 2, s, False)]
    assert len(list(ex.run(tasks))) == 6
    assert alive_at_creation == [0, 0, 0]


def test_the_profile_switch_writes_one_table_of_the_decode_calls_it_names(tmp_path, monkeypatch) -> None:
    """``LRAGENT_EVAL_PROFILE=DIR:FIRST:COUNT``: the executor's run creates DIR and writes one
    ``eval_profile_<pid>.txt`` whose header names the decode calls from FIRST to at least FIRST + COUNT, with the
    Python profile of the same calls (the engine's functions in it)."""
    import os
    import re

    from eval_suite.evaluate.batched_executor import PROFILE_ENV, PY_PROFILE_HEADING

    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    cfg = AgentConfig(max_steps=2, thought_tokens=4, action_type_tokens=3, argument_tokens=3, reflect_tokens=2)
    folder = tmp_path / "prof" / "nested"
    monkeypatch.setenv(PROFILE_ENV, f"{folder}:1:3")
    ex = BatchedExecutor(model, ByteTokenizer(), batch=1, capacity=4096, temperature=0.9, top_p=0.75, eos_token_ids=[])
    assert len(list(ex.run(_tasks(get_spec("hotpotqa"), cfg, 1, "base_lr_shared", False)))) == 1
    assert ex.decode_steps >= 6
    assert [p.name for p in folder.iterdir()] == [f"eval_profile_{os.getpid()}.txt"]
    text = (folder / f"eval_profile_{os.getpid()}.txt").read_text()
    start, end = map(int, re.match(r"decode calls (\d+)\.\.(\d+), wall \d+\.\d{3} s\n\n", text).groups())
    assert start >= 1 and end >= start + 3 and "Name" in text
    py = text.split(f"{PY_PROFILE_HEADING}\n", 1)[1]  # the host's own profile, same calls
    assert "cumulative" in py and "engine.py" in py


def test_the_sequential_executor_skips_only_the_tasks_another_process_claimed() -> None:
    """A task whose claim fails is skipped and the executor goes on with the next ones; each task it takes runs to
    its end with its own fresh policy (a scripted one: thought, Finish, the task's own answer)."""
    from lragent.agents import ScriptedPolicy

    spec = get_spec("hotpotqa")
    loop = AgentLoop(None, spec, AgentConfig(max_steps=1))
    claims = {"0": True, "1": False, "2": False, "3": True}
    asked, made = [], []

    def claim(qid: str):
        return lambda: asked.append(qid) or claims[qid]

    tasks = [
        EpisodeTask(("non_shared", 0, q), "non_shared", 7, None, loop.episode(f"Q{q}?", lambda a, b: "obs"), claim(q))
        for q in claims
    ]

    def factory(task: EpisodeTask) -> ScriptedPolicy:
        made.append(task.key[2])
        return ScriptedPolicy(["thinking", "Finish", f"answer {task.key[2]}"])

    done = [(task.key[2], result.candidate) for task, result in SequentialExecutor(factory).run(tasks)]
    assert done == [("0", "answer 0"), ("3", "answer 3")]
    assert asked == ["0", "1", "2", "3"] and made == ["0", "3"]  # every claim asked once, a policy per taken task
