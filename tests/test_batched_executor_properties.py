"""Properties of the batched executor's scheduling (eval_suite/evaluate/batched_executor.py), against a sequential
reference.

The engine is replaced by a deterministic stand-in whose answers depend on the row's trajectory and on every field
of the request (role id, seed, temperature, top-p, budget, stop strings), and whose generations take an unequal
number of decode steps; episodes record every reply they get. Pinned: for any batch size, every episode gets
exactly the replies of running it alone (its own trajectory, reset between tasks; generate call ``i`` seeded with
``seed + i``; choices scored on its own row; reply statistics), each task runs once, schemes run group by group
in order, an engine has ``min(batch, tasks)`` rows and the executor's settings, freed rows are refilled lowest
first with the next task in order, a reserved engine is used only when it fits, and generated tokens are counted.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import eval_suite.evaluate.batched_executor as be
from eval_suite.evaluate.batched_executor import BatchedExecutor
from eval_suite.evaluate.executors import EpisodeTask
from lragent.agents.requests import Choose, Generate, Reply, StepStats, best_option
from lragent.engine import GenerationRequest, StepResult

ROLE_IDS = {"plan": 2, "action": 0, "reflect": 1}  # not the identity: a role must be looked up


class Tokenizer:
    """One token per character; like Hugging Face tokenizers it adds a BOS token (0) unless told not to, and like
    their fast (Rust) encoders it takes only a real bool for that flag."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        if not isinstance(add_special_tokens, bool):
            raise TypeError(f"add_special_tokens must be a bool, got {add_special_tokens!r}")
        return {"input_ids": ([0] if add_special_tokens else []) + [ord(c) for c in text]}


def _enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def _fake_model(device: str = "cpu") -> types.SimpleNamespace:
    param = types.SimpleNamespace(device=torch.device(device))
    return types.SimpleNamespace(
        model=types.SimpleNamespace(parameters=lambda: iter([param])),
        router=types.SimpleNamespace(id=ROLE_IDS.__getitem__),
    )


def _scores(traj: list[int], role: int, options: list[list[int]]) -> list[float]:
    """Deterministic teacher-forced scores that depend on the trajectory, the role and the option's tokens."""
    return [-float(sum((t * 7 + len(traj) * 3 + role) % 11 for t in o)) for o in options]


def _generate(traj: list[int], req: GenerationRequest) -> tuple[str, int]:
    """The text a request generates on a trajectory, and how many decode steps it takes."""
    text = (
        f"<{req.role}|{req.seed}|{req.temperature}|{req.top_p}|{req.max_new_tokens}|{'/'.join(req.stop)}|{len(traj)}>"
    )
    return text, 1 + (req.seed * 5 + len(traj)) % 4


def _result(traj: list[int], req: GenerationRequest, row: int) -> StepResult:
    text, steps = _generate(traj, req)
    ids = _enc(text) + ([] if req.max_new_tokens == 0 else [33])  # a stop token generated, not kept
    return StepResult(
        role=str(req.role),
        prefill_tokens=len(traj) + req.role,
        recomputed_tokens=req.role * 2 + 1,
        generated_ids=ids if req.max_new_tokens else [],
        text=text,
        kept_tokens=len(text),
        prefill_s=0.5 * req.role,
        decode_s=0.25 * steps,
        stop_reason="stop",
        row=row,
    )


