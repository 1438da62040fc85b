"""Cross-role batches: an example whose context starts with another role's whole example shares its batch with it,
and the weighted λ step scores that example's plain term inside the shared pass (exact, one sequence fewer)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from datamodules import RoleExampleDataModule, byte_tokenizer
from datamodules.cross_role_prefixes import CROSS_ROLE_MIN_SHARE, cross_role_groups, prefix_sources
from datamodules.records import TokenizedExample
from datamodules.role_examples import LengthBucketBatchSampler
from tests.test_training_recipe import module

ROLES = ["plan", "action", "reflect"]


def write_chained(tmp_path: Path, n: int = 6, steps: int = 2) -> dict[str, str]:
    """Trajectories as the bundled ones: the action's input starts with the plan's input and output, the reflect's
    with the action's."""
    rows: dict[str, list[dict[str, str]]] = {r: [] for r in ROLES}
    for i in range(n):
        history = f"Solve task {i} with care.\n"
        for k in range(steps):
            plan_in = history + "Thought: \n### Response:\n"
            plan_out = f"think about {i} at {k}"
            act_in = plan_in + plan_out + "\nAction: \n### Response:\n"
            act_out = f"Search[{i}-{k}]"
            ref_in = act_in + act_out + "\nObs: done\nReflect: \n### Response:\n"
            ref_out = f"ok {i}"
            rows["plan"].append({"input": plan_in, "output": plan_out})
            rows["action"].append({"input": act_in, "output": act_out})
            rows["reflect"].append({"input": ref_in, "output": ref_out})
            history = act_in + act_out + "\nObs: done\n"
    files = {}
    for role in ROLES:
        path = tmp_path / f"{role}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in rows[role]))
        files[role] = str(path)
    return files


def data(tmp_path: Path, **kwargs) -> RoleExampleDataModule:
    args = dict(
        tokenizer=byte_tokenizer(), max_length=512, val_fraction=0.0, batch_size=4, cross_role_batches=True,
        cross_role_min_share=0.0,
    )  # fmt: skip
    dm = RoleExampleDataModule(write_chained(tmp_path), roles=ROLES, **{**args, **kwargs})
    dm.setup()
    return dm


def ex(ids: list[int], ctx: int, role: int) -> TokenizedExample:
    return TokenizedExample(input_ids=ids, context_len=ctx, prefix_len=0, role_id=role, source="t")


def test_prefix_sources_by_hand() -> None:
    eos = 0
    batch = [
        ex([5, 6, 7, eos], 2, 0),  # plan, whole example 5 6 7; its context (2 tokens) has room for no one's example
        ex([5, 6, 7, 8, 9, eos], 4, 1),  # action: context 5 6 7 8 starts with row 0's and row 4's examples
        ex([5, 6, 7, 8, 1, eos], 3, 1),  # action: context 5 6 7 *is* row 0's example (k must be < context): row 4
        ex([5, 6, 7, 8, 9, 2, eos], 5, 0),  # plan: row 1's example needs 5 < 5 tokens; row 0 has its own role
        ex([5, 6, eos], 1, 2),  # reflect: context of 1 token
    ]
    assert prefix_sources(batch) == [[], [(0, 3), (4, 2)], [(4, 2)], [(4, 2)], []]


@pytest.mark.parametrize("max_group", [2, 3])
def test_groups_keep_chains_in_one_batch(tmp_path: Path, max_group: int) -> None:
    dm = data(tmp_path, batch_size=max_group)
    examples = dm.train_set.examples
    groups = dm.train_groups
    assert sorted(i for g in groups for i in g) == list(range(len(examples)))
    links = [(g[i], g[i + 1]) for g in groups for i in range(len(g) - 1)]
    assert max(len(g) for g in groups) == max_group  # chains reach the cap in this data (plan → action → reflect)
    assert len(links) >= len(examples) // 3  # every action and reflect example has a source in this data
    for j, c in links:
        k = len(examples[j].input_ids) - 1
        assert examples[j].role_id != examples[c].role_id and examples[c].input_ids[:k] == examples[j].input_ids[:k]
    # batches one more than a chain: chains and single examples do not tile them, so a chain would be cut if the
    # sampler allowed it
    bs = max_group + 1
    sampler = LengthBucketBatchSampler(dm.train_set.lengths, bs, shuffle=True, seed=2, pool_batches=2, groups=groups)
    seen = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) and all(len(b) <= bs for b in batches)
        where = {i: n for n, b in enumerate(batches) for i in b}
        assert sorted(where) == list(range(len(examples)))  # each example once per epoch
        assert all(where[j] == where[c] for j, c in links)
        seen.append(batches)
    assert seen[0] != seen[1] and sorted(map(sorted, seen[0])) == sorted(map(sorted, seen[1]))  # order only
    budget = LengthBucketBatchSampler(dm.train_set.lengths, 4, max_tokens=1024, groups=groups)
    for b in budget:
        assert len(b) * max(dm.train_set.lengths[i] for i in b) <= 1024 or len(b) <= max_group
        assert all((j in b) == (c in b) for j, c in links)


