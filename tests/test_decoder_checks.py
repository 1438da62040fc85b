"""The decoder forward refuses, in one line, what it cannot compute (lragent/decoder.py): a fused LoRA step without
role ids for several roles, a decomposed cache (V_base + V_lr) without a LoRA on v_proj, and an LR prefill
(``write_kv=False``) into a plain cache; the caches are left unwritten."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_multi_lora

from lragent.kv_cache import ModelCache


@torch.no_grad()
def test_the_fused_role_mask_needs_role_ids_unless_there_is_one_role() -> None:
    """The fused LoRA step without role ids is refused for 3 roles; for one role every row gets it."""
    h = torch.zeros(2, 1, 64)
    dec = tiny_multi_lora("tiny-llama").decoder
    dec.fuse_lora = True
    mask = dec.role_mask_for(SimpleNamespace(fused=True), None, h)
    with pytest.raises(ValueError, match="^role_ids is required: the adapters serve 3 roles$"):
        mask()
    one = tiny_multi_lora("tiny-llama", roles=("plan",)).decoder
    one.fuse_lora = True
    assert torch.equal(one.role_mask_for(SimpleNamespace(fused=True), None, h)(), torch.ones(2, 1))


@torch.no_grad()
def test_a_decomposed_cache_without_a_lora_on_v_proj_is_refused() -> None:
    """V_lr needs v_proj's LoRA: a decomposed cache without it is refused, unwritten; a plain cache works."""
    ids, roles = torch.tensor([[5, 6, 7]]), torch.tensor([1])
    q_only = tiny_multi_lora("tiny-llama", targets=("q_proj",))
    caches = ModelCache(q_only.n_layers, decomposed=True)
    with pytest.raises(ValueError, match=r"^a decomposed cache \(V_base \+ V_lr\) needs a LoRA adapter on v_proj$"):
        q_only.decoder.forward(ids, roles, caches)
    assert all(c.length == 0 for c in caches.layers)
    plain = ModelCache(q_only.n_layers)
    assert q_only.decoder.forward(ids, roles, plain).shape == (1, 3, 256) and plain[0].length == 3


@torch.no_grad()
def test_an_lr_prefill_needs_a_decomposed_cache() -> None:
    """``write_kv=False`` (V_lr only) into a plain cache is refused, unwritten; into a decomposed one it runs."""
    model = tiny_multi_lora("tiny-llama")
    h = model.decoder.embed(torch.tensor([[5, 6, 7]]))
    positions, roles = torch.arange(3)[None], torch.tensor([2])
    caches = ModelCache(model.n_layers)
    with pytest.raises(ValueError, match="^write_kv=False needs a decomposed cache and a LoRA on v_proj$"):
        model.decoder.run_layers(h, positions, roles, caches, 0, write_kv=False)
    assert all(c.length == 0 for c in caches.layers)
    decomposed = ModelCache(model.n_layers, decomposed=True)
    model.decoder.run_layers(h, positions, roles, decomposed, 0)
    model.decoder.run_layers(h, positions, torch.tensor([0]), decomposed, 0, write_kv=False)  # another role's V_lr
    assert decomposed[0].length == 3