class FakeEngine:
    """Stands in for :class:`lragent.engine.Engine`: per-row trajectories, generations that finish after a few steps."""

    built: list[FakeEngine] = []
    during_call: Callable[[], None] = staticmethod(lambda: None)  # what a test looks at inside an engine call
    stream: object = None  # the CUDA stream the engine calls run on (the fake torch.cuda.stream's)

    def __init__(self, model, scheme, *, rows, **kwargs) -> None:
        self.model, self.scheme, self.rows, self.kwargs = model, scheme, rows, kwargs
        self.traj: dict[int, list[int]] = {r: [] for r in range(rows)}
        self.pending: dict[int, list] = {}
        self.placements: list[tuple[int, int]] = []  # (row, length of the trajectory) at each reset
        self.decode_steps = 0
        self.advance_s = 0.0  # seconds in advance() and, of them, reading results back (fake, counted per call)
        self.sync_s = 0.0
        self.replay_s = 0.0  # of advance_s: graph replays; of sync_s: the wait for the device (fake)
        self.wait_s = 0.0
        self.capture_s = 0.0  # of advance_s: graph captures (fake: the first call captures)
        self.feed_rows = self.feed_tokens = 0  # feeding steps' extra rows, and those carrying a fed token (fake)
        self.events: list[tuple[str, object]] = []  # (engine call, its row or the rows generating)
        self.streams = [FakeEngine.stream]  # the stream current when made, then at each launch
        FakeEngine.built.append(self)

    def _row(self, row: int) -> list[int]:
        assert 0 <= row < self.rows, row
        return self.traj[row]

    def reset(self, row: int) -> None:
        self.events.append(("reset", row))
        self._row(row)
        self.placements.append((row, len(self.traj[row])))
        self.traj[row] = []

    def append(self, row: int, ids: list[int]) -> None:
        self.events.append(("append", row))
        assert row not in self.pending, "append while generating"
        self._row(row).extend(ids)

    def ids(self, row: int) -> list[int]:
        return list(self._row(row))

    def score(self, row: int, role: int, options: list[list[int]]) -> list[float]:
        return _scores(self._row(row), role, options)

    def start(self, row: int, req: GenerationRequest) -> StepResult | None:
        self.events.append(("start", row))
        assert row not in self.pending and self._row(row), "start on a busy or empty row"
        if req.max_new_tokens == 0:
            return self._finish(row, req)
        self.pending[row] = [req, _generate(self.traj[row], req)[1]]
        return None

    def _finish(self, row: int, req: GenerationRequest) -> StepResult:
        res = _result(self.traj[row], req, row)
        self.traj[row].extend(_enc(res.text))
        return res

    def advance(self) -> list[StepResult]:
        self.events.append(("advance", len(self.pending)))
        FakeEngine.during_call()
        out = []
        self.decode_steps += 3  # as if each call ran three steps
        self.feed_rows += 8  # with 8 extra rows, 5 of them feeding
        self.feed_tokens += 5
        self.advance_s += 0.5  # and took half a second, a fifth of it reading back
        self.sync_s += 0.1
        self.replay_s += 0.2
        self.wait_s += 0.05
        self.capture_s = 0.3  # once per engine
        for row in sorted(self.pending, reverse=True):  # results come in no particular row order
            self.pending[row][1] -= 1
            if self.pending[row][1] == 0:
                req, _ = self.pending.pop(row)
                out.append(self._finish(row, req))
        return out

    def launch(self) -> int:
        """Queues one step of the rows generating now (a row started before :meth:`collect` joins the next one);
        returns the steps queued, 0 when no row is generating."""
        assert not hasattr(self, "in_flight"), "launch twice without a collect"
        self.streams.append(FakeEngine.stream)
        self.events.append(("launch", len(self.pending)))
        if not self.pending:
            return 0
        self.in_flight = sorted(self.pending)
        self.decode_steps += 3
        self.feed_rows += 8
        self.feed_tokens += 5
        return 3

    def collect(self) -> list[StepResult]:
        """Waits for the launched step: the rows that finished in it."""
        out = []
        for row in reversed(self.__dict__.pop("in_flight")):
            self.pending[row][1] -= 1
            if self.pending[row][1] == 0:
                req, _ = self.pending.pop(row)
                out.append(self._finish(row, req))
        self.events.append(("collect", (len(out), len(self.pending))))  # (rows finished, rows still generating)
        return out


@pytest.fixture(autouse=True)
def fake_engine(monkeypatch):
    FakeEngine.built = []
    monkeypatch.setattr(FakeEngine, "during_call", staticmethod(lambda: None))
    monkeypatch.setattr(be, "Engine", FakeEngine)
    return FakeEngine


# ------------------------------------------------------------------------------------------ episodes

STEP = st.one_of(
    st.tuples(st.just("gen"), st.sampled_from(list(ROLE_IDS)), st.sampled_from(["", "Q", "obs 12"]), st.integers(0, 9)),
    st.tuples(
        st.just("choose"),
        st.sampled_from(list(ROLE_IDS)),
        st.sampled_from(["", "pick:"]),
        st.lists(st.sampled_from(["yes", "no", "maybe", "B", "xyz"]), min_size=1, max_size=3, unique=True),
        st.sampled_from(["sum", "mean"]),
        st.booleans(),
    ),
)
PLAN = st.lists(STEP, max_size=4)


def _episode(plan: list[tuple], first_text: str):
    """Asks for the plan's requests in order; returns every reply it got."""
    replies = []
    for i, step in enumerate(plan):
        text = first_text + step[2] if i == 0 else step[2]
        if step[0] == "gen":
            req = Generate(role=step[1], new_text=text, max_new_tokens=step[3], stop=["\n", f"#{i}"])
        else:
            appends = tuple(f"[{o}]" for o in step[3]) if step[5] else None
            req = Choose(role=step[1], new_text=text, options=tuple(step[3]), score=step[4], appends=appends)
        replies.append((yield req))
    return replies


def _tasks(plans: list[list[tuple]], schemes: list[str] | None = None, seed0: int = 100) -> list[EpisodeTask]:
    schemes = schemes or ["non_shared"] * len(plans)
    return [
        EpisodeTask(key=(s, 0, str(i)), scheme=s, seed=seed0 + 10 * i, question=None, episode=_episode(p, f"T{i}:"))
        for i, (p, s) in enumerate(zip(plans, schemes, strict=True))
    ]


