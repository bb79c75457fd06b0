"""Splice sparse layers into tiny models of every family, save, and load through remote code in a fresh process."""

import json

import pytest
import torch

from expertize.conversion.surgery.splice import load_expertize_model, splice, splice_and_save
from expertize.modeling import FAMILIES, MxdLayer, MxdSpec, SkipTranscoderSpec, TranscoderSpec, build_sparse_layer
from tests.conftest import D_HIDDEN, D_MODEL, FAMILY_NAMES, check_remote_roundtrip, tiny_base_config, tiny_base_model
from tests.families import REFERENCE_FAMILY, ROWS

SUPPORTED = ", ".join(sorted(FAMILIES))


def trained_like_layers(family: str) -> dict:
    """An MxD at layer 0 (the base MLP's encoder type) and a skip transcoder at layer 1, with non-zero decoders."""
    row = ROWS[family]
    mxd = MxdSpec(
        d_in=D_MODEL,
        d_out=D_MODEL,
        d_hidden=D_HIDDEN,
        num_experts=24,
        k=4,
        encoder="glu" if row.glu else "mlp",
        activation=row.activation,
    )
    layers = {0: build_sparse_layer(mxd), 1: build_sparse_layer(SkipTranscoderSpec(d_in=D_MODEL, d_out=D_MODEL, num_latents=48, k=4))}
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in layers.values():
            layer.W_dec.normal_(0, 0.2)
            layer.b_dec.normal_(0, 0.1)
    return layers


# A subprocess per family (~7 s): the default run has the reference family's; every family loads through remote code
# there too, with one kind each, in tests/test_kind_contract.py's one-process round trip.
@pytest.mark.parametrize("family", [pytest.param(family, marks=() if family == REFERENCE_FAMILY else pytest.mark.slow)
                                    for family in FAMILY_NAMES])
def test_roundtrip_through_remote_code(family, tmp_path, tokenizer):
    base = tiny_base_model(family)
    layers = trained_like_layers(family)
    model = splice(base, layers)

    # Native weights copied untouched; sparse layers copied (not shared) with their values.
    spliced = model.state_dict()
    blocks = FAMILIES[family].blocks_path
    for key, value in base.state_dict().items():
        if ".mlp." not in key:
            assert torch.equal(spliced[key], value), key
    for index, layer in layers.items():
        for key, value in layer.state_dict().items():
            assert torch.equal(spliced[f"{blocks}.{index}.mlp.{key}"], value)
            assert spliced[f"{blocks}.{index}.mlp.{key}"].data_ptr() != value.data_ptr()

    report, input_ids, logits = check_remote_roundtrip(model, tmp_path, blocks, tokenizer)
    with torch.no_grad():
        base_logits = base(input_ids).logits
    assert not torch.allclose(logits, base_logits), "the sparse layers should change the output"
    files = {p.name for p in (tmp_path / "model").iterdir()}
    assert {"model.safetensors", "config.json", "modeling_expertize.py", "configuration_expertize.py", "mxd.py",
            "transcoder.py", "sparse_base.py", "sparse_code.py", "sparse_kernels.py", "sparse_layers.py",
            "sparse_spec.py", "tokenizer.json", "generation_config.json"} <= files
    assert not any(name.endswith((".bin", ".pt")) for name in files)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    assert config["model_type"] == f"expertize_{family}"
    assert report["sparse"] == ["MxdLayer", "TranscoderLayer"]

    # In-process reload with this library's classes gives the same logits too.
    reloaded = load_expertize_model(tmp_path / "model")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, logits)


def test_base_checkpoint_fills_everything_but_the_sparse_layers(tmp_path):
    """load_state_dict of a base checkpoint fills every native parameter of an expertize model."""
    base = tiny_base_model("gpt2")
    model = splice(base, {1: build_sparse_layer(TranscoderSpec(d_in=D_MODEL, d_out=D_MODEL, num_latents=40, k=4))})
    fresh = type(model)(model.config)
    result = fresh.load_state_dict(base.state_dict(), strict=False)
    assert sorted(result.missing_keys) == sorted(f"transformer.h.1.mlp.{k}" for k in ("W_enc", "b_enc", "W_dec", "b_dec"))
    assert sorted(result.unexpected_keys) == sorted(k for k in base.state_dict() if k.startswith("transformer.h.1.mlp."))


def test_splice_into_expertize_model_keeps_existing_layers():
    base = tiny_base_model("llama")
    first = splice(base, {0: build_sparse_layer(TranscoderSpec(d_in=D_MODEL, d_out=D_MODEL, num_latents=40, k=4))})
    second = splice(first, {1: MxdLayer(MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=8, k=2))})
    assert sorted(second.config.sparse_layers) == ["0", "1"]
    assert {i: type(m).__name__ for i, m in second.sparse_layers().items()} == {0: "TranscoderLayer", 1: "MxdLayer"}
    torch.testing.assert_close(second.model.layers[0].mlp.W_enc, first.model.layers[0].mlp.W_enc)


