"""End-to-end healing and PEFT on expertize models: LoRA round trips, trainable sets, healing inside `upcycle`."""

import json

import pytest
import torch
from safetensors.torch import load_file

from expertize.conversion.data.text import load_eval_sequences
from expertize.conversion.surgery.families import attention_projections, conv1d_attention
from expertize.conversion.training.heal import Healer, prepare_for_healing
from expertize.conversion.training.losses import next_token_ce
from expertize.conversion.recipe import HealConfig, recipe_from_dict
from expertize.conversion.surgery.splice import load_expertize_model, splice
from expertize.conversion.upcycle import upcycle
from expertize.modeling import MxdSpec, build_sparse_layer
from tests.conftest import D_HIDDEN, D_MODEL, FAMILY_NAMES, tiny_base_model, tiny_tokenizer


def _spliced(family: str):
    torch.manual_seed(0)
    layer = build_sparse_layer(MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=16, k=4))
    torch.nn.init.normal_(layer.W_dec, std=0.1)  # the paper's init has D = 0; make the layer do something
    return splice(tiny_base_model(family), {1: layer})


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_lora_adapter_trains_saves_reloads_and_merges(family, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    _spliced(family).save_pretrained(tmp_path / "model")
    ids = torch.randint(0, 99, (2, 12), generator=torch.Generator().manual_seed(1))
    model = load_expertize_model(tmp_path / "model")
    before = model(ids).logits
    config = LoraConfig(r=4, lora_alpha=8, target_modules=attention_projections(family),
                        fan_in_fan_out=conv1d_attention(family))
    peft_model = get_peft_model(model, config)
    torch.testing.assert_close(peft_model(ids).logits, before)  # B = 0 at init

    optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model(ids, labels=ids).loss.backward()
    optimizer.step()
    peft_model.eval()
    trained = peft_model(ids).logits.detach()
    assert (trained - before).abs().max() > 1e-4

    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(load_expertize_model(tmp_path / "model"), tmp_path / "adapter").eval()
    torch.testing.assert_close(reloaded(ids).logits, trained)
    merged = reloaded.merge_and_unload()
    assert type(merged).__name__.startswith("Expertize")
    torch.testing.assert_close(merged(ids).logits, trained, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rest", ["frozen", "lora"])
def test_prepare_for_healing_trains_the_sparse_layers_and_only_the_chosen_rest(rest):
    model = prepare_for_healing(_spliced("llama"), HealConfig(rest=rest), "llama")
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    sparse = {name for name in trainable if ".layers.1.mlp." in name and "lora_" not in name}
    assert {name.rsplit(".", 1)[-1] for name in sparse} == {"W_enc", "b_enc", "W_gate", "b_gate", "W_experts", "W_dec", "b_dec"}
    lora = trainable - sparse
    if rest == "frozen":
        assert not lora
    else:
        assert lora and all("lora_" in name and "self_attn" in name for name in lora)


def test_upcycle_heals_with_lora_and_saves_the_merged_model(tiny_run):
    tmp_path, tree = tiny_run
    tree["heal"] = {"tokens": 2048, "batch_sequences": 8, "lr": 3e-3, "warmup_steps": 2, "rest": "lora",
                    "log_every": 4, "checkpoint_every": 8}
    recipe = recipe_from_dict(tree)
    out = upcycle(recipe, progress=False)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heal"]["steps"] == 16 and metrics["heal"]["rest"] == "lora"
    log = [json.loads(line) for line in (out / "heal_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [4, 8, 12, 16]
    assert log[-1]["kl"] < log[0]["kl"]

    # LoRA was merged: attention weights differ from the base's; the rest of the dense weights do not.
    saved = load_file(out / "model.safetensors")
    base = load_file(tmp_path / "base" / "model.safetensors")
    assert not torch.equal(saved["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(saved["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert not any("lora" in key for key in saved)

    # The reported spliced CE is the saved (healed) model's, not "base with the layers swapped in".
    model = load_expertize_model(out)
    eval_ids = load_eval_sequences(recipe.data, tiny_tokenizer())
    with torch.no_grad():
        ce = torch.cat([next_token_ce(model(eval_ids[i : i + 8]).logits, eval_ids[i : i + 8]).flatten()
                        for i in range(0, len(eval_ids), 8)]).double().mean().item()
    assert ce == pytest.approx(metrics["ce"]["spliced"], rel=1e-4)


@pytest.mark.slow  # healing interrupted and resumed
def test_healing_resumes_exactly_after_an_interruption(tiny_run, monkeypatch):
    tmp_path, tree = tiny_run
    tree["train"]["distill"] = False
    tree["heal"] = {"tokens": 2048, "batch_sequences": 8, "lr": 3e-3, "warmup_steps": 2, "log_every": 2,
                    "checkpoint_every": 6, "objective": "lm"}
    tree["eval"]["generation_prompts"] = 0
    reference = upcycle(recipe_from_dict({**tree, "output_dir": str(tmp_path / "uninterrupted")}), progress=False)

    save = Healer.save_checkpoint

    def save_then_die(self):
        save(self)
        if self.step == 6:
            raise KeyboardInterrupt("simulated kill after the step-6 checkpoint")

    monkeypatch.setattr(Healer, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        upcycle(recipe_from_dict(tree), progress=False)
    monkeypatch.setattr(Healer, "save_checkpoint", save)
    resumed = upcycle(recipe_from_dict(tree), progress=False)

    a, b = load_file(reference / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    assert _without_seconds(reference / "heal_log.jsonl") == _without_seconds(resumed / "heal_log.jsonl")


def _without_seconds(path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in path.read_text().splitlines()]
