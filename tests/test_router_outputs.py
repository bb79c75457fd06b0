"""Router logits and auxiliary losses through the model forward (transformers' MoE conventions), in process and
through the remote-code path; MoE-X initialized from the dense MLP by `expertize upcycle`."""

import json

import pytest
import torch
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

from expertize.conversion.training.losses import next_token_ce
from expertize.conversion.recipe import recipe_from_dict
from expertize.conversion.surgery.splice import load_expertize_model, splice
from expertize.conversion.upcycle import upcycle
from expertize.modeling import FAMILIES, MoeXSpec, MxdSpec, build_sparse_layer
from tests.conftest import D_HIDDEN, D_MODEL, run_isolated, tiny_base_model

M, K = 4, 2


def _model(family: str = "llama"):
    torch.manual_seed(0)
    layers = {
        0: build_sparse_layer(MoeXSpec(d_in=D_MODEL, d_out=D_MODEL, d_expert=8, num_experts=M, k=K)),
        1: build_sparse_layer(MoeXSpec(d_in=D_MODEL, d_out=D_MODEL, d_expert=8, num_experts=M, k=K, router="switch",
                                       load_balance_counting="topk", load_balance_coef=0.01)),
    }
    return splice(tiny_base_model(family), layers).eval()


IDS = torch.randint(3, 99, (2, 9), generator=torch.Generator().manual_seed(0))


def test_causal_lm_returns_router_logits_and_adds_the_weighted_aux_loss():
    model = _model()
    model.config.router_aux_loss_coef = 0.5
    plain = model(IDS, labels=IDS)
    assert not isinstance(plain, MoeCausalLMOutputWithPast)
    assert all(layer.router_logits is None and layer.aux_loss is None for layer in model.sparse_layers().values())

    out = model(IDS, labels=IDS, output_router_logits=True)
    assert isinstance(out, MoeCausalLMOutputWithPast)
    torch.testing.assert_close(out.logits, plain.logits)
    assert len(out.router_logits) == 2 and all(r.shape == (IDS.numel(), M) for r in out.router_logits)

    # aux_loss = Σ_layers λ_layer · M Σ_i f_i P_i, computed here from the returned router logits.
    expected = 0.0
    for logits, layer in zip(out.router_logits, model.sparse_layers().values()):
        top = logits.topk(K, dim=-1).indices
        counted = top[:, 0] if layer.spec.load_balance_counting == "top1" else top.reshape(-1)
        f = torch.bincount(counted, minlength=M).float() / counted.numel()
        expected += layer.spec.load_balance_coef * M * (f * logits.float().softmax(-1).mean(0)).sum()
    torch.testing.assert_close(out.aux_loss, expected)
    lm_loss = next_token_ce(out.logits, IDS).mean()
    torch.testing.assert_close(out.loss, lm_loss + 0.5 * out.aux_loss)
    # The side channel is cleared afterwards (no graph kept alive between forwards).
    assert all(layer.router_logits is None for layer in model.sparse_layers().values())

    as_tuple = model(IDS, output_router_logits=True, return_dict=False)
    assert isinstance(as_tuple, tuple)  # ModelOutput.to_tuple order, None entries dropped: (aux_loss, logits, ...)
    torch.testing.assert_close(as_tuple[0], out.aux_loss)
    torch.testing.assert_close(as_tuple[1], out.logits)


def test_config_flag_and_base_model_and_models_without_routers():
    model = _model("gpt2")
    model.config.output_router_logits = True
    assert isinstance(model(IDS), MoeCausalLMOutputWithPast)
    base = model.transformer  # the base model inside a causal LM keeps its native output type
    assert not isinstance(base(IDS), MoeModelOutputWithPast)

    headless = FAMILIES["gpt2"][1](model.config)
    out = headless(IDS, output_router_logits=True)
    assert isinstance(out, MoeModelOutputWithPast) and len(out.router_logits) == 2

    mxd = splice(tiny_base_model("gpt2"), {1: build_sparse_layer(
        MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=16, k=4))})
    out = mxd(IDS, labels=IDS, output_router_logits=True)
    assert out.router_logits == () and out.aux_loss is None


def test_training_forward_reports_aux_loss_for_trainers():
    model = _model()
    model.train()
    model(IDS)
    layers = list(model.sparse_layers().values())
    assert all(layer.aux_loss is not None and layer.aux_loss.requires_grad for layer in layers)


@pytest.mark.slow  # a subprocess (~7 s)
def test_router_outputs_through_remote_code(tmp_path):
    model = _model("gpt_neox")
    model.save_pretrained(tmp_path / "model")
    out = model(IDS, labels=IDS, output_router_logits=True)
    torch.save(IDS, tmp_path / "ids.pt")
    result = json.loads(run_isolated(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "model")!r}, trust_remote_code=True).eval()
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        out = model(ids, labels=ids, output_router_logits=True)
        print(json.dumps({{"type": type(out).__name__, "aux": out.aux_loss.item(), "loss": out.loss.item(),
                           "router": [r.tolist() for r in out.router_logits]}}))
        """,
        tmp_path,
    ))
    assert result["type"] == "MoeCausalLMOutputWithPast"
    assert result["aux"] == pytest.approx(out.aux_loss.item(), rel=1e-5)
    assert result["loss"] == pytest.approx(out.loss.item(), rel=1e-5)
    for got, want in zip(result["router"], out.router_logits):
        torch.testing.assert_close(torch.tensor(got), want.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # 5-25 s (subprocesses or a whole upcycle): in CI's opt-in run, off the fast suite's 8 minutes
def test_upcycle_split_init_is_exact_and_the_relu_switch_is_reported(tiny_run):
    """layer.init: split with every expert on and unscaled gates reproduces the MLPs (ΔCE at init = 0); switching
    the Llama MLP's SiLU to ReLU is explicit and its cost before training is in metrics.json["init"]."""
    tmp_path, tree = tiny_run
    tree["train"]["distill"] = False
    tree["heal"] = {"tokens": 256, "batch_sequences": 8, "lr": 1e-3, "warmup_steps": 1}
    tree["eval"]["generation_prompts"] = 0
    exact = {"kind": "moe_x", "num_experts": M, "k": M, "init": "split", "options": {"gate_scaling": "none"}}
    out = upcycle(recipe_from_dict({**tree, "layer": exact, "output_dir": str(tmp_path / "exact")}), progress=False)
    init = json.loads((out / "metrics.json").read_text())["init"]
    assert init["method"] == "split" and abs(init["delta"]) < 1e-6

    # Then distilled, and healed with LoRA on the 3-D expert encoders (PEFT target_parameters), merged on save.
    relu = {"kind": "moe_x", "num_experts": M, "k": K, "init": "split", "activation": "relu"}
    heal = {**tree["heal"], "rest": "lora", "lora_target_modules": [], "lora_target_parameters": ["mlp.W_enc"]}
    train = {**tree["train"], "distill": True}
    recipe = recipe_from_dict({**tree, "layer": relu, "train": train, "heal": heal, "output_dir": str(tmp_path / "relu")})
    out = upcycle(recipe, progress=False)
    metrics = json.loads((out / "metrics.json").read_text())
    assert abs(metrics["init"]["delta"]) > 1e-5  # SiLU -> ReLU and k < M change the function (either way on a random model)
    assert metrics["train"]["steps"] == 48 and metrics["heal"]["steps"] == 2
    model = load_expertize_model(out)
    spec = model.config.sparse_layers["0"]
    assert spec["activation"] == "relu" and spec["expert_glu"] and spec["gate_scaling"] == "k_softmax"
    assert not any("lora" in key for key in model.state_dict())
