"""The ``answer_text`` constraint: ScienceQA's ``Finish`` letter chosen by scoring each option's text.

Reference values are computed independently of the session and the engine: option log-probs with the plain
transformers model (the role's adapter merged into its weights, one full forward per option), ranked by hand.
"""

from __future__ import annotations

import pytest
import torch

from eval_suite.evaluate.batched_executor import BatchedExecutor
from eval_suite.evaluate.benchmarks import (
    HOTPOTQA,
    SCIENCEQA,
    answer_score,
    load_questions,
    parse_constraints,
    row_name,
)
from eval_suite.evaluate.episode_log import row_order
from eval_suite.evaluate.eval_report import _reference_row, merge_dirs, render_markdown
from eval_suite.evaluate.executors import EpisodeTask, SequentialExecutor
from lragent.agents import AgentConfig, AgentLoop, ScriptedPolicy, SessionPolicy, get_spec
from lragent.agents.constraints import ANSWER_TEXT_SCORE, answer_texts, option_letters
from lragent.agents.prompts import ACTION_MARKER, ARGUMENT_MARKER
from lragent.agents.requests import Choose, best_option
from lragent.session import MultiAgentSession
from tests.conftest import tiny_multi_lora


class ByteTokenizer:
    """One token per UTF-8 byte (the tiny models have a 256-token vocabulary)."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def tiny():
    return tiny_multi_lora("tiny-llama", b_std=0.3, seed=5)


def _reference_sums(model, role: str, prefix: str, options: list[str]) -> list[float]:
    """Summed option-byte log-probs after ``prefix``: the plain model with ``role``'s adapter merged, full forwards."""
    hf = model.merged_model(role)
    p = list(prefix.encode())
    out = []
    with torch.no_grad():
        for o in options:
            ids = list(o.encode())
            logp = torch.log_softmax(hf(torch.tensor([p + ids])).logits[0].float(), dim=-1)
            out.append(sum(float(logp[len(p) + j - 1, t]) for j, t in enumerate(ids)))
    return out


# ----------------------------------------------------------------------------------------- the ranking rule
def test_best_option_sum_and_mean_by_hand() -> None:
    # option 0: one token at log-prob -3; option 1: four tokens, -4 in all (-1 each)
    # sum: -3 > -4 -> option 0; mean: -3 / 1 = -3 < -4 / 4 = -1 -> option 1
    assert best_option([-3.0, -4.0], [1, 4], "sum") == 0
    assert best_option([-3.0, -4.0], [1, 4], "mean") == 1
    assert best_option([-2.0, -2.0], [1, 1], "mean") == 0  # ties: the first
    with pytest.raises(ValueError, match="allowed sum, mean"):
        best_option([-1.0], [1], "max")
    with pytest.raises(ValueError, match="allowed sum, mean"):
        Choose("action", "", ("a",), score="median")
    with pytest.raises(ValueError, match="one non-empty string per option"):
        Choose("action", "", ("a", "b"), appends=("A",))


def _long_short_case(model, prefix: str) -> tuple[list[str], list[float]]:
    """Two options after ``prefix`` on which sum and mean must disagree: ``long``, the model's own greedy 8-byte
    continuation as ``action`` (every byte the argmax: a high mean), and ``short``, one byte whose log-prob lies
    strictly between the long option's sum and its mean (so the sum prefers it and the mean does not)."""
    hf = model.merged_model("action")
    ids = list(prefix.encode())
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        first = torch.log_softmax(hf(torch.tensor([list(prefix.encode())])).logits[0, -1].float(), -1)
    long = bytes(ids[len(prefix.encode()) :]).decode("latin-1")
    (long_sum,) = _reference_sums(model, "action", prefix, [long])
    lo, hi = long_sum, long_sum / len(long.encode())
    # printable ASCII bytes only (one byte each in UTF-8), the middle of the interval
    candidates = [b for b in range(32, 127) if lo < float(first[b]) < hi and chr(b) != long[0]]
    assert candidates, f"no one-byte option between {lo:.2f} and {hi:.2f}"
    short = chr(min(candidates, key=lambda b: abs(float(first[b]) - (lo + hi) / 2)))
    return [short, long], _reference_sums(model, "action", prefix, [short, long])