def _alone(task: EpisodeTask, temperature: float, top_p: float) -> list[Reply]:
    """Reference: the episode run by itself, one request at a time, following the documented protocol."""
    traj: list[int] = []
    calls = 0
    episode = task.episode
    try:
        request = next(episode)
        while True:
            traj += _enc(request.new_text)
            if isinstance(request, Choose):
                options = [_enc(o) for o in request.options]
                best = best_option(_scores(traj, ROLE_IDS[request.role], options), [len(o) for o in options],
                                   request.score)  # fmt: skip
                traj += _enc(request.appended(best))
                stats = StepStats(prefill_tokens=sum(map(len, options)), trajectory_tokens=len(traj))
                request = episode.send(Reply(choice=best, stats=stats))
                continue
            req = GenerationRequest(role=ROLE_IDS[request.role], max_new_tokens=request.max_new_tokens,
                                    stop=tuple(request.stop), temperature=temperature, top_p=top_p,
                                    seed=task.seed + calls)  # fmt: skip
            calls += 1
            res = _result(traj, req, 0)
            traj += _enc(res.text)
            stats = StepStats(prefill_tokens=res.prefill_tokens, decode_tokens=len(res.generated_ids),
                              prefill_s=res.prefill_s, decode_s=res.decode_s,
                              recomputed_tokens=res.recomputed_tokens, trajectory_tokens=len(traj))  # fmt: skip
            request = episode.send(Reply(text=res.text, stats=stats))
    except StopIteration as stop:
        return stop.value


def _run(ex: BatchedExecutor, tasks: list[EpisodeTask]) -> dict:
    out = {}
    for task, result in ex.run(tasks):
        assert task.key not in out, f"{task.key} yielded twice"
        out[task.key] = result
    return out


# ------------------------------------------------------------------------------------------ properties


@given(st.lists(PLAN, max_size=6), st.integers(1, 4), st.sampled_from([(0.0, 1.0), (0.7, 0.85)]))
@settings(max_examples=40, deadline=None)
def test_every_episode_gets_the_replies_it_would_get_alone(plans, batch, sampling) -> None:
    temperature, top_p = sampling
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=batch, temperature=temperature, top_p=top_p)
    got = _run(ex, _tasks(plans))
    expected = {t.key: _alone(t, temperature, top_p) for t in _tasks(plans)}
    assert got == expected
    gen_tokens = sum(
        r.stats.decode_tokens for replies in expected.values() for r in replies if r.choice is None and r.stats
    )
    assert ex.generated_tokens == gen_tokens


def test_generate_call_i_of_an_episode_is_seeded_with_seed_plus_i() -> None:
    plan = [("gen", "plan", "", 3), ("choose", "action", "", ["yes", "no"], "sum", False), ("gen", "action", "", 2)]
    plan += [("gen", "reflect", "x", 0), ("gen", "plan", "", 5)]
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=2)
    got = _run(ex, _tasks([plan, plan], seed0=7))
    seeds = [[int(r.text.split("|")[1]) for r in replies if r.choice is None] for replies in got.values()]
    assert sorted(seeds) == [[7, 8, 9, 10], [17, 18, 19, 20]]


def test_engine_gets_min_of_batch_and_tasks_rows_and_the_executor_settings() -> None:
    model, tok = _fake_model(), Tokenizer()
    config = dict(capacity=777, temperature=0.3, top_p=0.6, use_kernel=False, cuda_graphs=True)
    ex = BatchedExecutor(model, tok, batch=3, droidspeak_layers=[4, 1], eos_token_ids=[9, 2], prefill_in_decode=17,
                         **config)  # fmt: skip
    one = [("gen", "plan", "", 1)]
    _run(ex, _tasks([one] * 2, ["droidspeak"] * 2))
    _run(ex, _tasks([one] * 5, ["base_lr_shared"] * 5))
    (e1, e2) = FakeEngine.built
    assert e1.model is model and e2.model is model
    assert (e1.scheme, e1.rows, e2.scheme, e2.rows) == ("droidspeak", 2, "base_lr_shared", 3)
    common = dict(capacity=777, tokenizer=tok, eos_token_ids=[9, 2], use_kernel=False, cuda_graphs=True,
                  prefill_in_decode=17, batch_invariant=False, feed_budget=0)  # fmt: skip
    assert e1.kwargs == {**common, "droidspeak_layers": [4, 1]}
    assert e2.kwargs == {**common, "droidspeak_layers": None}  # recompute layers are DroidSpeak's only
    # batch-invariant: the batch's rows even for fewer tasks, and the engine told so
    FakeEngine.built.clear()
    inv = BatchedExecutor(model, tok, batch=3, batch_invariant=True, eos_token_ids=[9, 2], prefill_in_decode=17,
                          **config)  # fmt: skip
    _run(inv, _tasks([one] * 2, ["base_lr_shared"] * 2))
    (e3,) = FakeEngine.built
    assert e3.rows == 3 and e3.kwargs == {**common, "droidspeak_layers": None, "batch_invariant": True}