def test_splice_and_save_from_a_local_dir(tmp_path, tokenizer):
    base = tiny_base_model("gpt_neox")
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    layer = MxdLayer(MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=8, k=2))
    splice_and_save(tmp_path / "base", {1: layer}, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    with pytest.raises(FileExistsError, match="already exists"):
        splice_and_save(tmp_path / "base", {1: layer}, tmp_path / "out")
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert leftovers == []


# -- bad input ---------------------------------------------------------------------------------------------------


def test_unsupported_architecture_names_the_supported_ones():
    from transformers import AutoModelForCausalLM, OPTConfig

    opt = AutoModelForCausalLM.from_config(
        OPTConfig(vocab_size=99, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                  word_embed_proj_dim=16)
    )
    layer = build_sparse_layer(TranscoderSpec(d_in=16, d_out=16, num_latents=32, k=2))
    with pytest.raises(ValueError, match=rf"unsupported architecture 'opt'.*{SUPPORTED}"):
        splice(opt, {0: layer})


def test_layer_index_out_of_range():
    layer = build_sparse_layer(TranscoderSpec(d_in=D_MODEL, d_out=D_MODEL, num_latents=32, k=2))
    with pytest.raises(ValueError, match=r"layer index 2 is out of range; this model has 2 layers \(valid indices 0..1\)"):
        splice(tiny_base_model("gpt2"), {2: layer})


def test_spec_dimensions_must_match_the_base_mlp():
    layer = build_sparse_layer(TranscoderSpec(d_in=D_MODEL + 1, d_out=D_MODEL, num_latents=32, k=2))
    with pytest.raises(ValueError, match=r"transcoder.d_in=33 does not match the base MLP's width 32"):
        splice(tiny_base_model("llama"), {0: layer})


def test_splice_rejects_modules_that_are_not_sparse_layers():
    with pytest.raises(TypeError, match="expected a sparse layer"):
        splice(tiny_base_model("gpt2"), {0: torch.nn.Linear(D_MODEL, D_MODEL)})


def test_config_rejects_unknown_kind_and_bad_keys():
    from expertize.modeling import ExpertizeGPT2Config

    fields = {k: v for k, v in tiny_base_config("gpt2").to_dict().items() if k not in ("model_type", "transformers_version")}
    with pytest.raises(ValueError, match="unknown sparse layer kind 'dense'"):
        ExpertizeGPT2Config(sparse_layers={0: {"kind": "dense", "d_in": 32, "d_out": 32}}, **fields)
    with pytest.raises(ValueError, match="key 'first' is not a layer index"):
        ExpertizeGPT2Config(sparse_layers={"first": {}}, **fields)


def test_load_expertize_model_rejects_a_base_checkpoint(tmp_path):
    tiny_base_model("gpt2").save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match=r"is not an expertize model \(config.json has model_type 'gpt2'\)"):
        load_expertize_model(tmp_path / "base")


# -- family facts -------------------------------------------------------------------------------------------------


def test_the_test_table_lists_exactly_the_bundles_families():
    """tests/families.py drives every family test: a family in the bundle without a row there would go untested."""
    from expertize.conversion.surgery.families import _FACTS

    assert list(FAMILIES) == FAMILY_NAMES == list(_FACTS)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_table_and_conversion_facts(family):
    """One named row per family (bundle) plus the conversion-side facts (LoRA targets, decoder blocks, MLP shape,
    final norm, positions), each checked against the native model of tests/families.py's row."""
    from expertize.conversion.surgery.families import (
        attention_projections,
        conv1d_attention,
        decoder_blocks,
        family_info,
        final_norm,
        mlp_shape,
        model_positions,
    )

    row = FAMILIES[family]
    assert row.config_class.model_type == f"expertize_{family}"
    assert row.base_model_class.config_class is row.causal_lm_class.config_class is row.config_class
    assert tuple(row) == (row.config_class, row.base_model_class, row.causal_lm_class)  # positional order kept
    assert family_info(family) is row and family_info(f"expertize_{family}") is row
    native = ROWS[family]
    assert [issubclass(ours, theirs) for ours, theirs in zip(row, native.native)] == [True] * 3

    model = tiny_base_model(family)
    assert type(model) is native.native[2]
    blocks = decoder_blocks(model)
    assert blocks is model.get_submodule(row.blocks_path) and len(blocks) == model.config.num_hidden_layers
    assert all(hasattr(block, "mlp") for block in blocks)
    shape = mlp_shape(model.config)
    assert shape.d_model == model.config.hidden_size and shape.glu == native.glu
    assert final_norm(model) is model.get_submodule(native.final_norm)
    assert model_positions(model.config) == model_positions(model.config.to_dict()) == 64  # tiny_base_config's
    # The LoRA defaults name attention modules that exist, and none of the MLP's.
    names = [name for name, _ in model.named_modules()]
    for target in attention_projections(family):
        matches = [name for name in names if name.endswith("." + target)]
        assert len(matches) == len(blocks) and not any(".mlp." in name for name in matches), target
        assert all(f".{native.attention}." in name for name in matches), target
    conv1d = type(model.get_submodule(matches[0])).__name__ == "Conv1D"
    assert conv1d_attention(family) == conv1d
    # An expertize model of the family answers the same.
    spliced = splice(model, {0: build_sparse_layer(TranscoderSpec(d_in=D_MODEL, d_out=D_MODEL, num_latents=8, k=2))})
    assert isinstance(spliced, row.causal_lm_class)
    assert decoder_blocks(spliced) is spliced.get_submodule(row.blocks_path)
    assert final_norm(spliced) is spliced.get_submodule(native.final_norm)
    assert model_positions(spliced.config) == 64


def test_unknown_family_names_the_supported_ones():
    from expertize.conversion.surgery.families import attention_projections, base_family

    with pytest.raises(ValueError, match=rf"unsupported architecture 'bert'.*{SUPPORTED}"):
        base_family("bert")
    with pytest.raises(ValueError, match=r"unsupported architecture 'opt'"):
        attention_projections("opt")