def test_mean_and_sum_disagree_on_long_vs_short_and_engines_follow(tiny) -> None:
    """A constructed case where they must differ, hand-checked against the plain model; the sequential policy picks
    what the hand ranking picks and appends the letter it is told (the batched engine: the episode test below)."""
    tok = ByteTokenizer()
    prefix = "Q: which?\n" + ACTION_MARKER + "Finish" + ARGUMENT_MARKER
    options, sums = _long_short_case(tiny, prefix)
    lengths = [len(o.encode()) for o in options]
    assert lengths[0] == 1 and lengths[1] > 1
    assert sums[0] > sums[1] and sums[0] / lengths[0] < sums[1] / lengths[1]  # by hand: sum -> short, mean -> long
    want = {"sum": 0, "mean": 1}
    for score, index in want.items():
        policy = SessionPolicy(lambda: MultiAgentSession(tiny, "non_shared", tokenizer=tok))
        policy.reset()
        policy.session.append_text(prefix)
        got = policy.choose("action", "", options, score=score, appends=["A", "B"])
        assert got == index, score
        expect = sums if score == "sum" else [s / n for s, n in zip(sums, lengths, strict=True)]
        assert policy.last_scores == pytest.approx(expect, abs=2e-4)
        assert policy.session.ids[-1:] == list(b"AB"[index : index + 1])  # the letter, not the text
        assert policy.session.num_tokens == len(prefix) + 1


def _answer_text_tasks(scheme: str, score: str, n: int, texts: list[tuple[str, ...]]) -> list[EpisodeTask]:
    spec = get_spec("scienceqa")
    cfg = AgentConfig(max_steps=3, thought_tokens=5, argument_tokens=3, reflect_tokens=3)
    loop = AgentLoop(None, spec, cfg)
    tasks = []
    for i in range(n):
        opts = texts[i % len(texts)]
        letters = option_letters(len(opts))
        episode = loop.episode(
            f"Pick {i}?\nOptions:" + " ".join(f"({x}) {t}" for x, t in zip(letters, opts, strict=True)),
            lambda a, b: "obs",
            action_types=("Finish",),  # every cycle finishes: the answer choice comes at once
            answer_options=letters,
            answer_texts=opts,
            answer_score=score,
        )
        tasks.append(EpisodeTask(key=(scheme, 0, str(i)), scheme=scheme, seed=500 + i, question=None, episode=episode))
    return tasks


TEXTS = [
    ("x", "a much longer option text"),
    ("the sun is a star", "q", "two words"),
    ("Z", "river of green water flowing"),
]
FINISH = "Finish" + ARGUMENT_MARKER


def _finish_choices(traj: str) -> list[tuple[str, str]]:
    """``(prefix up to and with Finish[...marker, the letter written after it)`` for every Finish in ``traj``."""
    out, start = [], 0
    while (i := traj.find(FINISH, start)) >= 0:
        end = i + len(FINISH)
        out.append((traj[:end], traj[end]))
        start = end
    return out