def test_decode_steps_are_summed_over_the_engines() -> None:
    """The executor's decode steps (timing.json's hardware-free cost of a run) are its engines' steps, all schemes;
    so are the feeding steps' extra rows and the fed tokens they carried."""
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=2)
    one = [("gen", "plan", "", 2), ("gen", "action", "", 1)]
    _run(ex, _tasks([one] * 3, ["base_lr_shared"] * 2 + ["non_shared"]))
    assert len(FakeEngine.built) == 2 and ex.decode_steps == sum(e.decode_steps for e in FakeEngine.built) > 0
    assert ex.feed_rows == sum(e.feed_rows for e in FakeEngine.built) > 0
    assert ex.feed_tokens == sum(e.feed_tokens for e in FakeEngine.built) > 0


def test_the_loop_time_is_split_between_the_engines_and_the_episodes() -> None:
    """advance_s / sync_s (and their parts replay_s / wait_s / capture_s) are the engines' own (summed over schemes,
    counted by them), agent_s the wall time spent serving the episodes between decode calls: positive, and within the
    whole run's wall time."""
    import time

    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=2)
    one = [("gen", "plan", "", 2), ("gen", "action", "", 1)]
    started = time.perf_counter()
    _run(ex, _tasks([one] * 3, ["base_lr_shared"] * 2 + ["non_shared"]))
    wall = time.perf_counter() - started
    calls = sum(e.decode_steps for e in FakeEngine.built) // 3
    assert ex.advance_s == pytest.approx(0.5 * calls) and ex.sync_s == pytest.approx(0.1 * calls) and calls > 0
    assert ex.replay_s == pytest.approx(0.2 * calls) and ex.wait_s == pytest.approx(0.05 * calls)
    assert ex.capture_s == pytest.approx(0.3 * len(FakeEngine.built))  # a fixed cost per engine, summed over them
    assert 0 < ex.agent_s < wall


def test_constructor_defaults_and_prefill_in_decode_by_device() -> None:
    ex = BatchedExecutor(_fake_model("cpu"), Tokenizer())
    assert (ex.batch, ex.capacity, ex.temperature, ex.top_p, ex.use_kernel) == (64, 8192, 0.0, 1.0, True)
    assert (ex.cuda_graphs, ex.droidspeak_layers, ex.eos_token_ids, ex.generated_tokens) == (None, None, None, 0)
    assert ex.prefill_in_decode == 0  # off where eager decode steps gain nothing
    # on CUDA the prompts are fed too (a HotpotQA prompt is about 1,400 tokens), with extra token rows to feed them
    assert BatchedExecutor(_fake_model("cuda"), Tokenizer()).prefill_in_decode == 2048 == be.PREFILL_IN_DECODE
    assert BatchedExecutor(_fake_model("cuda"), Tokenizer(), prefill_in_decode=0).prefill_in_decode == 0
    # the CUDA default where feeding is on, none where it is off
    assert BatchedExecutor(_fake_model("cuda"), Tokenizer()).feed_budget == 256 == be.FEED_BUDGET
    assert BatchedExecutor(_fake_model("cuda"), Tokenizer(), prefill_in_decode=0).feed_budget == 0
    assert ex.feed_budget == 0 and BatchedExecutor(_fake_model("cpu"), Tokenizer(), feed_budget=4).feed_budget == 4
    with pytest.raises(ValueError, match="feed_budget must be >= 0, got -1"):
        BatchedExecutor(_fake_model("cpu"), Tokenizer(), feed_budget=-1)
    assert BatchedExecutor(_fake_model("cpu"), Tokenizer(), batch=1).batch == 1
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"batch must be >= 1, got {bad}"):
            BatchedExecutor(_fake_model(), Tokenizer(), batch=bad)


def test_schemes_run_group_by_group_in_order_and_every_task_once() -> None:
    one = [("gen", "plan", "", 2)]
    schemes = ["a", "a", "b", "a", "c", "c", "c"]
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=2)
    order = [task.key for task, _ in ex.run(_tasks([one] * len(schemes), schemes))]
    assert sorted(order) == sorted(t.key for t in _tasks([one] * len(schemes), schemes))
    assert [(e.scheme, e.rows) for e in FakeEngine.built] == [("a", 2), ("b", 1), ("a", 1), ("c", 2)]
    # a group's tasks all end before the next group starts
    assert [k[0] for k in order] == schemes
    assert list(ex.run([])) == [] and len(FakeEngine.built) == 4


def test_rows_refill_lowest_free_first_with_the_next_task_in_order() -> None:
    # generation steps: 1 + (seed * 5 + len(trajectory)) % 4, with trajectory "T<i>:" of 3 characters
    plans = [[("gen", "plan", "", 1)] for _ in range(6)]
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=3)
    tasks = _tasks(plans, seed0=0)  # seeds 0, 10, .., 50: steps 4, 2, 4, 2, 4, 2
    steps = [1 + (t.seed * 5 + 3) % 4 for t in tasks]
    assert steps == [4, 2, 4, 2, 4, 2]
    order = [task.key[2] for task, _ in ex.run(tasks)]
    # rows 0, 1, 2 take tasks 0, 1, 2; task 1 (row 1) ends after 2 steps and task 3 takes row 1; 2 steps later
    # tasks 2, 3 and 0 end together (reported as rows 2, 1, 0): tasks 4 and 5 take the lowest rows, 0 and 1
    (eng,) = FakeEngine.built
    assert [row for row, _ in eng.placements] == [0, 1, 2, 1, 0, 1]
    assert order == ["1", "2", "3", "0", "5", "4"]