def test_min_share_bounds_every_chains_padding(tmp_path: Path) -> None:
    """``cross_role_min_share``: every chain's shortest example has at least that share of its longest's tokens. In
    this data the pairs pass at 0.7 where whole plan → action → reflect chains do not (e.g. 155 → 190 → 229 tokens:
    each link ≥ 0.8, the chain 0.68), so a check of the link alone would let the chains through."""
    examples = data(tmp_path, batch_size=3).train_set.examples
    links = {}
    for share in (0.0, 0.5, 0.7, 0.9):
        groups = cross_role_groups(examples, 3, share)
        assert sorted(i for g in groups for i in g) == list(range(len(examples)))
        for g in groups:
            lens = [len(examples[i].input_ids) for i in g]
            assert min(lens) >= share * max(lens), (share, lens)
        links[share] = sum(len(g) - 1 for g in groups)
    assert links[0.0] > links[0.5] > links[0.7] > links[0.9] == 0  # each share drops some links in this data
    assert any(len(g) == 2 for g in cross_role_groups(examples, 3, 0.7))
    # the data module forms its groups with its share (the default: CROSS_ROLE_MIN_SHARE)
    dm = data(tmp_path, batch_size=3, cross_role_min_share=0.7)
    assert dm.train_groups == cross_role_groups(examples, 3, 0.7) != cross_role_groups(examples, 3, 0.0)
    args = dict(tokenizer=byte_tokenizer(), max_length=512, val_fraction=0.0, batch_size=3, cross_role_batches=True)
    dm = RoleExampleDataModule(write_chained(tmp_path), roles=ROLES, **args)
    dm.setup()
    assert dm.cross_role_min_share == CROSS_ROLE_MIN_SHARE
    assert dm.train_groups == cross_role_groups(examples, 3, CROSS_ROLE_MIN_SHARE)
    with pytest.raises(ValueError, match="min_length_share must be in"):
        cross_role_groups(examples, 3, 1.5)
    with pytest.raises(ValueError, match="cross_role_min_share must be in"):
        data(tmp_path, cross_role_min_share=-0.1)


def test_bad_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        LengthBucketBatchSampler([3, 4, 5], 2, groups=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="smaller than a group"):
        LengthBucketBatchSampler([3, 4, 5], 1, groups=[[0, 1], [2]])
    with pytest.raises(ValueError, match="pack_prefixes"):
        RoleExampleDataModule({"plan": "x"}, tokenizer=byte_tokenizer(), cross_role_batches=True, pack_prefixes=True)


def lower_split(batch: dict) -> int:
    """Moves the shared split of the first row with a source to one token before the source ends (the source's rows
    then reach into the consumer's part); returns that row."""
    b = next(i for i, found in enumerate(batch["prefix_sources"]) if found)
    k = batch["prefix_sources"][b][0][1]
    batch["host"]["prefix_len"][b] = k - 1
    batch["prefix_len"][b] = k - 1
    return b


def spread_adapters(m) -> None:
    """B away from zero: the roles must differ for an equality between roles' passes to mean anything."""
    with torch.no_grad():
        for p in m.lora_model.lora_parameters():
            p.normal_(0, 0.05)


def loss_and_grads(m, batch: dict, seed: int, absorb: bool, bf16: bool = False) -> tuple[dict, list[torch.Tensor]]:
    """``compute_loss`` and every adapter gradient, with the sources' plain terms scored in the shared pass
    (``absorb``) or with the absorption switched off (the two separate passes); ``bf16``: under CUDA autocast."""
    m.zero_grad(set_to_none=True)
    orig = m.absorption_plan
    if not absorb:
        m.absorption_plan = lambda *a, **k: None
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            out = m.compute_loss(batch, seed=seed)
    finally:
        m.absorption_plan = orig
    out["loss"].backward()
    return out, [p.grad.float().clone() for p in m.lora_model.lora_parameters()]


