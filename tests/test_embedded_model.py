"""Exactness on the embedded SmolLM2-135M-Instruct in fp32 on CPU (acceptance of the core runtime).

Short trajectories keep these quick; the tiny-model property tests cover random schedules.
"""

from __future__ import annotations

import pytest
import torch

from lragent.adapters_io import export_peft, load_adapter_dir
from lragent.lora_model import MultiLoraModel
from lragent.multi_lora import MultiLoraConfig
from lragent.schemes import SCHEMES
from lragent.session import MultiAgentSession

pytestmark = pytest.mark.model

TEXT = [
    ("plan", "Question: Which band recorded Master of Puppets?\nThought: \n### Response:\n", 6),
    ("plan", "\nAction: \n### Response:\n", 4),
    ("action", "\nAciton: Retrieve[\n### Response:\n", 5),
    ("reflect", "]\nObversation: Metallica is an American heavy metal band.\nThought: \n### Response:\n", 5),
    ("plan", "\nThought: \n### Response:\n", 4),
]


@pytest.fixture(scope="module")
def random_adapters(load_embedded):
    hf, tok = load_embedded()
    model = MultiLoraModel(hf, MultiLoraConfig(dropout=0.0))
    model.init_adapters("random", seed=0, b_std=0.02)  # role effect ~2.8 logits (max)
    return model.eval(), tok


def run(model, tok, scheme, schedule, return_logits=False):
    session = MultiAgentSession(model, scheme, tokenizer=tok, eos_token_ids=[])
    out = []
    for role, text, n in schedule:
        session.append_text(text)
        out.append(session.step(role, max_new_tokens=n, return_logits=return_logits))
    return session, out


def test_non_shared_equals_merged_transformers(random_adapters):
    model, tok = random_adapters
    session, results = run(model, tok, "non_shared", TEXT, return_logits=True)
    worst = 0.0
    merged = {role: model.merged_model(role) for role in model.router.roles}
    ids = torch.tensor([session.ids])
    for (role, _, _), res in zip(TEXT, results, strict=True):
        ref = merged[role](ids).logits[0]
        worst = max(worst, float((ref[res.logit_positions] - res.logits).abs().max()))
    print(f"max |logit diff| non_shared vs merged transformers: {worst:.2e}")
    assert worst <= 1e-4
    # the roles really differ, so the check above is not vacuous
    assert (merged["plan"](ids).logits - merged["action"](ids).logits).abs().max() > 0.5


def test_one_role_all_schemes_same_greedy_tokens(random_adapters):
    model, tok = random_adapters
    schedule = [("action", text, n) for _, text, n in TEXT]
    ref = [r.generated_ids for r in run(model, tok, "non_shared", schedule)[1]]
    assert sum(len(r) for r in ref) == sum(n for _, _, n in schedule)
    for scheme in SCHEMES[1:]:
        assert [r.generated_ids for r in run(model, tok, scheme, schedule)[1]] == ref, scheme


def test_zero_b_all_schemes_equal_base_generate(load_embedded):
    hf, tok = load_embedded()
    base, _ = load_embedded()
    model = MultiLoraModel(hf, MultiLoraConfig(dropout=0.0)).eval()  # fresh adapters: B = 0
    ids: list[int] = []
    expected = []
    for _, text, n in TEXT:
        ids += tok(text, add_special_tokens=False)["input_ids"]
        gen = base.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        new = gen[0, len(ids) :].tolist()
        expected.append(new)
        ids += new
    for scheme in SCHEMES:
        session, results = run(model, tok, scheme, TEXT)
        assert [r.generated_ids for r in results] == expected, scheme


def test_peft_round_trip(random_adapters, load_embedded, tmp_path):
    from peft import PeftModel

    model, tok = random_adapters
    export_peft(model, tmp_path, base_model_name="smollm2-135m-instruct")
    ids = torch.tensor([tok("The role adapters of an agent", add_special_tokens=False)["input_ids"]])
    for role in model.router.roles:
        base, _ = load_embedded()
        peft_model = PeftModel.from_pretrained(base, str(tmp_path / role)).eval()
        with torch.no_grad():
            diff = (peft_model(ids).logits - model(ids, [role])).abs().max().item()
        print(f"PEFT {role}: max |logit diff| {diff:.2e}")
        assert diff <= 1e-5
    # import back: PEFT directories alone (native file removed) and the native checkpoint
    hf2, _ = load_embedded()
    back = MultiLoraModel(hf2, MultiLoraConfig(dropout=0.0)).eval()
    (tmp_path / "lragent_adapters.safetensors").rename(tmp_path / "native.bak")
    load_adapter_dir(back, tmp_path)
    for role in model.router.roles:
        torch.testing.assert_close(back(ids, [role]), model(ids, [role]), rtol=0, atol=0)