def test_rows_are_reset_before_each_new_episode() -> None:
    plans = [[("choose", "plan", "", ["yes", "no"], "sum", False)], [("gen", "plan", "", 2)], []]
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=1)
    got = _run(ex, _tasks(plans))
    (eng,) = FakeEngine.built
    assert [row for row, _ in eng.placements] == [0, 0, 0]
    assert [n > 0 for _, n in eng.placements] == [False, True, True]  # a reused row held the previous episode
    assert got == {t.key: _alone(t, 0.0, 1.0) for t in _tasks(plans)}
    assert got[("non_shared", 0, "2")] == []  # an episode that asks nothing ends at once


def test_choices_are_scored_on_the_episode_row_and_the_chosen_text_appended() -> None:
    plans = [[("choose", "action", "ctx", ["yes", "no", "maybe"], "mean", True), ("gen", "plan", "", 0)]] * 3
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=3)
    got = _run(ex, _tasks(plans))
    for key, replies in got.items():
        choice, gen = replies
        assert choice.text == "" and choice.stats.prefill_tokens == len("yes") + len("no") + len("maybe")
        appended = ["[yes]", "[no]", "[maybe]"][choice.choice]
        assert choice.stats.trajectory_tokens == len(f"T{key[2]}:ctx") + len(appended)
        assert gen.stats.trajectory_tokens == choice.stats.trajectory_tokens + len(gen.text)
        assert gen.stats.decode_tokens == 0 and ex.generated_tokens == 0  # a zero budget generates nothing


def test_reserved_engine_is_used_once_and_only_when_it_fits() -> None:
    one = [("gen", "plan", "", 1)]
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=4)
    ex.reserve("s", 3)
    assert len(FakeEngine.built) == 1 and FakeEngine.built[0].rows == 3
    _run(ex, _tasks([one] * 3, ["s"] * 3))  # exactly the reserved rows: reused
    assert len(FakeEngine.built) == 1
    _run(ex, _tasks([one] * 2, ["s"] * 2))  # the reservation was used up
    assert len(FakeEngine.built) == 2
    ex.reserve("s", 9)  # more tasks than rows: reserves the batch, which a smaller run of the scheme reuses
    assert FakeEngine.built[-1].rows == 4
    _run(ex, _tasks([one] * 2, ["s"] * 2))
    assert len(FakeEngine.built) == 3
    ex.reserve("s", 2)
    _run(ex, _tasks([one] * 3, ["s"] * 3))  # too small: a new engine
    assert [e.rows for e in FakeEngine.built] == [3, 2, 4, 2, 3]
    ex.reserve("other", 2)
    _run(ex, _tasks([one] * 2, ["s"] * 2))  # another scheme: a new engine
    assert [(e.scheme, e.rows) for e in FakeEngine.built[-2:]] == [("other", 2), ("s", 2)]
    ex.reserve("s", 0)  # nothing to run: nothing reserved
    assert len(FakeEngine.built) == 7
    _run(ex, _tasks([one], ["s"]))
    assert len(FakeEngine.built) == 8
    ex.reserve("s", 1)  # one task: one row, now
    assert [(e.scheme, e.rows) for e in FakeEngine.built[8:]] == [("s", 1)]
    _run(ex, _tasks([one], ["s"]))
    assert len(FakeEngine.built) == 9


def test_reservation_is_dropped_by_a_run_of_another_scheme() -> None:
    one = [("gen", "plan", "", 1)]
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=2)
    ex.reserve("a", 2)
    _run(ex, _tasks([one], ["b"]))
    _run(ex, _tasks([one], ["a"]))
    assert [e.scheme for e in FakeEngine.built] == ["a", "b", "a"]


def test_no_special_tokens_enter_the_trajectory() -> None:
    plans = [[("gen", "plan", "Q", 1), ("gen", "action", "obs 12", 1)]]
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=1)
    (replies,) = _run(ex, _tasks(plans)).values()
    assert replies[0].stats.trajectory_tokens == len("T0:Q") + len(replies[0].text)


@given(st.lists(PLAN, min_size=1, max_size=6), st.integers(1, 3), st.lists(st.booleans(), min_size=6, max_size=6))
@settings(max_examples=30, deadline=None)
def test_a_task_runs_only_if_its_claim_succeeds_asked_once_when_a_row_is_free(plans, batch, wins) -> None:
    """Tasks of a shared queue (eval --devices N): the executor asks each task's claim once, just before a free row
    starts it, skips those another shard took, and runs the others as they would run alone."""
    events: list[tuple[str, tuple]] = []
    tasks = _tasks(plans)
    for task, win in zip(tasks, wins, strict=False):
        task.claim = lambda key=task.key, win=win: events.append(("claim", key)) or win
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=batch)
    got = {}
    for task, result in ex.run(tasks):
        events.append(("done", task.key))
        got[task.key] = result
    won = [t for t, w in zip(tasks, wins, strict=False) if w]
    assert got == {t.key: _alone(t, 0.0, 1.0) for t in _tasks(plans) if t.key in {w.key for w in won}}
    assert [k for e, k in events if e == "claim"] == [t.key for t in tasks]  # each asked once, in order
    running = 0
    for event, key in events:  # a claim is asked only while a row is free: never more than `batch` running
        if event == "claim" and key in got:
            running += 1
            assert running <= batch
        elif event == "done":
            running -= 1