@pytest.mark.parametrize(
    ("scheme", "producer", "cut"),
    [("base_lr_shared", "prefix", False), ("full_shared", "prefix", False), ("base_lr_shared", "random", False),
     ("base_lr_shared", "prefix", True)],
)  # fmt: skip
def test_absorbed_plain_terms_equal_the_two_passes(tmp_path: Path, scheme: str, producer: str, cut: bool) -> None:
    """The weighted λ step with the sources' plain terms scored in the shared pass gives the loss, both terms and
    every adapter gradient of the two separate passes (dropout 0; float32). With random producers some rows' producer
    is not their source's role, and with ``cut`` one source reaches past its consumer's split: neither may be
    absorbed."""
    dm = data(tmp_path)
    loader = iter(dm.train_dataloader())
    batches = [next(loader) for _ in range(3)]
    assert all(any(b["prefix_sources"]) for b in batches)
    m = module(lambda_shared=0.5, producer=producer, shared_scheme=scheme, adapter_seed=1)
    m.configure_model()
    spread_adapters(m)
    absorbed = skipped = chained = 0
    for batch in batches:
        batch = m.on_before_batch_transfer(batch, 0)
        if cut:
            lower_split(batch)
        split = m.shared_split(batch).tolist()
        for seed in range(4):
            prod = m.host_producers(batch, seed)
            plan = m.absorption_plan(batch, prod) or {}
            chained += any(b in plan for b in plan.values())  # a row absorbed and absorbing in one step
            for b, found in enumerate(batch["prefix_sources"]):
                for j, k in found:
                    skipped += batch["host"]["role_ids"][j] != prod[b] or k > split[b]
            got, g_got = loss_and_grads(m, batch, seed, True)
            want, g_want = loss_and_grads(m, batch, seed, False)
            absorbed += int(got.get("absorbed_rows", torch.tensor(0.0)).item())
            assert "absorbed_rows" not in want
            for key in ("loss", "plain", "shared"):
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
            for a, b in zip(g_got, g_want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert absorbed >= 1
    if producer == "prefix" and not cut:
        assert chained >= 1
    if producer == "random" or cut:
        assert skipped >= 1  # the case that must not be absorbed occurred


@pytest.mark.model
def test_absorbed_plain_terms_equal_the_two_passes_on_real_token_budget_batches() -> None:
    """The same equality on the bundled HotpotQA data as the 8B benchmark batches it: the embedded tokenizer, 4096
    tokens, 16,384-token batches of 11–18 rows with chains and unlinked rows side by side (the synthetic data above
    has neither the lengths nor the mix)."""
    from eval_suite.bench.train import _data_files

    dm = RoleExampleDataModule(
        _data_files("hotpotqa", ROLES), roles=ROLES, tokenizer="default", max_length=4096, batch_size=4,
        val_fraction=0.0, cross_role_batches=True, max_tokens=16384,
    )  # fmt: skip
    dm.setup("fit")
    m = module(
        lambda_shared=0.5, producer="prefix", adapter_seed=1, tokenizer_name="default",
        model_overrides={"vocab_size": len(dm.tokenizer), "num_hidden_layers": 2},
    )  # fmt: skip
    m.configure_model()
    spread_adapters(m)
    checked = absorbed = 0
    for step, batch in enumerate(dm.train_dataloader()):
        if checked == 2:
            break
        batch = m.on_before_batch_transfer(batch, 0)
        plan = m.absorption_plan(batch, m.host_producers(batch, step)) or {}
        if not plan:
            continue
        outs, grads = zip(*(loss_and_grads(m, batch, step, absorb) for absorb in (True, False)), strict=True)
        assert int(outs[0]["absorbed_rows"].item()) == len(plan) and "absorbed_rows" not in outs[1]
        for key in ("loss", "plain", "shared"):
            torch.testing.assert_close(outs[0][key], outs[1][key], rtol=1e-5, atol=1e-6)
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
        checked += 1
        absorbed += len(plan)
    assert checked == 2 and absorbed >= 4


def test_prefix_producer_is_the_source_role(tmp_path: Path) -> None:
    """``producer: prefix`` gives a row the role of its longest source within the split, and the rows without one the
    ``random`` draw of the same seed (the cut row among them)."""
    dm = data(tmp_path)
    batch = next(iter(dm.train_dataloader()))
    m = module(lambda_shared=0.5, producer="prefix")
    rand = module(lambda_shared=0.5, producer="random")
    batch = m.on_before_batch_transfer(batch, 0)
    cut = lower_split(batch)  # this row's source no longer fits its split
    roles, split = batch["host"]["role_ids"], m.shared_split(batch).tolist()
    assert not [j for j, k in batch["prefix_sources"][cut] if k <= split[cut]]
    n_set = 0
    for seed in range(8):
        prod, drawn = m.host_producers(batch, seed), rand.host_producers(batch, seed)
        for b, found in enumerate(batch["prefix_sources"]):
            fits = [j for j, k in found if k <= split[b]]
            assert prod[b] == (roles[fits[0]] if fits else drawn[b])
            n_set += bool(fits)
        assert torch.equal(m.draw_producers(batch["role_ids"], seed, batch), torch.tensor(prod))
    assert n_set >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_absorbed_plain_terms_equal_the_two_passes_on_the_gpu(tmp_path: Path) -> None:
    """The same equality on a GPU under bf16 autocast, as training runs (the shared pass's Triton kernels, the host
    index copies from page-locked memory): the terms to bf16 accuracy, the gradients to 5% in norm."""
    dm = data(tmp_path)
    loader = iter(dm.train_dataloader())
    m = module(lambda_shared=0.5, producer="prefix", adapter_seed=1, model_dtype="bfloat16")
    m.configure_model()
    m.to("cuda")
    spread_adapters(m)
    absorbed = 0
    for _ in range(3):
        batch = m.on_before_batch_transfer(next(loader), 0)
        batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
        outs, grads = zip(*(loss_and_grads(m, batch, 2, absorb, bf16=True) for absorb in (True, False)), strict=True)
        absorbed += int(outs[0].get("absorbed_rows", torch.tensor(0.0)).item())
        for key in ("loss", "plain", "shared"):
            torch.testing.assert_close(outs[0][key], outs[1][key], rtol=2e-2, atol=2e-3)
        for a, b in zip(*grads, strict=True):
            assert (a - b).norm() <= 0.05 * b.norm() + 1e-6
    assert absorbed >= 1
