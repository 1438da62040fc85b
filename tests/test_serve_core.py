"""The HTTP-free serving core: text trajectories and prompt matching, forking a row, the scheduler (tiny model, CPU).

A served request must compute what ``MultiAgentSession`` computes when its role takes its turn on the same
trajectory; a prompt that parts from a held trajectory continues from the shared part's caches as if that trajectory
had been cut there; requests join and leave the decode batch without changing each other's tokens.
"""

from __future__ import annotations

import random
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_multi_lora

from eval_suite.bench.serve_match import bundled_questions, match_every_candidate, time_matching
from lragent.engine import Engine
from lragent.serving.metrics import Histogram, ServeMetrics
from lragent.serving.rows import fork_row
from lragent.serving.scheduler import Admitted, Delta, Failed, Finished, RequestError, Scheduler, ServeRequest
from lragent.serving.trajectories import (
    TextTrajectory,
    TrajectoryStore,
    common_prefix_len,
    common_token_prefix,
    match_prompt,
)
from lragent.session import MultiAgentSession

SCHEMES = ("non_shared", "full_shared", "droidspeak", "base_shared", "base_lr_shared")


class ByteTokenizer:
    """One token per UTF-8 byte (the tiny models have a 256-token vocabulary)."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", "replace")


class WordTokenizer:
    """Greedy longest-match over a small vocabulary of multi-character pieces (``"ab"`` before ``"a"``): like BPE, a
    piece's tokens depend on the text after it, so tokenising a text whole and in two parts can differ."""

    PIECES = ("Question", "Thought", ": ", "ab", "abc", "a", "b", "c", " ", ":", "x", "y", "z", "\n", "Q")

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        ids, i = [], 0
        while i < len(text):
            best = max((p for p in self.PIECES if text.startswith(p, i)), key=len, default=None)
            if best is None:
                ids.append(100 + ord(text[i]) % 100)
                i += 1
            else:
                ids.append(self.PIECES.index(best))
                i += len(best)
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.PIECES[i] if i < len(self.PIECES) else chr(i - 100) for i in ids)


def tokenize_with(tok):
    return lambda text: tok(text)["input_ids"]


# ---- text trajectories and matching ---------------------------------------------------------------------------------
def test_common_prefix_len_boundaries():
    assert common_prefix_len("", "abc") == 0
    assert common_prefix_len("abc", "abc") == 3
    assert common_prefix_len("abcd", "abc") == 3
    assert common_prefix_len("xbc", "abc") == 0  # parts at index 0
    assert common_prefix_len("abcdefgh" * 50 + "X", "abcdefgh" * 50 + "Y") == 400


def test_a_prompt_that_extends_a_trajectory_keeps_its_tokens_and_tokenises_only_the_new_text():
    tok = WordTokenizer()
    held = TextTrajectory()
    ids = tok("Question: ab")["input_ids"]
    held.append("Question: ab", len(ids))
    # the generated piece: the client was sent "c" but the trajectory kept no token for it (dropped with a stop)
    held.append("c", 0)
    prompt = "Question: abc" + "abc x"
    m = match_prompt(prompt, held, ids, tokenize_with(tok), row=4)
    assert m.extends and m.row == 4 and m.shared == len(ids)
    assert m.tokens == ids + tok("abc x")["input_ids"]  # the new text alone, not "Question: abcabc x" retokenised
    assert m.tokens != tok(prompt)["input_ids"]  # whole-prompt tokenisation would split "ab|c" as "abc"
    assert m.trajectory.text == prompt and m.trajectory.marks[-1] == (len(prompt), len(m.tokens))


def test_a_prompt_that_parts_inside_a_piece_is_tokenised_from_that_piece_and_shares_its_leading_tokens():
    tok = WordTokenizer()
    held = TextTrajectory()
    first = tok("Q: x\n")["input_ids"]
    held.append("Q: x\n", len(first))
    second = tok("Thought: abc y")["input_ids"]
    held.append("Thought: abc y", len(second))
    ids = first + second
    prompt = "Q: x\nThought: ab z"  # parts inside the second piece, after "ab" (which is there "abc")
    m = match_prompt(prompt, held, ids, tokenize_with(tok), row=0)
    rest = tok("Thought: ab z")["input_ids"]
    assert m.tokens == first + rest
    assert m.shared == len(first) + 2  # "Thought", ": " shared; "ab" is not the trajectory's "abc" token
    assert not m.extends
    assert m.trajectory.marks == [(0, 0), (5, len(first)), (len(prompt), len(m.tokens))]
    # a prompt that is a whole-piece prefix of the trajectory: its tokens, no new text
    m2 = match_prompt("Q: x\n", held, ids, tokenize_with(tok), row=0)
    assert m2.tokens == first and m2.shared == len(first) and not m2.extends


def test_the_store_picks_the_most_reusable_trajectory_and_evicts_the_least_recently_used():
    tok = ByteTokenizer()
    store = TrajectoryStore(3)
    for row, text in enumerate(["abcdef", "abcxyz"]):
        held = TextTrajectory()
        held.append(text, len(text))
        store.set(row, held)
    ids = {0: list(b"abcdef"), 1: list(b"abcxyz")}
    m = store.best_match("abcdeQ", [0, 1], ids.__getitem__, lambda r, s: s, tokenize_with(tok))
    assert m.row == 0 and m.shared == 5
    # the scheme's rule decides: if row 0's caches serve this role nothing, row 1 (3 reusable) wins
    m = store.best_match("abcdeQ", [0, 1], ids.__getitem__, lambda r, s: 0 if r == 0 else s, tokenize_with(tok))
    assert m.row == 1 and m.shared == 3
    assert store.best_match("Zzz", [0, 1], ids.__getitem__, lambda r, s: s, tokenize_with(tok)) is None
    assert store.spare_row(busy=[]) == 2  # an empty row first
    store.set(2, TextTrajectory())
    store.touch(0)
    assert store.spare_row(busy=[]) == 1  # then the least recently used
    assert store.spare_row(busy=[1]) == 2
    assert store.spare_row(busy=[0, 1, 2]) is None