# ------------------------------------------------------------------------------------------ queued steps


@given(
    st.lists(st.tuples(PLAN, st.sampled_from(["a", "b"])), max_size=6),
    st.integers(1, 3),
    st.sampled_from([(True, False), (False, True), (True, True)]),
)
@settings(max_examples=30, deadline=None)
def test_queued_steps_give_every_episode_the_replies_it_would_get_alone(plans, batch, modes) -> None:
    """With ``launch_ahead`` and/or ``concurrent_schemes`` (steps queued by launch, then collected) every episode
    gets exactly the replies of running it alone, each task runs once and the generated tokens are counted."""
    launch_ahead, concurrent = modes
    FakeEngine.built = []  # this example's engines
    schemes = [s for _, s in plans]
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=batch, temperature=0.7, top_p=0.85,
                         launch_ahead=launch_ahead, concurrent_schemes=concurrent)  # fmt: skip
    got = _run(ex, _tasks([p for p, _ in plans], schemes))
    expected = {t.key: _alone(t, 0.7, 0.85) for t in _tasks([p for p, _ in plans], schemes)}
    assert got == expected
    gen_tokens = sum(
        r.stats.decode_tokens for replies in expected.values() for r in replies if r.choice is None and r.stats
    )
    assert ex.generated_tokens == gen_tokens
    assert ex.decode_steps == sum(e.decode_steps for e in FakeEngine.built)
    assert all(name != "advance" for e in FakeEngine.built for name, _ in e.events)  # queued steps only


def test_launch_ahead_queues_the_rows_still_generating_before_answering_those_that_finished() -> None:
    """With ``launch_ahead``, right after a collect that ended some rows' calls while others still generate, the next
    engine call queues those others' next step, before the host appends to or starts the finished rows; a step is
    queued only while some row generates. Without it, one scheme runs by ``advance`` only."""
    plan = [("gen", "plan", "", 3), ("gen", "action", "x", 2), ("gen", "reflect", "", 4)]
    plans = [plan] * 5
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=3, launch_ahead=True)
    assert ex.launch_ahead is True and BatchedExecutor(_fake_model(), Tokenizer()).launch_ahead is False
    got = _run(ex, _tasks(plans))
    assert got == {t.key: _alone(t, 0.0, 1.0) for t in _tasks(plans)}
    (eng,) = FakeEngine.built
    events = eng.events
    assert not any(name == "advance" for name, _ in events)
    assert all(n > 0 for name, n in events if name == "launch"), events
    overlapped = 0
    for i, (name, rows) in enumerate(events[:-1]):
        if name == "collect" and rows[0] > 0 and rows[1] > 0:  # some calls ended, some rows still generate
            assert events[i + 1][0] == "launch", events[i : i + 3]
            overlapped += 1
    assert overlapped > 0
    plain = BatchedExecutor(_fake_model(), Tokenizer(), batch=3)
    assert _run(plain, _tasks(plans)) == got
    assert {name for name, _ in FakeEngine.built[-1].events} == {"reset", "append", "start", "advance"}


def test_a_failed_claim_does_not_hold_up_the_next_tasks() -> None:
    """A task whose claim fails (another shard runs it) gives its free row to the next task in the same refill:
    the first decode step already runs every row."""
    plan = [("gen", "plan", "", 3), ("gen", "action", "", 2)]
    tasks = _tasks([plan] * 4)
    tasks[1].claim = lambda: False
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=3)
    got = _run(ex, tasks)
    assert sorted(got) == sorted(t.key for i, t in enumerate(tasks) if i != 1)
    (eng,) = FakeEngine.built
    assert [e for e in eng.events if e[0] in ("reset", "advance")][:4] == [
        ("reset", 0), ("reset", 1), ("reset", 2), ("advance", 3)
    ]  # fmt: skip


def test_batch_invariant_keeps_the_batch_rows_for_a_single_task() -> None:
    """Batch-invariant decoding gives the engine ``batch`` rows even for one task (the decode width stays fixed)."""
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=4, batch_invariant=True)
    _run(ex, _tasks([[("gen", "plan", "", 2)]]))
    assert [e.rows for e in FakeEngine.built] == [4]
    assert BatchedExecutor(_fake_model(), Tokenizer(), batch=4)._rows(1) == 1 and ex._rows(0) == 0