@pytest.mark.parametrize(
    ("scheme", "score"), [("non_shared", "mean"), ("base_lr_shared", "mean"), ("non_shared", "sum")]
)
def test_answer_text_sequential_equals_batched_and_answers_the_chosen_letter(tiny, scheme, score) -> None:
    tok = ByteTokenizer()

    def factory(task: EpisodeTask):
        return SessionPolicy(lambda: MultiAgentSession(tiny, task.scheme, tokenizer=tok, eos_token_ids=[]),
                             temperature=0.9, top_p=0.75, seed=task.seed)  # fmt: skip

    seq = {t.key: r for t, r in SequentialExecutor(factory).run(_answer_text_tasks(scheme, score, 6, TEXTS))}
    ex = BatchedExecutor(tiny, tok, batch=4, capacity=4096, temperature=0.9, top_p=0.75, eos_token_ids=[])
    bat = {t.key: r for t, r in ex.run(_answer_text_tasks(scheme, score, 6, TEXTS))}
    assert seq.keys() == bat.keys()
    disagree = 0
    for key, res in seq.items():
        assert bat[key].trajectory == res.trajectory, key
        assert bat[key].answer == res.answer and bat[key].candidate == res.candidate
        opts = TEXTS[int(key[2]) % len(TEXTS)]
        letters = option_letters(len(opts))
        finishes = _finish_choices(res.trajectory)
        assert finishes and res.answer in letters  # the answer is a letter, never an option text
        assert [s.argument for s in res.steps if s.action_type == "Finish"] == [x for _, x in finishes]
        assert f"{FINISH}{res.answer}]" in res.trajectory  # the letter closed by the loop's "]", as a free Finish
        if scheme != "non_shared":
            continue
        for prefix, letter in finishes:  # non_shared: the action role's view is the plain model's
            sums = _reference_sums(tiny, "action", prefix, list(opts))
            lengths = [len(o.encode()) for o in opts]
            assert letter == letters[best_option(sums, lengths, score)], (key, prefix[-40:])
            disagree += best_option(sums, lengths, "sum") != best_option(sums, lengths, "mean")
    if scheme == "non_shared" and score == "mean":
        assert disagree, "no Finish where sum and mean disagree: the test would not see an engine ignoring score"


def test_scripted_policy_appends_the_letter() -> None:
    policy = ScriptedPolicy(["t", "Finish", "the sun", "ok", "Reflect[right]"])
    res = AgentLoop(policy, SCIENCEQA.spec).run(
        "q", lambda a, b: "obs", action_types=("Finish",), answer_options=("A", "B"),
        answer_texts=("the moon", "the sun"), answer_score="mean",
    )  # fmt: skip
    assert res.answer == "B" and policy.choices[-1] == ("action", ("the moon", "the sun"), 1)
    assert f"{FINISH}B]" in res.trajectory and "the sun]" not in res.trajectory
    with pytest.raises(ValueError, match="one text per answer option"):
        next(AgentLoop(None, SCIENCEQA.spec).episode("q", None, answer_options=("A", "B"), answer_texts=("x",)))


# -------------------------------------------------------------------------------- benchmark side, rows, reports
def test_constraint_values_rows_and_options() -> None:
    assert parse_constraints("answer_text") == ("answer_text",)
    assert parse_constraints("answer_text,action_type") == ("action_type", "answer_text")
    assert parse_constraints("all") == ("action_type", "answer")  # unchanged: answer_text is asked for by name
    with pytest.raises(ValueError, match="one of them"):
        parse_constraints("answer,answer_text")
    assert answer_score(("answer_text",)) == ANSWER_TEXT_SCORE and answer_score(("answer",)) is None
    names = {
        row_name("non_shared", ("answer_text",)),
        row_name("non_shared", ("action_type", "answer_text")),
        row_name("non_shared", ("action_type", "answer")),
        row_name("non_shared", ("answer",)),
        row_name("non_shared", ()),
    }
    assert names == {
        "non_shared+answer_text", "non_shared+action_type,answer_text", "non_shared+constrained",
        "non_shared+constrained:answer", "non_shared",
    }  # fmt: skip
    assert _reference_row("full_shared+answer_text") == "non_shared+answer_text"
    assert row_order(["full_shared+answer_text", "non_shared+answer_text", "non_shared+constrained", "non_shared"]) == [
        "non_shared", "non_shared+answer_text", "non_shared+constrained", "full_shared+answer_text",
    ]  # fmt: skip
    q = next(q for q in SCIENCEQA.load_questions() if len(q.choices) == 3)
    assert SCIENCEQA.constraint_options(q, ("answer_text",)) == (None, ("A", "B", "C"))
    texts = SCIENCEQA.answer_texts(q, ("answer_text",))
    assert texts == tuple(c.strip() for c in q.choices) and SCIENCEQA.answer_texts(q, ("answer",)) is None
    for letter, text in zip("ABC", texts, strict=True):
        assert f"({letter}) {text}" in q.text  # the option as the Options: line shows it, without its letter
    assert answer_texts([" a ", "b"]) == ("a", "b")
    with pytest.raises(ValueError, match="non-empty text"):
        answer_texts(["a", "  "])
    hq = HOTPOTQA.load_questions(limit=1)[0]
    with pytest.raises(ValueError, match="'answer_text'.*allowed on hotpotqa none, all or a comma list of"):
        HOTPOTQA.constraint_options(hq, ("answer_text",))


