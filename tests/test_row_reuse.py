"""Engine rows reused across episodes (``Engine.reset``) give each episode exactly what a fresh engine gives.

``eval --batch N`` refills a finished row with the next question by resetting it: every cache length, every role's
``seen`` and the row's decode state must start from nothing, while the pool keeps the previous episode's values
past the new lengths. Here two rows run four episodes each, batched, with lengths that shrink and grow from one
episode to the next (a 60-token episode followed by a 40-token one with other roles, and so on) and other prompts;
each episode must equal the same episode on a fresh one-row engine: same generated tokens, logits within 1e-4.
This catches ``reset()`` keeping the row's old cache lengths (``base_lr_shared`` then prefills 1 token instead of
40; the other schemes read stale positions or skip a catch-up).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_multi_lora

from lragent.engine import Engine, GenerationRequest
from lragent.schemes import SCHEMES

_MODEL: list = []
CAPACITY = 160
DROIDSPEAK_LAYERS = [1, 2]


def _model():
    if not _MODEL:
        _MODEL.append(tiny_multi_lora("tiny-llama", b_std=0.3))
    return _MODEL[0]


def _episode(seed: int, first_len: int) -> list[tuple[int, list[int], int]]:
    """A multi-role episode: (role, appended ids, max new tokens) per step; the first append has ``first_len``
    tokens, later ones are short (tool outputs)."""
    g = torch.Generator().manual_seed(seed)
    roles = torch.randperm(3, generator=g).tolist() + [int(torch.randint(0, 3, (1,), generator=g))]
    out = []
    for i, role in enumerate(roles):
        n_ids = first_len if i == 0 else int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(3, 250, (n_ids,), generator=g).tolist()
        out.append((role, ids, int(torch.randint(1, 5, (1,), generator=g))))
    return out


# per row: episodes in order; lengths shrink and grow so stale lengths would point both past and inside the new one
EPISODES = {
    0: [_episode(10, 60), _episode(11, 40), _episode(12, 7), _episode(13, 55)],
    1: [_episode(20, 33), _episode(21, 70), _episode(22, 12), _episode(23, 25)],
}


def _run_fresh(scheme: str, episode) -> list:
    eng = Engine(_model(), scheme, rows=1, capacity=CAPACITY, eos_token_ids=[], droidspeak_layers=DROIDSPEAK_LAYERS)
    out = []
    for role, ids, n in episode:
        eng.append(0, ids)
        out.append(eng.generate(0, GenerationRequest(role=role, max_new_tokens=n, return_logits=True)))
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_reused_rows_equal_fresh_engines(scheme):
    eng = Engine(_model(), scheme, rows=2, capacity=CAPACITY, eos_token_ids=[], droidspeak_layers=DROIDSPEAK_LAYERS)
    episode = {r: 0 for r in EPISODES}  # index of the episode each row runs
    step = {r: 0 for r in EPISODES}  # next step within it
    got: dict[tuple[int, int], list] = {(r, e): [] for r in EPISODES for e in range(len(EPISODES[r]))}

    def launch(r: int) -> bool:
        """Starts row r's next step, moving to (and resetting for) its next episode when one ends."""
        if step[r] == len(EPISODES[r][episode[r]]):
            if episode[r] + 1 == len(EPISODES[r]):
                return False
            episode[r] += 1
            step[r] = 0
            eng.reset(r)
        role, ids, n = EPISODES[r][episode[r]][step[r]]
        step[r] += 1
        eng.append(r, ids)
        assert eng.start(r, GenerationRequest(role=role, max_new_tokens=n, return_logits=True)) is None
        return True

    for r in EPISODES:
        launch(r)
    while eng._pending:
        for res in eng.advance():
            got[(res.row, episode[res.row])].append(res)
            launch(res.row)

    for (r, e), results in got.items():
        want = _run_fresh(scheme, EPISODES[r][e])
        assert len(results) == len(want), (scheme, r, e)
        for i, (a, b) in enumerate(zip(want, results, strict=True)):
            where = (scheme, f"row {r}", f"episode {e}", f"step {i}")
            assert a.prefill_tokens == b.prefill_tokens, (*where, a.prefill_tokens, b.prefill_tokens)
            assert a.recomputed_tokens == b.recomputed_tokens, where
            assert a.generated_ids == b.generated_ids, (*where, a.generated_ids, b.generated_ids)
            assert a.logit_positions == b.logit_positions, where
            err = float((a.logits - b.logits).abs().max())
            assert err <= 1e-4, (*where, err)