def test_describe_names_the_engine_call_in_progress_and_each_lane() -> None:
    """``describe()`` (the stall watchdog's report): between runs no lanes; inside an engine call that call and
    its scheme, the decode steps so far and each lane's active rows and queued tasks; between calls says so."""
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=2)
    assert ex.describe() == "between engine calls; 0 decode steps; lanes: none"
    seen: list[str] = []
    FakeEngine.during_call = staticmethod(lambda: seen.append(ex.describe()))
    beats: list[str] = []
    ex.heartbeat = lambda: beats.append(ex.describe())
    _run(ex, _tasks([[("gen", "plan", "", 2)]] * 3, ["sch"] * 3))
    assert seen[0] == "in sch advance; 0 decode steps; lanes: sch: 2 rows active, 1 queued"
    assert all(x.startswith("in sch advance; ") for x in seen) and len(seen) == len(beats)
    assert beats[0] == "between engine calls; 3 decode steps; lanes: sch: 2 rows active, 1 queued"
    after = ex.describe()
    assert after.startswith("between engine calls; ") and after.endswith("lanes: sch: 0 rows active, 0 queued")
    both = BatchedExecutor(_fake_model(), Tokenizer(), batch=2, concurrent_schemes=True)
    FakeEngine.during_call = staticmethod(lambda: None)
    _run(both, _tasks([[("gen", "plan", "", 2)]] * 3, ["a", "b", "a"]))
    assert both.describe().endswith("lanes: a: 0 rows active, 0 queued, b: 0 rows active, 0 queued")


def test_the_agent_time_sums_every_answer(monkeypatch) -> None:
    """``agent_s`` adds up the host's time in every episode answer: a row's first requests and each reply (a clock
    that moves one second per reading: one second per answer)."""
    clock = iter(range(10**6))
    monkeypatch.setattr(be.time, "perf_counter", lambda: float(next(clock)))
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=2)
    _run(ex, _tasks([[("gen", "plan", "", 2), ("gen", "action", "", 1)]] * 3))
    assert ex.agent_s == 3 * 3  # per task: its start and the reply to each of its two generate calls


class _Stream:
    """Stands in for ``torch.cuda.Stream``: its device and the streams it was told to wait for."""

    def __init__(self, device) -> None:
        self.device, self.waits = device, []

    def wait_stream(self, other) -> None:
        self.waits.append(other)


def test_concurrent_schemes_on_cuda_run_each_lane_on_its_own_stream(monkeypatch) -> None:
    """With ``concurrent_schemes`` on CUDA each scheme's engine is made and driven on a stream of its own, made on
    the model's device and waiting first for that device's current stream (where the model and caches were made);
    one scheme at a time, or off CUDA, every call stays on the current stream."""
    current = {}

    @contextlib.contextmanager
    def stream(s):
        assert s is not None, "torch.cuda.stream(None)"
        old, FakeEngine.stream = FakeEngine.stream, s
        try:
            yield
        finally:
            FakeEngine.stream = old

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: current.setdefault(device, ("current", device)))
    plan = [("gen", "plan", "", 2), ("gen", "action", "", 1)]
    schemes = ["a", "b", "a", "b"]
    ex = BatchedExecutor(_fake_model("cuda"), Tokenizer(), batch=2, concurrent_schemes=True)
    got = _run(ex, _tasks([plan] * 4, schemes))
    assert got == {t.key: _alone(t, 0.0, 1.0) for t in _tasks([plan] * 4, schemes)}
    ea, eb = FakeEngine.built
    assert (ea.scheme, eb.scheme) == ("a", "b") and [lane.name for lane in ex._lanes] == ["a", "b"]
    sa, sb = ea.streams[0], eb.streams[0]
    assert isinstance(sa, _Stream) and isinstance(sb, _Stream) and sa is not sb
    assert sa.device == sb.device == torch.device("cuda")
    assert sa.waits == sb.waits == [("current", torch.device("cuda"))]
    assert set(map(id, ea.streams)) == {id(sa)} and set(map(id, eb.streams)) == {id(sb)}
    assert [lane.stream for lane in ex._lanes] == [sa, sb]
    for model, concurrent in ((_fake_model("cuda"), False), (_fake_model("cpu"), True)):
        FakeEngine.built = []
        _run(BatchedExecutor(model, Tokenizer(), batch=2, concurrent_schemes=concurrent, launch_ahead=True),
             _tasks([plan] * 4, schemes))  # fmt: skip
        assert all(s is None for e in FakeEngine.built for s in e.streams)


