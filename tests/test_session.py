"""The one-trajectory session (lragent/session.py) over a tiny model on the CPU: the engine it opens (one growable
row, the options handed through), and the trajectory, cache and text calls it forwards to that row. The tokens and
logits of the schemes are checked in tests/test_runtime_tiny.py and tests/test_agents_loop.py."""

from __future__ import annotations

import pytest
from conftest import tiny_multi_lora

from lragent.schemes import Scheme
from lragent.session import MultiAgentSession


@pytest.fixture(scope="module")
def model():
    return tiny_multi_lora(seed=11)


class CharTokenizer:
    """One id per character (in the tiny vocabulary); records the add_special_tokens it was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        self.calls.append((text, add_special_tokens))
        return {"input_ids": [3 + ord(c) % 50 for c in text]}


def test_the_session_opens_a_one_row_growable_engine_with_its_options(model) -> None:
    tok = CharTokenizer()
    s = MultiAgentSession(
        model, "droidspeak", tokenizer=tok, droidspeak_layers=[0, 2, 3], use_kernel=False, seed=7,
        eos_token_ids=[5, 9], capacity=24,
    )  # fmt: skip
    eng = s.engine
    assert s.scheme is Scheme.parse("droidspeak") and eng.scheme.scheme is s.scheme  # parsed once, handed down
    assert s.model is model and eng.model is model and s.tokenizer is tok and eng.tokenizer is tok
    assert s.seed == 7 and s.steps == []
    assert eng.rows == 1 and eng.growable is True and eng.pool.capacity == 24
    assert eng.eos_token_ids == {5, 9} and eng.use_kernel is False and eng.cuda_graphs is False
    assert eng.scheme.groups == [(0, 1), (2, 4)]  # the layers given, not the default middle third
    assert eng.stop_index is not None  # a tokenizer: stop strings can be matched


def test_the_session_defaults(model) -> None:
    s = MultiAgentSession(model, Scheme.parse("full_shared"))
    eng = s.engine
    assert s.scheme is Scheme.parse("full_shared") and s.seed == 0 and s.tokenizer is None
    assert eng.pool.capacity == 1024 and eng.use_kernel is True and eng.cuda_graphs is False  # CPU: no graphs
    assert eng.eos_token_ids == {model.model.generation_config.eos_token_id} and eng.stop_index is None
    s = MultiAgentSession(model, "droidspeak", use_kernel=False)
    assert s.engine.scheme.groups == [(1, 2)]  # the default: a middle third of the 4 layers


def test_cuda_graphs_asked_for_are_handed_to_the_engine(model) -> None:
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs the model on a CUDA device"):
        MultiAgentSession(model, "non_shared", use_kernel=False, cuda_graphs=True)
    assert MultiAgentSession(model, "non_shared", use_kernel=False, cuda_graphs=False).engine.cuda_graphs is False


def test_append_truncate_and_the_caches_of_each_role(model) -> None:
    s = MultiAgentSession(model, "non_shared", use_kernel=False, eos_token_ids=[], capacity=16)
    s.append([3, 4, 5, 6, 7])
    assert s.ids == [3, 4, 5, 6, 7] and s.ids is s.engine.ids(0) and s.num_tokens == 5
    assert s.cached_len("plan") == 0 and s.cache_bytes() == {}
    s.step("plan", max_new_tokens=0)  # prefill only: plan's own cache holds the 5 tokens, action's nothing
    assert s.cached_len("plan") == 5 and s.cached_len(0) == 5 and s.cached_len("action") == 0
    per_position = s.engine.per_position
    assert s.cache_bytes() == s.engine.cache_bytes(0) == {"k": 5 * per_position["k"], "v": 5 * per_position["v"]}
    s.step("action", max_new_tokens=2)
    assert s.num_tokens == 7 and s.cached_len("action") == 6 and s.cached_len("plan") == 5
    assert s.seen == {0: 5, 1: 6}
    s.truncate(4)
    assert s.ids == [3, 4, 5, 6] and s.cached_len("plan") == 4 and s.cached_len("action") == 4
    assert s.cache_bytes() == {"k": 8 * per_position["k"], "v": 8 * per_position["v"]}  # both roles, 4 each


def test_append_text_tokenizes_without_special_tokens_and_needs_a_tokenizer(model) -> None:
    tok = CharTokenizer()
    s = MultiAgentSession(model, "full_shared", tokenizer=tok, use_kernel=False, eos_token_ids=[], capacity=16)
    s.append([3])
    ids = s.append_text("ab")
    assert ids == [3 + ord("a") % 50, 3 + ord("b") % 50] and s.ids == [3, *ids]
    assert tok.calls == [("ab", False)]
    bare = MultiAgentSession(model, "full_shared", use_kernel=False, eos_token_ids=[], capacity=16)
    with pytest.raises(ValueError) as err:
        bare.append_text("ab")
    assert str(err.value) == "append_text needs a tokenizer: pass tokenizer= to the session"
    assert bare.ids == []
