"""The Python API as a notebook uses it: splice + save_model write a folder every command accepts (the base's
tokenizer included), load_model / text_codes / decode on it, and docs/upcycle.md's "From Python" example run as
written."""

import re
from pathlib import Path

import pytest
import torch

import expertize
from expertize.conversion.inspection.from_folder import checked_folder
from expertize.conversion.recipe import assets_dir
from expertize.modeling import SparseCode, TranscoderSpec, build_sparse_layer
from tests.conftest import tiny_base_model

BASE = assets_dir() / "tiny-gpt2-shakespeare"  # a real 4-layer GPT-2 with its own tokenizer (package data)


@pytest.fixture(scope="module")
def spliced(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    layer = build_sparse_layer(TranscoderSpec(d_in=128, d_out=128, num_latents=256, k=8))
    return expertize.save_model(expertize.splice(BASE, {2: layer}), tmp_path_factory.mktemp("nb") / "spliced")


def test_save_model_writes_the_base_models_tokenizer(spliced, tmp_path):
    # Before: no tokenizer was written unless given, and `inspect` refused the folder ("no loadable tokenizer").
    assert (spliced / "tokenizer.json").is_file() or (spliced / "vocab.json").is_file()
    config, tokenizer = checked_folder(spliced)
    assert tokenizer("To be")["input_ids"] == expertize.load_model(spliced)[1]("To be")["input_ids"]
    assert config["sparse_layers"].keys() == {"2"}
    # A model with no recorded base: nothing written, the error says what to pass.
    model = expertize.splice(tiny_base_model("gpt2"), {})
    with pytest.raises(ValueError, match=r"save_model: no tokenizer given and the model records no base .*pass it, "
                                         r"save_model\(model, dir, tokenizer\).* tokenizer=False"):
        expertize.save_model(model, tmp_path / "m")
    assert not (tmp_path / "m").exists()
    expertize.save_model(model, tmp_path / "m", tokenizer=False)
    assert (tmp_path / "m" / "model.safetensors").is_file() and not (tmp_path / "m" / "tokenizer.json").exists()


def test_text_codes_and_decode(spliced):
    model, tokenizer = expertize.load_model(spliced)
    cache = expertize.text_codes(model, tokenizer, "To be, or not to be")
    T = cache.input_ids.shape[0]
    assert cache.input_ids[0] == tokenizer.bos_token_id and len(cache.tokens) == T
    assert "".join(cache.tokens[1:]) == "To be, or not to be"
    index, weights = cache.codes[2]
    assert index.shape == weights.shape == (T, 8) and cache.inputs[2].shape == cache.outputs[2].shape == (T, 128)
    with torch.no_grad():
        torch.testing.assert_close(cache.logits, model(input_ids=cache.input_ids[None]).logits[0])
        layer = model.sparse_layers()[2]
        assert torch.equal(layer.encode(cache.inputs[2]).top_k_index, index)
    # decode(code, x) is the layer's output; an edited code gives what the same intervention gives.
    torch.testing.assert_close(expertize.decode(model, 2, cache.codes[2], cache.inputs[2]), cache.outputs[2])
    unit = int(index[-1, 0])
    edited = SparseCode(index, weights.masked_fill(index == unit, 0.0))
    with torch.no_grad(), layer.intervene(ablate=[unit]):
        ablated = layer(cache.inputs[2])
    torch.testing.assert_close(expertize.decode(layer, None, edited, cache.inputs[2]), ablated)
    assert not torch.allclose(ablated, cache.outputs[2])
    # The (index, weights) pair docs/upcycle.md unpacks a code into is the same code (before: AttributeError
    # 'tuple' object has no attribute 'top_k_index', from inside the layer's forward hook).
    for pair in (tuple(edited), list(edited), (index.tolist(), weights.masked_fill(index == unit, 0.0).tolist())):
        torch.testing.assert_close(expertize.decode(model, 2, pair, cache.inputs[2]), ablated)
    # What is no code is refused before the forward, in one line naming SparseCode and where it comes from.
    from expertize.conversion.errors import ExpertizeError

    for wrong, problem in (
        (index, r"expected a code, got Tensor; pass the code as decode's code argument: SparseCode\(index, "
                r"weights\) \(from expertize\.modeling import SparseCode\) or an \(index, weights\) pair"),
        ((weights, index), r"the code's index \(its first entry\) holds torch\.float32, not unit ids"),
        ((index, weights[:, :2]), r"the code's index \(\d+, 8\) and weights \(\d+, 2\) must have one "
                                  r"\(\.\.\., K\) shape"),
    ):
        with pytest.raises(ExpertizeError, match="^decode: " + problem) as caught:
            expertize.decode(model, 2, wrong, cache.inputs[2])
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=r"layer\(s\) \[0\] are not sparse layers of this model; choose from \[2\]"):
        expertize.text_codes(model, tokenizer, "x", layers=[0])


def test_the_from_python_example_of_docs_upcycle_md_runs(tmp_path, monkeypatch):
    page = (Path(__file__).resolve().parents[1] / "docs" / "upcycle.md").read_text(encoding="utf-8")
    example = re.search(r"## From Python\n.*?```python\n(.*?)```", page, re.S)[1]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(example, "docs/upcycle.md", "exec"), namespace)
    cache, steered = namespace["cache"], namespace["steered"]
    torch.testing.assert_close(namespace["out"], cache.outputs[2])
    # The edited code, decoded as the page writes it (an (index, weights) tuple), is the intervention's output.
    layer, unit = namespace["model"].sparse_layers()[2], namespace["unit"]
    with torch.no_grad(), layer.intervene(ablate=[unit]):
        torch.testing.assert_close(namespace["without"], layer(cache.inputs[2]))
    assert not torch.allclose(namespace["without"], cache.outputs[2])
    # Steering at positions=[-1]: the last token's logits move, the others stay as they were.
    torch.testing.assert_close(steered[:-1], cache.logits[:-1])
    assert not torch.allclose(steered[-1], cache.logits[-1])