def test_the_profile_switch_writes_one_table_of_the_decode_calls_it_names(tmp_path, monkeypatch) -> None:
    """``LRAGENT_EVAL_PROFILE=DIR:FIRST:COUNT`` records from the first engine call at FIRST decode steps until COUNT
    more and writes one ``DIR/eval_profile_<pid>.txt`` naming those decode steps and holding torch's tables;
    ``DIR`` alone means FIRST 300, COUNT 100; unset or empty, no profiler."""
    monkeypatch.delenv(be.PROFILE_ENV, raising=False)
    assert BatchedExecutor(_fake_model(), Tokenizer())._profile is None
    monkeypatch.setenv(be.PROFILE_ENV, "")
    assert be._StepProfiler.from_env() is None
    monkeypatch.setenv(be.PROFILE_ENV, "/x/y")
    p = be._StepProfiler.from_env()
    assert (p.folder, p.first, p.count) == ("/x/y", 300, 100)
    monkeypatch.setenv(be.PROFILE_ENV, "/x/y:7")
    assert (be._StepProfiler.from_env().first, be._StepProfiler.from_env().count) == (7, 100)
    folder = tmp_path / "prof" / "deep"
    monkeypatch.setenv(be.PROFILE_ENV, f"{folder}:3:6:99")
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=2)
    assert (ex._profile.folder, ex._profile.first, ex._profile.count) == (str(folder), 3, 6)
    plan = [("gen", "plan", "", 4), ("gen", "action", "", 3), ("gen", "plan", "", 2)]
    FakeEngine.during_call = staticmethod(lambda: torch.ones(3).add_(1))  # some work for the profiler to see
    _run(ex, _tasks([plan] * 4))
    assert ex.decode_steps >= 30  # the fake engine: 3 steps per call, well past 3 + 6
    name = f"eval_profile_{os.getpid()}.txt"
    assert [f.name for f in folder.iterdir()] == [name]
    text = (folder / name).read_text()
    head, _, rest = text.partition("\n")
    assert head.startswith("decode calls 3..9, wall ") and head.endswith(" s")  # from the call at >= 3 to >= 3 + 6
    assert 0 <= float(head.split("wall ")[1][:-2]) < 60
    # an existing folder is written into
    monkeypatch.setenv(be.PROFILE_ENV, f"{tmp_path}:0:3")
    _run(BatchedExecutor(_fake_model(), Tokenizer(), batch=2), _tasks([plan] * 2))
    assert (tmp_path / name).read_text().startswith("decode calls 0..3, wall ")
    assert rest.count("aten::add_") == 2 and rest.count("Self CPU") >= 2  # the device-time and CPU-time tables


def test_a_template_row_opens_each_episodes_first_request_and_counts_its_copies(monkeypatch) -> None:
    """With the prompt template on, each engine has one row more, the last, the template's; an episode's first request
    (its row's trajectory empty) is opened through the template with its row, its tokens and its role's id, and the
    row takes what the template returns; later requests are not opened; ``template_tokens`` adds up the copies."""
    made, opened, appended = [], [], []

    class Template:
        def __init__(self, row: int) -> None:
            self.row, self.copied_tokens = row, 0
            made.append(self)

        def open(self, eng, row: int, tokens: list[int], role: int) -> list[int]:
            opened.append((eng, row, list(tokens), role, list(eng.traj[row])))
            self.copied_tokens += 5
            return [7, *tokens]

    plain_append = FakeEngine.append

    def append(self, row: int, ids: list[int]) -> None:
        appended.append((row, list(ids)))
        plain_append(self, row, ids)

    monkeypatch.setattr(be, "prompt_template_enabled", lambda: True)
    monkeypatch.setattr(be, "PromptTemplate", Template)
    monkeypatch.setattr(FakeEngine, "append", append)
    ex = BatchedExecutor(_fake_model(), Tokenizer(), batch=2)
    plan = [("gen", "plan", "", 2), ("gen", "action", "x", 1)]
    _run(ex, _tasks([plan] * 3, ["base_lr_shared"] * 3))
    (eng,) = FakeEngine.built
    assert eng.rows == 3 and [t.row for t in made] == [2]  # one row more: the last is the template's
    assert len(opened) == 3 and all(o[0] is eng and o[1] in (0, 1) and o[3] == ROLE_IDS["plan"] for o in opened)
    assert all(o[4] == [] for o in opened)  # opened on an empty row only
    assert sorted(o[2] for o in opened) == sorted(_enc(f"T{i}:") for i in range(3))
    for _, row, tokens, _, _ in opened:  # the row took what the template returned
        assert (row, [7, *tokens]) in appended
    assert ex.template_tokens == 15


def test_the_serve_profiler_is_the_one_its_variable_asks_for(monkeypatch, tmp_path) -> None:
    """``LRAGENT_SERVE_PROFILE=DIR:FIRST:COUNT`` gives a recorder named ``serve`` over those calls; unset, none. A
    recorder made without a name is ``eval``'s."""
    monkeypatch.delenv(be.SERVE_PROFILE_ENV, raising=False)
    assert be.serve_profiler() is None
    monkeypatch.setenv(be.PROFILE_ENV, f"{tmp_path}:1:2")  # the eval variable is not the server's
    assert be.serve_profiler() is None
    monkeypatch.setenv(be.SERVE_PROFILE_ENV, f"{tmp_path}:5:7")
    prof = be.serve_profiler()
    assert (prof.folder, prof.first, prof.count, prof.name) == (str(tmp_path), 5, 7, "serve")
    assert be._StepProfiler(str(tmp_path)).name == "eval"
