"""scripts/reverse_reuse_share.py: the rows it counts are exactly those whose producer context another row of the
batch already computes in its plain pass (same tokens, the producer's role)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_modules.multi_lora_module import MultiLoraModule
from tests.conftest import load_script
from tests.test_cross_role_batches import ROLES, data

reverse = load_script("reverse_reuse_share")


@pytest.mark.parametrize("producer", ["random", "prefix"])
def test_reverse_rows_are_exactly_the_rows_with_a_producer_row_over_their_context(
    tmp_path: Path, producer: str
) -> None:
    dm = data(tmp_path)
    module = MultiLoraModule(
        model_name="tiny-llama", tokenizer_name="byte", roles=ROLES, val_schemes=[], producer=producer
    )
    module.train_config.lambda_shared = 0.5
    found_any = False
    for step, batch in enumerate(dm.train_dataloader()):
        batch = module.on_before_batch_transfer(batch, 0)
        prod = module.host_producers(batch, seed=step)
        split = module.shared_split(batch).tolist()
        got = reverse.reverse_rows(batch, prod, split)
        ids, roles, lengths = batch["input_ids"], batch["host"]["role_ids"], batch["host"]["lengths"]
        # brute force over every pair of rows: b holds j's context as its own first tokens, in j's producer's role
        want = {
            j
            for j in range(len(lengths))
            for b in range(len(lengths))
            if b != j
            and roles[b] == prod[j]
            and split[j] <= lengths[b]
            and bool((ids[b, : split[j]] == ids[j, : split[j]]).all())
        }
        assert got == want, (step, got, want)
        found_any |= bool(got)
    assert found_any
