"""The launch counter of the GPU tests (``kernel_launches``), checked on the CPU: it sees every launch the kernel
launchers issue, of the class it names, and nothing else. (The GPU tests use it to count what the engine launches.)"""

from __future__ import annotations

import pytest
import torch
from kernel_launches import KERNELS, watch_launches

pytest.importorskip("triton")

import kernels.flash_lora_attention as fla  # noqa: E402
import kernels.flash_lora_decode as fld  # noqa: E402
from tests.test_kernel_decode import make_decode_inputs  # noqa: E402
from tests.test_kernel_reference import make_inputs  # noqa: E402


class _FakeKernel:
    """Records ``kernel[grid](...)`` calls instead of running Triton (no GPU here)."""

    def __init__(self) -> None:
        self.runs = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.runs += 1

        return run


@pytest.fixture
def fakes(monkeypatch):
    out = {}
    for module_name, names in KERNELS.values():
        module = fla if module_name == fla.__name__ else fld
        for name in names:
            out[name] = _FakeKernel()
            monkeypatch.setattr(module, name, out[name])
    monkeypatch.setattr(fla, "_flash_lora_combine_kernel", _FakeKernel())
    return out


@pytest.mark.parametrize("tune", [False, True])
def test_counter_sees_each_launch_of_its_class(fakes, monkeypatch, tune):
    monkeypatch.setattr(fla, "_autotune_enabled", lambda: tune)
    launches = watch_launches(monkeypatch)
    x = make_decode_inputs(2, 6, 2, 64, 16, 4, torch.float16, n_slots=3)
    lens = torch.tensor([10, 64])
    plan = fld._plan(2, 2, 3, 64, 16, 8)
    out = torch.empty_like(x["q"])
    fld._launch_decode(**x, kv_lens=lens, scaling=2.0, role_ids=None, kv_slot=None, lr_slot=None, out=out, plan=plan)
    assert dict(launches) == {"prefill": 0, "decode": 1}
    assert fakes["_flash_lora_decode_kernel"].runs == 1  # the real (here: fake) kernel still ran
    p = make_inputs(2, 4, 2, 8, 40, 16, 4, torch.float16)
    for split in (False, True):  # the prefill launch and the split-K launch
        fla._launch(**p, scaling=2.0, role_ids=None, kv_lens=None, sm_scale=0.25, force_split=split)
    assert dict(launches) == {"prefill": 2, "decode": 1}
    ran = sum(fakes[n].runs for n in ("_flash_lora_fwd_kernel", "_prefill_tuned", "_decode_tuned"))
    assert ran == 2


def test_counter_names_are_the_launchers_globals(monkeypatch):
    """A kernel renamed in its module makes the counter refuse (instead of silently counting nothing)."""
    monkeypatch.delattr(fld, "_flash_lora_decode_kernel")
    with pytest.raises(AssertionError, match="stale"):
        watch_launches(monkeypatch)
