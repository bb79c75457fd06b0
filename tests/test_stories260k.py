"""Integration on the real stories260k Llama checkpoint (SwiGLU MLP), located through EXPERTIZE_TEST_DATA."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from expertize.conversion.surgery.splice import save_model, splice
from expertize.modeling import MxdLayer, MxdSpec
from tests.conftest import run_isolated, shared_data_dir


@pytest.fixture(scope="module")
def stories():
    path = shared_data_dir() / "models" / "stories260k"
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_no_layer_replaced_gives_identical_logits(stories):
    path, base, tokenizer = stories
    model = splice(path, {})
    assert type(model).__name__ == "ExpertizeLlamaForCausalLM"
    ids = tokenizer("Once upon a time there was a little girl", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base(ids).logits)


@pytest.mark.slow  # a real checkpoint and a subprocess (~7 s)
def test_mxd_glu_at_layer_2_saves_reloads_remotely_and_generates(stories, tmp_path):
    path, base, tokenizer = stories
    shape = (base.config.hidden_size, base.config.intermediate_size)
    layer = MxdLayer(MxdSpec(d_in=shape[0], d_out=shape[0], d_hidden=shape[1], num_experts=256, k=8, encoder="glu",
                             activation="silu"))
    with torch.no_grad():
        layer.W_dec.normal_(0, 0.05)
    model = splice(path, {2: layer})
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)[0].tolist()
    save_model(model, tmp_path / "model", tokenizer=tokenizer)
    torch.save({"input_ids": ids, "logits": logits, "greedy": greedy}, tmp_path / "reference.pt")
    out = run_isolated(
        """
        import json, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        ref = torch.load("reference.pt")
        model, info = AutoModelForCausalLM.from_pretrained("model", trust_remote_code=True, output_loading_info=True)
        assert type(model).__module__.startswith("transformers_modules")
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        torch.testing.assert_close(model(ref["input_ids"]).logits, ref["logits"])
        tok = AutoTokenizer.from_pretrained("model", trust_remote_code=True)  # AutoTokenizer reads the config too
        out = model.generate(ref["input_ids"], max_new_tokens=8, do_sample=False)
        assert out[0].tolist() == ref["greedy"]
        print(json.dumps({"text": tok.decode(out[0]), "mlp": type(model.model.layers[2].mlp).__name__}))
        """,
        tmp_path,
    )
    report = json.loads(out.strip().splitlines()[-1])
    assert report["mlp"] == "MxdLayer" and report["text"].startswith("<s> Once upon a time")
