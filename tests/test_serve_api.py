"""The server through the real ``openai`` client on 127.0.0.1, embedded model, greedy: every scheme gives the tokens
``MultiAgentSession`` gives for the same plan -> action -> reflect trajectory, cached_tokens is what the role's
caches held, streamed and non-streamed text are equal, and chat turns continue the trajectory they extend."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from lragent.paths import DATA_DIR

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model

ADAPTERS = str(DATA_DIR / "adapters" / "hotpotqa_sharedA")
SCHEMES = ("non_shared", "full_shared", "droidspeak", "base_shared", "base_lr_shared")
BASE = "SmolLM2-135M-Instruct"
QUESTION = "Which magazine was started first, Arthur's Magazine or First for Women?"
PIECES = (  # (role, appended text, stop): one AutoAct cycle's shape
    ("plan", f"Question: {QUESTION}\nThought: \n### Response:\n", ["\n"]),
    ("action", "\nAciton: Retrieve[\n### Response:\n", ["]", "\n"]),
    ("reflect", "]\nObversation: Arthur's Magazine (1844-1846) was an American literary periodical.\nThought: \n"
     "### Response:\n", ["\n"]),
)  # fmt: skip
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def models():
    """The served model (the roles plus the base model) and, for the reference sessions, the plain role model."""
    from lragent.loading import load_lora_model
    from lragent.models import embedded_model_missing
    from lragent.serving.model import load_served_model

    if embedded_model_missing():
        pytest.skip(f"needs the embedded model: {embedded_model_missing()}")
    served, tok = load_served_model(model="default", adapters=ADAPTERS, dtype="float32", device="cpu")
    ref, _ = load_lora_model(model="default", adapters=ADAPTERS, dtype="float32", device="cpu")
    return served, ref, tok


@contextmanager
def running(model, tok, scheme: str, rows: int = 2, capacity: int = 1024, api_key: str | None = None):
    from eval_suite.serve.api_server import ServerThread, build_app
    from eval_suite.serve.server_state import ServerState
    from lragent.engine import Engine
    from lragent.serving.scheduler import Scheduler

    engine = Engine(model, scheme, rows=rows, capacity=capacity, tokenizer=tok)
    scheduler = Scheduler(engine, tok)
    server = ServerThread(build_app(ServerState(scheduler, scheme, BASE, tok, api_key))).start()
    try:
        yield server, scheduler
    finally:
        server.stop()


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def streamed(client, **kw) -> tuple[str, object, str]:
    """The text, usage and finish reason of a streamed completion."""
    parts, usage, reason = [], None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for choice in chunk.choices:
            parts.append(choice.text)
            reason = choice.finish_reason or reason
        usage = chunk.usage or usage
    return "".join(parts), usage, reason


def test_the_base_model_is_one_more_role_with_b_zero_and_the_roles_are_unchanged(models):
    served, ref, _ = models
    assert served.router.roles == (*ref.router.roles, BASE)
    mods, ref_mods = served.lora_modules(), ref.lora_modules()
    assert mods.keys() == ref_mods.keys()
    for name, m in mods.items():
        r = ref_mods[name]
        assert all(torch.equal(a, b) for a, b in zip(m.lora_A, r.lora_A, strict=False))
        assert all(torch.equal(m.lora_B[i], r.lora_B[i]) for i in range(len(r.lora_B)))
        assert not m.lora_B[len(r.lora_B)].any()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_served_trajectory_gives_the_sessions_tokens(models, scheme):
    """plan -> action -> reflect as three completions requests, each carrying the whole text so far (the last one
    streamed): the same text and tokens as MultiAgentSession; the trajectory the server holds is the session's token
    for token; cached_tokens as the scheme's caches give it (all of the plan's text under base_lr_shared, 0 under
    non_shared); the last request again without streaming gives the streamed text."""
    from lragent.session import MultiAgentSession

    served, ref, tok = models
    session = MultiAgentSession(ref, scheme, tokenizer=tok)
    with running(served, tok, scheme) as (server, scheduler):
        client = client_of(server)
        text, cached, plan_tokens = "", [], 0
        for i, (role, piece, stop) in enumerate(PIECES):
            text += piece
            request = {"model": role, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": stop}
            if i < 2:
                res = client.completions.create(**request)
                out, usage, reason = res.choices[0].text, res.usage, res.choices[0].finish_reason
                assert res.model_extra["lragent"]["scheme"] == scheme
            else:
                out, usage, reason = streamed(client, **request)
            session.append_text(piece)
            before = len(session.ids)
            step = session.step(role, max_new_tokens=MAX_TOKENS, stop=stop)
            assert out == step.text, (scheme, role)
            assert usage.prompt_tokens == before
            assert usage.completion_tokens == len(step.generated_ids)
            assert reason == ("length" if step.stop_reason == "length" else "stop")
            cached.append(usage.prompt_tokens_details.cached_tokens)
            assert cached[-1] == before - (step.prefill_tokens - step.recomputed_tokens)
            if i == 0:
                plan_tokens = len(session.ids)  # the plan's prompt and its kept completion
            text += out
        held = [r for r in scheduler.store.held if scheduler.engine.ids(r) == session.ids]
        assert held, "the server holds the session's trajectory token for token"
        assert cached[0] == 0
        if scheme == "non_shared":
            assert cached[1] == 0  # the action role has no cache of its own yet
        if scheme == "base_lr_shared":
            assert cached[1] >= plan_tokens - 1  # the plan's text, all but its last generated token
        again = client.completions.create(**request)
        assert again.choices[0].text == out  # the streamed text, without streaming


def test_models_and_chat_turns_continue_the_trajectory(models):
    """/v1/models lists the roles and the base model; a second chat turn (the first reply in its messages) extends
    the held trajectory: its cached_tokens covers the first turn, and it gives the session's text."""
    from lragent.session import MultiAgentSession

    served, ref, tok = models
    with running(served, tok, "base_lr_shared") as (server, _):
        client = client_of(server)
        assert [m.id for m in client.models.list().data] == ["plan", "action", "reflect", BASE]
        first = [{"role": "user", "content": "Name one planet."}]
        r1 = client.chat.completions.create(model="plan", messages=first, max_tokens=8, temperature=0)
        reply = r1.choices[0].message.content
        second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And another?"}]
        parts, usage = [], None
        for chunk in client.chat.completions.create(model="action", messages=second, max_tokens=6, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):  # fmt: skip
            parts += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
    p1 = tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    p2 = tok.apply_chat_template(second, tokenize=False, add_generation_prompt=True)
    assert p2.startswith(p1 + reply)
    session = MultiAgentSession(ref, "base_lr_shared", tokenizer=tok)
    session.append_text(p1)
    assert session.step("plan", max_new_tokens=8).text == reply
    first_len = len(session.ids)
    session.append_text(p2[len(p1 + reply) :])
    assert "".join(parts) == session.step("action", max_new_tokens=6).text
    assert usage.prompt_tokens_details.cached_tokens >= first_len - 1