class _TextPolicy:
    """Answers every Finish by the option text that names the gold answer (the letter-choosing fake otherwise)."""

    def __init__(self, gold_text: dict[str, str]) -> None:
        self.gold_text, self.trajectory, self.last_stats, self.text = gold_text, "", None, ""

    def reset(self) -> None:
        self.trajectory = ""

    def generate(self, role: str, new_text: str, *, max_new_tokens: int, stop: list[str]) -> str:
        if not self.trajectory:
            self.text = next(t for q, t in self.gold_text.items() if f"Question:{q}\n" in new_text)
        self.trajectory += new_text
        out = "Finish" if "[" in stop else ("Reflect[right]" if new_text == "\n" else "I think.")
        self.trajectory += out
        return out

    def choose(self, role: str, new_text: str, options, *, score: str = "sum", appends=None) -> int:
        assert appends is not None and score == ANSWER_TEXT_SCORE  # answer_text passes both on
        index = list(options).index(self.text)
        self.trajectory += new_text + appends[index]
        return index


def test_answer_text_rows_record_protocol_and_merge_apart(tmp_path) -> None:
    from eval_suite.evaluate.run_eval import run_episodes

    qs = load_questions("scienceqa", limit=4)
    gold = {q.text: q.choices[int(q.gold)].strip() for q in qs}
    kw = dict(runs=1, benchmark="scienceqa", adapters="init:random", agent_config=AgentConfig(max_steps=3),
              toolbox_factory=lambda q: (lambda a, b: "obs"), temperature=0.9, top_p=0.75, progress=False)  # fmt: skip
    recs = run_episodes(qs, ["non_shared"], executor=SequentialExecutor(lambda t: _TextPolicy(gold)),
                        out_dir=tmp_path / "text", constraints=("answer_text",), **kw)  # fmt: skip
    assert {r["row"] for r in recs} == {"non_shared+answer_text"}
    assert all(
        r["protocol"]
        == {"temperature": 0.9, "top_p": 0.75, "constraints": ["answer_text"], "answer_score": "mean", "sampler": 2}
        for r in recs
    )
    # the recorded answer is the letter of the chosen (gold) text, and the scorer scores letters as always
    assert [r["prediction"] for r in recs] == ["ABCDE"[int(q.gold)] for q in qs] and all(r["correct"] for r in recs)
    from tests.test_eval_runner import Factory

    run_episodes(qs, ["non_shared"], executor=SequentialExecutor(Factory(qs)), out_dir=tmp_path / "letter",
                 constraints=("action_type", "answer"), **kw)  # fmt: skip
    s = merge_dirs([tmp_path / "text", tmp_path / "letter"], tmp_path / "both")
    assert s["rows"] == ["non_shared+answer_text", "non_shared+constrained"]
    assert s["protocol"]["non_shared+answer_text"]["answer_score"] == "mean"
    assert "answer_score" not in s["protocol"]["non_shared+constrained"]
    assert "answer_text (option texts by mean log-prob)" in render_markdown(s)
    with pytest.raises(ValueError, match="mixes decoding protocols"):
        from eval_suite.evaluate.eval_report import summarize

        summarize([*recs, {**recs[0], "run": 1, "protocol": {**recs[0]["protocol"], "answer_score": "sum"}}])