def _reference_prefix_len(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_common_prefix_len_equals_a_character_by_character_count_wherever_the_strings_part():
    """Every parting point of every length up to 40, and whichever string is the longer: the binary search never
    skips the answer."""
    for length in range(41):
        base = "".join(chr(97 + i % 26) for i in range(length))
        for part in range(length + 1):
            a, b = base, base[:part] + "#" + base[part + 1 :]
            for x, y in ((a, b), (b, a), (a, b[: part + 1]), (a[:part], b)):
                assert common_prefix_len(x, y) == _reference_prefix_len(x, y), (x, y)


def test_common_token_prefix_counts_leading_equal_ids_up_to_the_shorter_list():
    assert common_token_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_token_prefix([1, 2], [1, 2, 3, 4]) == 2
    assert common_token_prefix([1, 2, 3], [1]) == 1
    assert common_token_prefix([5, 2], [1, 2]) == 0
    assert common_token_prefix([], [1]) == 0


def test_common_token_prefix_equals_an_id_by_id_count_wherever_the_lists_part():
    """Every parting point of every length up to 40, either list the longer, lists and tuples: the binary search never
    skips the answer."""
    for length in range(41):
        base = [i % 7 for i in range(length)]
        for part in range(length + 1):
            a, b = base, base[:part] + [99] + base[part + 1 :]
            for x, y in ((a, b), (b, a), (a, b[: part + 1]), (a[:part], b), (tuple(a), b), (a, tuple(b))):
                n = 0
                while n < min(len(x), len(y)) and x[n] == y[n]:
                    n += 1
                assert common_token_prefix(x, y) == n, (x, y)


def test_best_match_equals_matching_every_candidate_on_trajectories_with_a_common_system_prompt():
    """Random stores of agent-like trajectories (one system prompt, then questions, generated and observed pieces,
    tokenised as BPE does, a piece's tokens depending on what follows), random per-row cache limits as a scheme's
    (``non_shared``: a role reads only its own cache), random use order: the search that matches the best-ranked
    candidates first and stops when none left can win picks what matching every candidate picks."""
    tok = WordTokenizer()
    rng = random.Random(7)
    words = ("ab", "abc", "a", "b", "c", "x", "y", "z", "Q", "Thought", ": ")
    text = lambda n: "".join(rng.choice(words) for _ in range(n))  # noqa: E731
    system = "Question: " + text(12) + "\n"
    for _case in range(300):
        rows = rng.randint(1, 12)
        store, ids = TrajectoryStore(rows), {}
        for row in rng.sample(range(rows), rows):  # set in a random order: the use order
            held, toks = TextTrajectory(), []
            forkable = [r for r in store.held if len(store.held[r].marks) > 1]
            if forkable and rng.random() < 0.6:  # a fork: another trajectory's first pieces, then its own
                src = rng.choice(forkable)
                keep = rng.randrange(1, len(store.held[src].marks))
                chars, n = store.held[src].marks[keep]
                held.append(store.held[src].text[:chars], n)
                toks += ids[src][:n]
            for k in range(rng.randint(1, 5)):
                piece = (system if k == 0 and not toks and rng.random() < 0.8 else "") + text(rng.randint(0, 6))
                piece_ids = tok(piece)["input_ids"]
                held.append(piece, len(piece_ids))
                toks += piece_ids
            store.set(row, held)
            ids[row] = toks
        if rng.random() < 0.5:
            store.touch(rng.randrange(rows))
        source = store.held[rng.randrange(rows)].text
        prompt = source[: rng.randint(0, len(source))] + text(rng.randint(0, 4))
        caps = {row: rng.choice([0, 3, 10**6, rng.randint(0, 40)]) for row in range(rows)}
        reusable = lambda r, shared, caps=caps: min(shared, caps[r])  # noqa: E731
        candidates = rng.sample(range(rows), rng.randint(0, rows))
        got = store.best_match(prompt, candidates, ids.__getitem__, reusable, tokenize_with(tok))
        want = match_every_candidate(store, prompt, candidates, ids.__getitem__, reusable, tokenize_with(tok))
        assert (got is None) == (want is None), (prompt, candidates)
        if want is not None:
            assert (got.row, got.shared, got.tokens) == (want.row, want.shared, want.tokens), (prompt, candidates)


def test_a_prompt_continuing_its_trajectory_is_matched_without_tokenising_what_other_trajectories_share():
    """Sixteen held trajectories with one system prompt: a prompt that continues one of them tokenises only its own
    new text, not the whole prompt again for the other fifteen (each of which shares the system prompt)."""
    system = "You answer questions. " * 40
    store, ids = _byte_store({row: [system + f"Question {row}?", f" Thought {row}."] for row in range(16)}, rows=16)
    tok = _CountingTokenizer()
    prompt = store.held[5].text + " Action: look."
    m = store.best_match(prompt, list(range(16)), ids.__getitem__, lambda r, s: s, tok)
    assert m.row == 5 and m.extends and m.tokens == list(prompt.encode())
    assert tok.calls == [" Action: look."]


def test_the_match_timing_runs_both_searches_on_the_bundled_questions_and_refuses_more_rows_than_it_has(capsys):
    res = time_matching(rows=3, benchmark="hotpotqa", steps=1, repeat=1, tokenizer="default")
    assert res["rows"] == 3 and res["held_tokens_mean"] > 100
    for kind in ("continuing", "first_prompt"):
        ranked, every = res[f"{kind}_ranked_ms"], res[f"{kind}_every_candidate_ms"]
        assert ranked > 0 and every > 0 and res[f"{kind}_speedup"] == pytest.approx(every / ranked)
    with pytest.raises(SystemExit, match=r"--rows 200: hotpotqa has 300 questions, allowed --rows <= 150"):
        time_matching(rows=200, benchmark="hotpotqa", steps=1, repeat=1, tokenizer="default")
    from eval_suite.evaluate.benchmarks import load_questions  # the questions as eval's agents see them

    for bench in ("hotpotqa", "scienceqa"):
        want = sorted(q.text for q in load_questions(bench, splits="dev,test"))
        assert sorted(bundled_questions(bench)) == want


def test_appending_a_piece_with_text_or_tokens_adds_a_mark_and_an_empty_piece_adds_none():
    t = TextTrajectory()
    t.append("ab", 2)
    t.append("", 3)  # tokens without text (e.g. generated tokens the client was not sent)
    t.append("c", 0)  # text without tokens (a token dropped with a stop string)
    t.append("", 0)  # nothing: no mark
    assert t.text == "abc" and t.n_tokens == 5
    assert t.marks == [(0, 0), (2, 2), (2, 5), (3, 5)]


class _CountingTokenizer:
    """Byte tokenizer that records every text it is asked to tokenise."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, text: str) -> list[int]:
        self.calls.append(text)
        return list(text.encode("utf-8"))


def test_a_prompt_ending_on_a_piece_boundary_is_not_tokenised_and_adds_no_mark():
    held = TextTrajectory()
    held.append("sys\n", 4)
    held.append("q1", 2)
    ids = list(b"sys\nq1")
    tok = _CountingTokenizer()
    m = match_prompt("sys\n", held, ids, tok, row=1)
    assert tok.calls == []  # no new text: nothing to tokenise
    assert m.tokens == list(b"sys\n") and m.shared == 4 and not m.extends
    assert m.trajectory.text == "sys\n" and m.trajectory.marks == [(0, 0), (4, 4)]
    m = match_prompt("sys\nq1", held, ids, tok, row=1)
    assert tok.calls == [] and m.extends and m.trajectory.marks == held.marks


def _byte_store(texts: dict[int, list[str]], rows: int = 3) -> tuple[TrajectoryStore, dict[int, list[int]]]:
    """A store whose rows hold the given pieces, one byte a token; the rows are set (used) in key order."""
    store, ids = TrajectoryStore(rows), {}
    for row, pieces in texts.items():
        held = TextTrajectory()
        for piece in pieces:
            held.append(piece, len(piece.encode()))
        store.set(row, held)
        ids[row] = list("".join(pieces).encode())
    return store, ids


def test_best_match_skips_rows_holding_nothing_or_no_first_character_in_common_and_tries_the_next():
    store, ids = _byte_store({0: ["xyz"], 1: ["ab", "c"]})
    for candidates in ([2, 0, 1], [0, 2, 1], [1, 0, 2]):  # row 2 holds nothing
        tok = _CountingTokenizer()
        m = store.best_match("abd", candidates, ids.__getitem__, lambda r, s: s, tok)
        assert m.row == 1 and m.shared == 2 and m.tokens == list(b"abd"), candidates
        assert tok.calls == ["d"]  # only row 1's rest of the prompt: row 0 shares no character, so no tokenising


def test_best_match_ignores_a_row_sharing_text_but_no_token_and_returns_one_sharing_a_single_token():
    tok = WordTokenizer()
    store, held = TrajectoryStore(2), TextTrajectory()
    held.append("abc", 1)  # one "abc" token; the prompt's "ab z" is "ab", " ", "z": 2 characters, no token shared
    store.set(0, held)
    ids = {0: tok("abc")["input_ids"], 1: tok("ab y")["input_ids"]}
    assert store.best_match("ab z", [0], ids.__getitem__, lambda r, s: s, tokenize_with(tok)) is None
    other = TextTrajectory()
    other.append("ab y", len(ids[1]))
    store.set(1, other)
    m = store.best_match("ab z", [0, 1], ids.__getitem__, lambda r, s: s, tokenize_with(tok))
    assert m.row == 1 and m.shared == 2  # row 0 (first, sharing no token) is passed over, not the end
    byte_store, byte_ids = _byte_store({0: ["ab"]})
    m = byte_store.best_match("aZ", [0], byte_ids.__getitem__, lambda r, s: s, tokenize_with(ByteTokenizer()))
    assert m.row == 0 and m.shared == 1 and not m.extends


def test_best_match_breaks_a_tie_in_favour_of_the_most_recently_used_row_whatever_the_candidate_order():
    store, ids = _byte_store({0: ["abc"], 1: ["abc"]})  # row 1 set last

    def pick(candidates: list[int]) -> int:
        return store.best_match("abcd", candidates, ids.__getitem__, lambda r, s: s, tokenize_with(ByteTokenizer())).row

    assert pick([0, 1]) == 1 and pick([1, 0]) == 1
    store.touch(0)
    assert pick([0, 1]) == 0 and pick([1, 0]) == 0
    # more shared tokens beat recency
    store.set(2, TextTrajectory("abcd", [(0, 0), (4, 4)]))
    ids[2] = list(b"abcd")
    store.touch(0)
    assert pick([0, 1, 2]) == 2 and pick([2, 1, 0]) == 2


# ---- forking a row --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_forked_row_is_its_source_cut_to_the_shared_part(scheme):
    """Same caches (every slot of the row: per-role K/V, V_lr, hidden states) and the same next step as the source
    cut in place."""
    from lragent.engine import GenerationRequest

    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    tok = ByteTokenizer()
    eng = Engine(model, scheme, rows=3, capacity=128, tokenizer=tok, eos_token_ids=[], droidspeak_layers=[1])
    eng.append(0, list(b"the shared system prompt, then ep A"))
    for role in (0, 1, 2, 0):  # several roles write (catch-ups, own caches)
        eng.generate(0, GenerationRequest(role=role, max_new_tokens=3))
        eng.append(0, list(b" more"))
    n = 24
    fork_row(eng, 0, 2, n)
    eng.truncate(0, n)  # the reference: the source cut in place
    assert eng.traj[2].ids == eng.traj[0].ids and eng.traj[2].lengths == eng.traj[0].lengths
    assert eng.traj[2].seen == eng.traj[0].seen
    for role in range(len(model.router)):
        a, b = eng.scheme.kv_slot(0, role), eng.scheme.kv_slot(2, role)
        for layer in range(len(eng.pool.k)):
            assert torch.equal(eng.pool.k[layer][a, :, :n], eng.pool.k[layer][b, :, :n])
            assert torch.equal(eng.pool.v[layer][a, :, :n], eng.pool.v[layer][b, :, :n])
            if eng.pool.v_lr is not None:
                la, lb = eng.scheme.lr_slot(0, role), eng.scheme.lr_slot(2, role)
                assert torch.equal(eng.pool.v_lr[layer][la, :n], eng.pool.v_lr[layer][lb, :n])
    for buf in eng.pool.hidden.values():
        assert torch.equal(buf[eng.scheme.hidden_slot(0), :n], buf[eng.scheme.hidden_slot(2), :n])
    outs = []
    for row in (0, 2):
        eng.append(row, list(b" and B"))
        outs.append(eng.generate(row, GenerationRequest(role=1, max_new_tokens=6)).generated_ids)
    assert outs[0] == outs[1]


# ---- the scheduler -------------------------------------------------------------------------------------------------
class Client:
    """Submits requests to a scheduler and waits for their results (the HTTP front end's part, without HTTP)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def submit(self, role: str, prompt: str, **kw) -> tuple[ServeRequest, threading.Event, list]:
        done, events = threading.Event(), []

        def sink(ev):
            events.append(ev)
            if isinstance(ev, Finished | Failed):
                done.set()

        req = ServeRequest(role, prompt, sink, **kw)
        self.scheduler.submit(req)
        return req, done, events

    def call(self, role: str, prompt: str, **kw):
        _, done, events = self.submit(role, prompt, **kw)
        assert done.wait(60), "no result in 60 s"
        return events[-1], events


def _serve(model, scheme: str, rows: int = 3, capacity: int = 256, **kw) -> tuple[Scheduler, Client]:
    tok = ByteTokenizer()
    eng = Engine(model, scheme, rows=rows, capacity=capacity, tokenizer=tok, eos_token_ids=[], droidspeak_layers=[1],
                 **kw)  # fmt: skip
    sch = Scheduler(eng, tok).start()
    return sch, Client(sch)


PIECES = (("plan", "Question: who? Thought: "), ("action", " Action: "), ("reflect", "] Obs: x. Reflect: "))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_served_turns_equal_the_session(scheme):
    """plan -> action -> reflect through the scheduler, each request carrying the whole text so far, gives the
    session's tokens; cached_tokens is what the role's caches held (0 under non_shared for a role's first turn)."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    tok = ByteTokenizer()
    sch, client = _serve(model, scheme)
    sess = MultiAgentSession(model, scheme, tokenizer=tok, eos_token_ids=[], droidspeak_layers=[1])
    text = ""
    try:
        for role, piece in PIECES:
            text += piece
            res, events = client.call(role, text, max_tokens=7, stop=("\n",))
            assert isinstance(events[0], Admitted) and isinstance(res, Finished), events
            sess.append_text(piece)
            before = len(sess.ids)
            ref = sess.step(role, max_new_tokens=7, stop=["\n"])
            assert res.text == ref.text
            assert res.completion_tokens == len(ref.generated_ids)
            assert res.prompt_tokens == before
            assert res.cached_tokens == before - (ref.prefill_tokens - ref.recomputed_tokens)
            assert res.trajectory_tokens == len(sess.ids)
            text += res.text
        if scheme == "non_shared":
            assert res.cached_tokens == 0
        if scheme == "base_lr_shared":
            assert res.cached_tokens == res.prompt_tokens - len(b"] Obs: x. Reflect: ") - 1
    finally:
        sch.stop()


def test_a_prompt_parting_from_a_held_trajectory_forks_and_equals_a_fresh_session():
    """base_lr_shared: episode B's prompt shares episode A's system prompt. It reuses A's caches for the shared tokens
    (cached_tokens) and gives what a fresh session gives B (A's prefix was written by the same role, plan)."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    tok = ByteTokenizer()
    sch, client = _serve(model, "base_lr_shared", rows=3)
    system = "You answer questions. Question: "
    try:
        a, _ = client.call("plan", system + "is A?", max_tokens=5)
        b, _ = client.call("plan", system + "is B?", max_tokens=5)
        assert b.cached_tokens == len(system) + len("is ")  # the shared bytes
        assert sch.metrics.snapshot()["forks"] == 1
        fresh = MultiAgentSession(model, "base_lr_shared", tokenizer=tok, eos_token_ids=[])
        fresh.append_text(system + "is B?")
        assert b.text == fresh.step("plan", max_new_tokens=5).text
        # A's trajectory is still held: its next turn extends it in place
        c, _ = client.call("action", system + "is A?" + a.text + " act: ", max_tokens=4)
        assert c.cached_tokens == len(system) + len("is A?") + 5 - 1
    finally:
        sch.stop()


def test_the_least_recently_used_trajectory_is_evicted_and_its_continuation_recomputed():
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    tok = ByteTokenizer()
    sch, client = _serve(model, "non_shared", rows=2)
    try:
        outs = {}
        for name in ("xx", "yy", "zz"):  # three trajectories, two rows: "xx" is evicted by "zz"
            outs[name], _ = client.call("plan", f"{name} one ", max_tokens=3)
        snap = sch.metrics.snapshot()
        assert snap["evictions"] == 1 and snap["trajectories"] == 2
        again, _ = client.call("plan", "xx one " + outs["xx"].text + " two ", max_tokens=3)
        assert again.cached_tokens == 0  # recomputed: its caches were evicted
        ref = MultiAgentSession(model, "non_shared", tokenizer=tok, eos_token_ids=[])
        ref.append_text("xx one ")
        ref.step("plan", max_new_tokens=3)
        ref.append_text(" two ")
        assert again.text == ref.step("plan", max_new_tokens=3).text
        # "xx" took the least recently used row, "yy"'s: "zz" is still held and continues from its caches
        zz, _ = client.call("plan", "zz one " + outs["zz"].text, max_tokens=2)
        assert zz.cached_tokens == len("zz one ") + 3 - 1
        assert sch.metrics.snapshot()["evictions"] == 2
    finally:
        sch.stop()


@pytest.mark.parametrize(("scheme", "shared_prefix"), [("base_lr_shared", False), ("non_shared", True)])
def test_concurrent_requests_join_and_leave_the_batch_without_changing_each_others_tokens(scheme, shared_prefix):
    """12 requests at once on 4 rows (8 wait, rows are reused as requests end): each result equals the request run
    alone on a fresh engine; streamed deltas add up to the text. Under base_lr_shared the prompts share nothing (a
    prefix written by another role is the scheme's approximation, not the same numbers); under non_shared they
    share a prefix, which only the role that wrote it reuses (forks), so the numbers are the same as alone."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    sch, client = _serve(model, scheme, rows=4)
    head = (lambda i: "episode ") if shared_prefix else (lambda i: chr(65 + i) + " episode ")
    prompts = [(("plan", "action", "reflect")[i % 3], f"{head(i)}{i}: " + "q" * (i % 5), 3 + i % 4) for i in range(12)]
    try:
        pending = [client.submit(role, p, max_tokens=n, stream=True, stop=("zz",)) for role, p, n in prompts]
        results = []
        for _, done, events in pending:
            assert done.wait(60)
            assert isinstance(events[-1], Finished), events[-1]
            assert "".join(e.text for e in events if isinstance(e, Delta)) == events[-1].text
            results.append(events[-1])
        assert sum(sch.metrics.snapshot()["requests"].values()) == 12
        assert (sch.metrics.snapshot()["forks"] > 0) == shared_prefix
    finally:
        sch.stop()
    for (role, p, n), res in zip(prompts, results, strict=True):
        alone, client1 = _serve(model, scheme, rows=1)
        try:
            ref, _ = client1.call(role, p, max_tokens=n, stop=("zz",))
        finally:
            alone.stop()
        assert res.text == ref.text and res.completion_tokens == ref.completion_tokens


def test_a_cancelled_request_frees_its_row_and_a_cancelled_waiting_one_never_runs():
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    sch, client = _serve(model, "base_lr_shared", rows=1, capacity=512)
    try:
        long_req, long_done, long_events = client.submit("plan", "long one ", max_tokens=400, stream=True)
        for _ in range(1000):
            if any(isinstance(e, Delta) for e in long_events):
                break
            threading.Event().wait(0.01)
        never, _, never_events = client.submit("plan", "never ", max_tokens=3)  # the one row is busy: both wait
        _, waits_done, waits_events = client.submit("plan", "waits ", max_tokens=3)
        never.cancel()
        long_req.cancel()
        assert waits_done.wait(60) and isinstance(waits_events[-1], Finished)
        assert never_events == [] and not any(isinstance(e, Finished) for e in long_events)
        assert not long_done.is_set()
        assert sch.metrics.snapshot()["requests"] == {"cancelled": 2, "length": 1}
        assert sch.metrics.snapshot()["generation_tokens"] < 400 + 3  # the long one stopped generating
        assert isinstance(client.call("plan", "still serving ", max_tokens=2)[0], Finished)
    finally:
        sch.stop()


def test_out_of_memory_fails_the_request_with_503_and_the_server_goes_on(monkeypatch):
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    sch, client = _serve(model, "base_lr_shared", rows=2)
    eng = sch.engine
    start, advance = eng.start, eng.advance
    calls = {"start": 0, "advance": 0}

    def oom_start(row, req):
        calls["start"] += 1
        if calls["start"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return start(row, req)

    def oom_advance(*a, **k):
        calls["advance"] += 1
        if calls["advance"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return advance(*a, **k)

    try:
        monkeypatch.setattr(eng, "start", oom_start)
        res, _ = client.call("plan", "first ", max_tokens=3)
        assert isinstance(res, Failed) and res.status == 503 and res.code == "out_of_memory"
        assert "\n" not in res.message
        monkeypatch.setattr(eng, "advance", oom_advance)
        res, _ = client.call("plan", "second ", max_tokens=3)  # prefilled, then the decode step fails
        assert isinstance(res, Failed) and res.status == 503
        assert not eng._pending
        res, _ = client.call("plan", "third ", max_tokens=3)
        assert isinstance(res, Finished) and res.completion_tokens == 3
    finally:
        sch.stop()


def test_a_request_whose_start_fails_leaves_the_generating_rows_as_they_were(monkeypatch):
    """Out of memory in one request's prefill while another row generates: the failed row is emptied, and the
    generating request finishes with exactly the tokens it gets alone (its row's caches and state untouched)."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    alone, client = _serve(model, "base_lr_shared", rows=2)
    try:
        ref, _ = client.call("plan", "alpha ", max_tokens=120)
    finally:
        alone.stop()
    sch, client = _serve(model, "base_lr_shared", rows=2)
    eng = sch.engine
    start = eng.start

    def oom_for_the_second(row, req):
        if eng.ids(row)[:4] == list(b"beta"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return start(row, req)

    monkeypatch.setattr(eng, "start", oom_for_the_second)
    try:
        _, a_done, a_events = client.submit("plan", "alpha ", max_tokens=120)
        b, _ = client.call("plan", "beta ", max_tokens=3)  # admitted while the first generates; its start fails
        assert a_done.wait(60)
    finally:
        sch.stop()
    assert isinstance(b, Failed) and b.status == 503
    a = a_events[-1]
    assert isinstance(a, Finished) and a.completion_tokens == 120 and a.text == ref.text


def test_errors_name_the_field():
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    sch, client = _serve(model, "base_lr_shared", rows=1, capacity=64)
    try:
        with pytest.raises(RequestError) as exc:
            client.submit("planner", "x")
        assert exc.value.param == "model" and "plan, action, reflect" in str(exc.value)
        res, _ = client.call("plan", "x" * 60, max_tokens=10)
        assert isinstance(res, Failed) and res.status == 400 and res.param == "prompt"
        assert (
            res.code == "context_length_exceeded" and "63 tokens" in res.message and "(60 in the prompt" in res.message
        )
        res, _ = client.call("plan", "y" * 54, max_tokens=10)  # 64: one past the context
        assert isinstance(res, Failed) and res.code == "context_length_exceeded"
        res, _ = client.call("plan", "x" * 53, max_tokens=10)  # 63 fits exactly
        assert isinstance(res, Finished)
        res, _ = client.call("plan", "", max_tokens=1, prompt_field="messages")
        assert isinstance(res, Failed) and res.param == "messages" and "Allowed" in res.message
        res, _ = client.call("plan", "x" * 20, max_tokens=None)  # the rest of the context
        assert isinstance(res, Finished) and res.completion_tokens == 63 - 20
    finally:
        sch.stop()


def test_stop_serves_what_is_queued_then_refuses():
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    sch, client = _serve(model, "base_lr_shared", rows=1)
    pending = [client.submit("plan", f"r{i} ", max_tokens=20) for i in range(3)]
    sch.stop()
    assert not sch.alive
    assert all(done.is_set() and isinstance(ev[-1], Finished) for _, done, ev in pending)
    with pytest.raises(RequestError) as exc:
        client.submit("plan", "late")
    assert exc.value.status == 503


def test_metrics_render_as_prometheus_text():
    h = Histogram([0.1, 1.0])
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.lines("t") == ['t_bucket{le="0.1"} 2', 't_bucket{le="1"} 3', 't_bucket{le="+Inf"} 4', "t_sum 3.650000",
                            "t_count 4"]  # fmt: skip
    m = ServeMetrics()
    m.set_queue(2, 5)
    m.set_cache(3, {"k": 100, "v_base": 100, "v_lr": 7})
    m.finished("stop", 10, 4, 6, 0.3, 0.02)
    text = m.render()
    for line in ("lragent_num_requests_running 2", "lragent_num_requests_waiting 5", "lragent_prompt_tokens_total 10",
                 "lragent_generation_tokens_total 4", "lragent_cached_prompt_tokens_total 6",
                 'lragent_cache_bytes{component="v_lr"} 7', 'lragent_requests_total{outcome="stop"} 1',
                 'lragent_time_to_first_token_seconds_bucket{le="0.5"} 1', "lragent_cache_bytes_peak 207"):  # fmt: skip
        assert line in text.splitlines(), line


def test_a_fresh_serve_metrics_reports_zero_everywhere_and_labels_only_the_worker_phases():
    m = ServeMetrics()
    assert m.snapshot() == {
        "running": 0,
        "waiting": 0,
        "peak_running": 0,
        "peak_waiting": 0,
        "prompt_tokens": 0,
        "generation_tokens": 0,
        "cached_tokens": 0,
        "requests": {},
        "evictions": 0,
        "forks": 0,
        "trajectories": 0,
        "cache_bytes": {},
        "peak_cache_bytes": 0,
        "decode_steps": 0,
        "worker_s": {"admit": 0.0, "decode": 0.0, "capture": 0.0, "idle": 0.0, "other": 0.0},
        "admit_s": {"match": 0.0, "tokenize": 0.0, "rows": 0.0, "start": 0.0},
        "gc_s": {"0": 0.0, "1": 0.0, "2": 0.0},
        "gc_collections": {"0": 0, "1": 0, "2": 0},
    }
    lines = m.render().splitlines()
    samples = [line for line in lines if not line.startswith("#")]
    assert [line for line in samples if "_bucket" not in line and "{" not in line] == [
        "lragent_num_requests_running 0",
        "lragent_num_requests_waiting 0",
        "lragent_prompt_tokens_total 0",
        "lragent_generation_tokens_total 0",
        "lragent_cached_prompt_tokens_total 0",
        "lragent_trajectories 0",
        "lragent_trajectory_evictions_total 0",
        "lragent_trajectory_forks_total 0",
        "lragent_cache_bytes_peak 0",
        "lragent_decode_steps_total 0",
        "lragent_time_to_first_token_seconds_sum 0.000000",
        "lragent_time_to_first_token_seconds_count 0",
        "lragent_time_per_output_token_seconds_sum 0.000000",
        "lragent_time_per_output_token_seconds_count 0",
    ]
    assert all(line.endswith("} 0") for line in samples if "_bucket" in line)
    assert [line for line in samples if "{" in line and "_bucket" not in line] == [
        *(f'lragent_worker_seconds_total{{phase="{k}"}} 0.0' for k in ("admit", "decode", "capture", "idle", "other")),
        *(f'lragent_admit_seconds_total{{part="{k}"}} 0.0' for k in ("match", "tokenize", "rows", "start")),
        *(f'lragent_gc_seconds_total{{generation="{k}"}} 0.0' for k in ("0", "1", "2")),
        *(f'lragent_gc_collections_total{{generation="{k}"}} 0' for k in ("0", "1", "2")),
    ]
    # a labelled metric with no samples yet still announces itself
    assert lines[lines.index("# TYPE lragent_requests_total counter") + 1].startswith("# HELP lragent_trajectories ")


def test_serve_metrics_counters_add_up_over_requests_gauges_hold_the_last_value_and_peaks_the_maximum():
    m = ServeMetrics()
    m.set_queue(3, 1)
    m.set_queue(1, 4)
    m.set_cache(2, {"v_lr": 7, "k": 100})
    m.set_cache(1, {"k": 50})
    m.finished("stop", 10, 4, 6, 0.3, 0.02)
    m.finished("length", 5, 16, 0, 0.004, 0.5)
    m.finished("stop", 1, 2, 3)
    m.finished("cancelled")  # no tokens, no timings: only the outcome is counted
    m.worker_time("decode", 0.5, decode_steps=3)
    m.worker_time("idle", 0.25)
    m.worker_time("decode", 0.125, decode_steps=4)
    m.admit_time("rows", 0.5)
    m.admit_time("match", 0.125)
    m.admit_time("rows", 0.25)
    m.admit_time("tokenize", 0.0625)
    assert m.snapshot() == {
        "running": 1,
        "waiting": 4,
        "peak_running": 3,
        "peak_waiting": 4,
        "prompt_tokens": 16,
        "generation_tokens": 22,
        "cached_tokens": 9,
        "requests": {"stop": 2, "length": 1, "cancelled": 1},
        "evictions": 0,
        "forks": 0,
        "trajectories": 1,
        "cache_bytes": {"k": 50},
        "peak_cache_bytes": 107,
        "decode_steps": 7,
        "worker_s": {"admit": 0.0, "decode": 0.625, "capture": 0.0, "idle": 0.25, "other": 0.0},
        "admit_s": {"match": 0.125, "tokenize": 0.0625, "rows": 0.75, "start": 0.0},
        "gc_s": {"0": 0.0, "1": 0.0, "2": 0.0},  # not watched: nothing counted
        "gc_collections": {"0": 0, "1": 0, "2": 0},
    }
    assert (m.ttft.count, m.tpot.count) == (2, 2)  # the requests without timings observe nothing


def test_a_snapshot_is_a_copy_that_later_updates_do_not_change():
    m = ServeMetrics()
    m.finished("stop", 1)
    m.set_cache(1, {"k": 8})
    snap = m.snapshot()
    m.finished("stop", 1)
    m.set_cache(1, {"k": 9})
    assert snap["requests"] == {"stop": 1} and snap["cache_bytes"] == {"k": 8}


@pytest.mark.parametrize(
    "events, evictions, forks",
    [
        ([{"evicted": True}], 1, 0),
        ([{"forked": True}], 0, 1),
        ([{}], 0, 0),
        ([{"evicted": True, "forked": True}] * 2, 2, 2),
    ],
)
def test_count_event_counts_only_the_events_named(events, evictions, forks):
    m = ServeMetrics()
    for kw in events:
        m.count_event(**kw)
    snap = m.snapshot()
    assert (snap["evictions"], snap["forks"]) == (evictions, forks)


def test_metrics_render_is_the_whole_prometheus_exposition_with_help_and_type_before_each_metric():
    """The text GET /metrics serves (format 0.0.4): every metric's HELP and TYPE, labelled samples sorted by label,
    cumulative histogram buckets ending at +Inf, and a final newline."""
    m = ServeMetrics()
    m.set_queue(1, 4)
    m.set_cache(1, {"v_lr": 7, "k": 50})
    m.count_event(evicted=True)
    m.count_event(evicted=True, forked=True)
    m.finished("stop", 10, 4, 6, 0.3, 0.02)
    m.finished("length", 5, 16, 0, 0.004, 0.5)
    m.finished("cancelled")
    m.worker_time("admit", 1.5)
    m.worker_time("decode", 2.0, decode_steps=9)
    m.admit_time("start", 1.25)
    ttft = "lragent_time_to_first_token_seconds"
    tpot = "lragent_time_per_output_token_seconds"
    ttft_buckets = [("0.01", 1), ("0.025", 1), ("0.05", 1), ("0.1", 1), ("0.25", 1), ("0.5", 2), ("1", 2), ("2.5", 2),
                    ("5", 2), ("10", 2), ("30", 2), ("60", 2), ("+Inf", 2)]  # fmt: skip
    tpot_buckets = [("0.001", 0), ("0.0025", 0), ("0.005", 0), ("0.01", 0), ("0.025", 1), ("0.05", 1), ("0.1", 1),
                    ("0.25", 1), ("0.5", 2), ("1", 2), ("2.5", 2), ("+Inf", 2)]  # fmt: skip
    expected = [
        "# HELP lragent_num_requests_running Requests generating in the engine's rows.",
        "# TYPE lragent_num_requests_running gauge",
        "lragent_num_requests_running 1",
        "# HELP lragent_num_requests_waiting Requests waiting for a row.",
        "# TYPE lragent_num_requests_waiting gauge",
        "lragent_num_requests_waiting 4",
        "# HELP lragent_prompt_tokens_total Prompt tokens of finished requests.",
        "# TYPE lragent_prompt_tokens_total counter",
        "lragent_prompt_tokens_total 15",
        "# HELP lragent_generation_tokens_total Generated tokens of finished requests.",
        "# TYPE lragent_generation_tokens_total counter",
        "lragent_generation_tokens_total 20",
        "# HELP lragent_cached_prompt_tokens_total Prompt tokens read from a held trajectory's caches instead of "
        "computed.",
        "# TYPE lragent_cached_prompt_tokens_total counter",
        "lragent_cached_prompt_tokens_total 6",
        "# HELP lragent_requests_total Finished requests by outcome.",
        "# TYPE lragent_requests_total counter",
        'lragent_requests_total{outcome="cancelled"} 1',
        'lragent_requests_total{outcome="length"} 1',
        'lragent_requests_total{outcome="stop"} 1',
        "# HELP lragent_trajectories Trajectories held in the engine's rows.",
        "# TYPE lragent_trajectories gauge",
        "lragent_trajectories 1",
        "# HELP lragent_trajectory_evictions_total Least recently used trajectories evicted.",
        "# TYPE lragent_trajectory_evictions_total counter",
        "lragent_trajectory_evictions_total 2",
        "# HELP lragent_trajectory_forks_total Trajectories started from another's shared prefix (its caches copied).",
        "# TYPE lragent_trajectory_forks_total counter",
        "lragent_trajectory_forks_total 1",
        "# HELP lragent_cache_bytes Bytes the caches hold (valid positions) by component.",
        "# TYPE lragent_cache_bytes gauge",
        'lragent_cache_bytes{component="k"} 50',
        'lragent_cache_bytes{component="v_lr"} 7',
        "# HELP lragent_cache_bytes_peak Peak of the caches' total bytes.",
        "# TYPE lragent_cache_bytes_peak gauge",
        "lragent_cache_bytes_peak 57",
        "# HELP lragent_decode_steps_total Batched decode steps the engine ran (generated tokens over them: the mean "
        "batch).",
        "# TYPE lragent_decode_steps_total counter",
        "lragent_decode_steps_total 9",
        "# HELP lragent_worker_seconds_total Seconds of the scheduler's thread by phase: admit (matching, prefills), "
        "decode (batched steps, streaming), capture (CUDA graphs for a new decode width), idle (waiting for requests), "
        "other.",
        "# TYPE lragent_worker_seconds_total counter",
        'lragent_worker_seconds_total{phase="admit"} 1.5',
        'lragent_worker_seconds_total{phase="decode"} 2.0',
        'lragent_worker_seconds_total{phase="capture"} 0.0',
        'lragent_worker_seconds_total{phase="idle"} 0.0',
        'lragent_worker_seconds_total{phase="other"} 0.0',
        "# HELP lragent_admit_seconds_total Seconds of placing requests, within the admit phase: match (the prompt "
        "against the held trajectories), tokenize (the tokenizer's calls on its new text), rows (eviction, fork or "
        "cut, the new tokens appended), start (the engine's start of the generation).",
        "# TYPE lragent_admit_seconds_total counter",
        'lragent_admit_seconds_total{part="match"} 0.0',
        'lragent_admit_seconds_total{part="tokenize"} 0.0',
        'lragent_admit_seconds_total{part="rows"} 0.0',
        'lragent_admit_seconds_total{part="start"} 1.25',
        "# HELP lragent_gc_seconds_total Seconds of Python's garbage collections in the server process by generation "
        "(each pauses every thread, the scheduler's included; counted once the server runs).",
        "# TYPE lragent_gc_seconds_total counter",
        *(f'lragent_gc_seconds_total{{generation="{k}"}} 0.0' for k in ("0", "1", "2")),
        "# HELP lragent_gc_collections_total Python's garbage collections in the server process by generation.",
        "# TYPE lragent_gc_collections_total counter",
        *(f'lragent_gc_collections_total{{generation="{k}"}} 0' for k in ("0", "1", "2")),
        f"# HELP {ttft} Seconds from a request's arrival to its first generated token.",
        f"# TYPE {ttft} histogram",
        *(f'{ttft}_bucket{{le="{le}"}} {n}' for le, n in ttft_buckets),
        f"{ttft}_sum 0.304000",
        f"{ttft}_count 2",
        f"# HELP {tpot} Seconds per generated token after the first, per request.",
        f"# TYPE {tpot} histogram",
        *(f'{tpot}_bucket{{le="{le}"}} {n}' for le, n in tpot_buckets),
        f"{tpot}_sum 0.520000",
        f"{tpot}_count 2",
    ]
    assert m.render() == "\n".join(expected) + "\n"


def test_the_scheme_decides_which_trajectory_serves_a_role():
    """non_shared: trajectory A shares more text with the prompt but only the plan role ever read it; B shares less
    and was written by the action role. An action request continues from B (its own cache), not A."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    sch, client = _serve(model, "non_shared", rows=3)
    try:
        client.call("plan", "common head, then A's long tail", max_tokens=2)  # A: plan's caches only
        client.call("action", "common head, then B", max_tokens=2)  # B: action's caches
        res, _ = client.call("action", "common head, then A's long", max_tokens=2)
        assert res.cached_tokens == len("common head, then ")  # B's part; A's (longer) serves action nothing
        res, _ = client.call("plan", "common head, then A's long", max_tokens=2)
        assert res.cached_tokens == len("common head, then A's long") - 1  # the plan role: A
    finally:
        sch.stop()


@pytest.mark.parametrize("buckets", [[], [0.5, 0.1], [1, 2, 2, 1]])
def test_a_histogram_refuses_buckets_that_do_not_increase(buckets):
    expected = f"histogram buckets must be increasing and non-empty, got {buckets}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        Histogram(buckets)


def test_fork_row_refuses_the_same_row_and_more_tokens_than_the_source_holds():
    eng = Engine(tiny_multi_lora("tiny-llama"), "full_shared", rows=2, capacity=32, eos_token_ids=[])
    eng.append(0, [5, 6, 7])
    eng.append(1, [9])
    with pytest.raises(ValueError, match="fork_row: source and destination are the same row 0"):
        fork_row(eng, 0, 0, 2)
    for n in (4, -1):
        with pytest.raises(ValueError, match=f"fork_row: {n} tokens asked of a trajectory of 3"):
            fork_row(eng, 0, 1, n)
    assert eng.ids(1) == [9]  # the destination untouched


def test_a_store_needs_a_row_and_a_scheduler_a_tokenizer():
    with pytest.raises(ValueError, match="rows must be >= 1, got 0"):
        TrajectoryStore(0)
    eng = Engine(tiny_multi_lora("tiny-llama"), "full_shared", rows=1, capacity=32, eos_token_ids=[])
    with pytest.raises(ValueError, match="a served model needs a tokenizer"):
        Scheduler(eng, None)


def test_an_idle_worker_counts_its_idle_seconds_as_they_pass():
    """With no request the worker's idle seconds grow on /metrics while it waits, not all at once when a request
    wakes it: a bench window between two reads of the metrics then holds only its own idle time (idle counted at the
    wake would put the seconds before the first read into the window)."""
    sch, client = _serve(tiny_multi_lora("tiny-llama", b_std=0.3), "base_lr_shared")
    try:
        time.sleep(0.6)
        idle = sch.metrics.snapshot()["worker_s"]["idle"]
        assert 0.3 <= idle <= 1.5, idle
        res, _ = client.call("plan", "Question: who?", max_tokens=2)
        assert isinstance(res, Finished)
        after = sch.metrics.snapshot()["worker_s"]
        assert after["idle"] - idle < 0.5, after  # the request found the worker with its idle time already counted
    finally:
        sch.stop()


def test_launch_ahead_queues_the_next_round_before_answering_and_serves_the_same_text(monkeypatch):
    """With ``launch_ahead`` the worker queues the next decode steps of the requests still generating before it
    streams and finishes the others (the device decodes while the host sends): the requests get the text, streamed
    pieces and token counts they get without it (sampled at 0.9, different lengths, half streamed, more requests than
    rows so some wait and join mid-flight)."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    tok = ByteTokenizer()
    bodies = [(("plan", "action", "reflect")[i % 3], f"<{i}> ask " + "why " * i, 3 + 2 * i, bool(i % 2))
              for i in range(5)]  # fmt: skip

    def serve(ahead: bool) -> tuple[list, list]:
        eng = Engine(model, "base_lr_shared", rows=3, capacity=256, tokenizer=tok, eos_token_ids=[])
        sch = Scheduler(eng, tok, launch_ahead=ahead)
        order: list[str] = []
        real_launch, real_finish = eng.launch, sch._finish
        monkeypatch.setattr(eng, "launch", lambda: (order.append("launch"), real_launch())[1])
        monkeypatch.setattr(sch, "_finish", lambda res, now: (order.append("finish"), real_finish(res, now))[1])
        client = Client(sch.start())
        try:
            subs = [client.submit(role, prompt, max_tokens=n, temperature=0.9, seed=i, stream=stream)
                    for i, (role, prompt, n, stream) in enumerate(bodies)]  # fmt: skip
            for _, done, _ in subs:
                assert done.wait(60)
        finally:
            sch.stop()
        out = []
        for _, _, events in subs:
            res = events[-1]
            assert isinstance(res, Finished), events
            out.append((res.text, res.completion_tokens, "".join(e.text for e in events if isinstance(e, Delta))))
        return out, order

    plain, plain_order = serve(False)
    ahead, order = serve(True)
    assert ahead == plain
    assert all(text == streamed for (text, _, streamed), body in zip(plain, bodies, strict=True) if body[3])
    assert "launch" not in plain_order
    # a round queued, then a request of the round before it finished (answered while the device decodes)
    assert any(a == "launch" and b == "finish" for a, b in zip(order, order[1:], strict=False)), order


def test_watched_collections_are_counted_by_generation_once_and_no_more_once_unwatched():
    """watch_gc counts each of Python's collections in its generation, with its seconds (registered once however often
    called; render and snapshot report them); after unwatch_gc nothing more is counted and the callback is gone."""
    import gc

    m = ServeMetrics()
    callbacks = list(gc.callbacks)
    m.watch_gc()
    m.watch_gc()
    try:
        assert len(gc.callbacks) == len(callbacks) + 1
        gc.collect(2)
        gc.collect(0)
        snap = m.snapshot()
        assert snap["gc_collections"]["2"] >= 1 and snap["gc_collections"]["0"] >= 1
        assert snap["gc_s"]["2"] > 0 and snap["gc_s"]["0"] > 0
        text = m.render()
        assert f'lragent_gc_collections_total{{generation="2"}} {snap["gc_collections"]["2"]}' in text.splitlines()
        assert f'lragent_gc_seconds_total{{generation="2"}} {snap["gc_s"]["2"]}' in text.splitlines()
    finally:
        m.unwatch_gc()
        m.unwatch_gc()
    assert gc.callbacks == callbacks
    before = m.snapshot()
    gc.collect(2)
    assert m.snapshot() == before


def test_each_collection_adds_its_own_seconds_and_a_stop_without_its_start_adds_nothing(monkeypatch):
    """The collector's callback, driven with a clock: each start-stop pair adds its seconds and one collection to its
    generation; a stop seen without its start (watching began mid-collection, or a stop repeated) adds nothing."""
    import lragent.serving.metrics as metrics_module

    clock = iter([10.0, 10.25, 20.0, 20.5, 30.0, 31.0])
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    m = ServeMetrics()
    m._on_gc("stop", {"generation": 1})  # its start came before watching
    for _ in range(2):
        m._on_gc("start", {"generation": 1})
        m._on_gc("stop", {"generation": 1})
    m._on_gc("stop", {"generation": 1})  # repeated: no start before it
    m._on_gc("start", {"generation": 2})
    m._on_gc("stop", {"generation": 2})
    assert m.snapshot()["gc_s"] == {"0": 0.0, "1": 0.75, "2": 1.0}
    assert m.snapshot()["gc_collections"] == {"0": 0, "1": 2, "2": 1}
