"""Upcycling MoE-X from dense MLPs: split reproduces the MLP exactly, copy + noise spreads tokens over the experts,
activation switches are explicit, and misfit specs fail with clear messages."""

from functools import partial
from pathlib import Path

import pytest
import torch

from expertize.conversion.data.mlp_pairs import decoder_blocks
from expertize.conversion.surgery.dense_init import (
    dense_mlp,
    init_from_dense,
    init_moe_from_dense,
    layer_from_dense,
    partition_neurons,
    spec_for_dense,
)
from expertize.conversion.recipe import recipe_from_dict
from expertize.conversion.recipe.layer_spec import resolve_layer_spec
from expertize.conversion.surgery.families import MlpLayout, mlp_shape
from expertize.conversion.surgery.splice import splice
from expertize.modeling import LAYER_KINDS, MlpShape, MoeXLayer, TranscoderSpec, build_sparse_layer
from tests.conftest import D_HIDDEN, D_MODEL, FAMILY_NAMES, VOCAB, tiny_base_model
from tests.families import MLP_FORMS, ROWS

# dense_init names no kind; these tests are MoE-X's, but for the kind-agnostic exactness check below.
moe_x_from_dense = partial(layer_from_dense, "moe_x")
moe_x_spec_for_mlp = partial(spec_for_dense, "moe_x")

FAMILIES = FAMILY_NAMES
SPLIT_KINDS = [kind for kind, (spec_cls, _) in LAYER_KINDS.items() if "split" in spec_cls.init_modes]


def _model(family: str) -> torch.nn.Module:
    """The family's tiny base model in float64, with random biases and norm weights (a dropped or misplaced bias,
    or a norm read at its init value, then shows)."""
    model = tiny_base_model(family).double()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5 + (0 if name.endswith("bias") else
                                                                                     p.mean()))
    return model


def _mlps(family: str) -> list[torch.nn.Module]:
    return [block.mlp for block in decoder_blocks(_model(family))]


def _x(T: int = 64) -> torch.Tensor:
    return torch.randn(T, D_MODEL, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_mlp_reads_every_family(family):
    mlp = _mlps(family)[0]
    dense = dense_mlp(mlp, family)
    assert dense.shape == (D_MODEL, D_HIDDEN, D_MODEL)
    row = ROWS[family]
    assert (dense.activation, dense.glu, dense.has_bias) == (row.activation, row.glu, row.bias)


@pytest.mark.parametrize("clustering", ["random", "balanced_kmeans"])
@pytest.mark.parametrize("num_experts", [4, 37])
@pytest.mark.parametrize("family", FAMILIES)
def test_split_with_all_experts_reproduces_the_dense_mlp_exactly(family, num_experts, clustering):
    x = _x()
    for mlp in _mlps(family):
        layer = moe_x_from_dense(mlp, "split", num_experts, family=family, clustering=clustering)
        assert layer.spec.k == num_experts and layer.spec.gate_scaling == "none"
        assert layer.spec.d_expert == -(-D_HIDDEN // num_experts)  # 37 / 4 -> 10: three zero slots
        with torch.no_grad():
            torch.testing.assert_close(layer(x), mlp(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", SPLIT_KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_dense_initialised_splice_gives_the_native_logits(family, kind):
    """The oracle for a family's surgery: every MLP replaced by a layer split from it (all units on) gives the native
    model's logits, so the MLP the layer reads and writes is the module whose output the family's block post-norms
    (Gemma, OLMo-2), and dense_init reads its weights and activation right."""
    model = _model(family)
    blocks = decoder_blocks(model)
    layers = {i: layer_from_dense(kind, blocks[i].mlp, "split", 4, family=family) for i in range(len(blocks))}
    spliced = splice(model, layers)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        native, ours = model(ids).logits, spliced(ids).logits
    assert type(spliced).__name__.startswith("Expertize") and len(spliced.sparse_layers()) == len(blocks)
    torch.testing.assert_close(ours, native, rtol=1e-10, atol=1e-10)


def _docs_split_layer() -> dict:
    """The `layer:` docs/upcycle.md gives for a split that is exactly the MLP."""
    import re

    import yaml

    page = (Path(__file__).resolve().parents[1] / "docs" / "upcycle.md").read_text(encoding="utf-8")
    section = page.split("## Initialization from the dense MLP", 1)[1].split("\n## ", 1)[0]
    return yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S)[1])["layer"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_recipe_split_docs_upcycle_md_gives_is_the_native_model(family, tmp_path):
    """Through the recipe (the spec `expertize upcycle` resolves, initialized as it does) the documented settings give
    the native logits; the defaults (k_softmax gates) start near the MLP, not at it, as the page says. Before, the
    page said "with every expert on and unscaled gates" and named no setting: a user's `init: split` with k equal
    to num_experts kept the default k_softmax gates (+1e-3 nats of CE before training on Gemma-2)."""
    layer = _docs_split_layer()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text\n", encoding="utf-8")
    assert layer["k"] == layer["num_experts"] and layer["options"] == {"gate_scaling": "none"}
    model = _model(family)
    shape = mlp_shape(model.config)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        native = model(ids).logits
    for settings, exact in ((layer, True), ({**layer, "options": {}}, False)):
        recipe = recipe_from_dict({"base_model": "unused", "layers": "all", "layer": settings,
                                   "data": {"source": "text", "paths": [str(corpus)]}, "output_dir": str(tmp_path)})
        spec = resolve_layer_spec(recipe.layer, shape, recipe.train.balance)
        layers = {}
        for i, block in enumerate(decoder_blocks(model)):
            layers[i] = build_sparse_layer(spec).double()
            init_moe_from_dense(layers[i], block.mlp, "split", family=family, clustering=recipe.layer.init_clustering,
                                seed=i, allow_activation_change=True)
        with torch.no_grad():
            ours = splice(model, layers)(ids).logits
        if exact:
            torch.testing.assert_close(ours, native, rtol=1e-10, atol=1e-10)
        else:
            assert spec.gate_scaling == "k_softmax" and not torch.allclose(ours, native, rtol=1e-6, atol=1e-6)


def test_split_padding_slots_are_zero():
    dense = dense_mlp(_mlps("gpt2")[0], "gpt2")
    layer = moe_x_from_dense(dense, "split", 4)
    groups = partition_neurons(dense, 4)
    assert [len(g) for g in groups] == [10, 9, 9, 9]
    for j, group in enumerate(groups):
        torch.testing.assert_close(layer.W_enc[j, : len(group)], dense.w_in[group])
        torch.testing.assert_close(layer.W_dec[j, :, : len(group)], dense.w_out[:, group])
        assert layer.W_enc[j, len(group) :].abs().sum() == 0 and layer.W_dec[j, :, len(group) :].abs().sum() == 0
        assert layer.b_enc[j, len(group) :].abs().sum() == 0


def test_split_with_fewer_experts_active_is_a_sparse_approximation():
    mlp = _mlps("gpt_neox")[0]
    layer = moe_x_from_dense(mlp, "split", 4, k=2, family="gpt_neox")
    x = _x()
    with torch.no_grad():
        assert not torch.allclose(layer(x), mlp(x))
        assert layer.encode(x).top_k_index.shape == (64, 2 * 10)


@pytest.mark.parametrize("family", MLP_FORMS)
def test_partitions_cover_every_neuron_once_and_kmeans_groups_similar_neurons(family):
    dense = dense_mlp(_mlps(family)[0], family)
    rows = torch.nn.functional.normalize(
        dense.w_in if dense.w_up is None else torch.cat([dense.w_in, dense.w_up], dim=1), dim=1
    )

    def spread(groups):  # mean squared distance of a neuron to its group's centroid
        return sum(((rows[g] - rows[g].mean(0)) ** 2).sum() for g in groups) / D_HIDDEN

    for clustering in ("random", "balanced_kmeans"):
        groups = partition_neurons(dense, 4, clustering, seed=3)
        assert sorted(torch.cat(groups).tolist()) == list(range(D_HIDDEN))
        assert sorted(len(g) for g in groups) == [9, 9, 9, 10]
        assert all(torch.equal(a, b) for a, b in zip(groups, partition_neurons(dense, 4, clustering, seed=3)))
    random_spread = sum(spread(partition_neurons(dense, 4, "random", seed=s)) for s in range(5)) / 5
    assert spread(partition_neurons(dense, 4, "balanced_kmeans", seed=3)) < 0.95 * random_spread


@pytest.mark.parametrize("family", FAMILIES)
def test_copy_without_noise_is_exact_but_every_token_ties_onto_the_same_experts(family):
    mlp = _mlps(family)[0]
    x = _x(200)
    layer = moe_x_from_dense(mlp, "copy", 8, family=family, noise_std=0.0)
    assert layer.spec.d_expert == D_HIDDEN and layer.spec.k == 2
    with torch.no_grad():
        torch.testing.assert_close(layer(x), mlp(x), rtol=1e-12, atol=1e-12)
        used = layer.route(x).top_k_index.unique()
    assert len(used) == 2  # identical experts: TopK's tie-breaking picks the same two for every token


@pytest.mark.parametrize("family", FAMILIES)
def test_copy_with_noise_spreads_tokens_and_stays_close(family):
    mlp = _mlps(family)[0]
    x = _x(200)
    layer = moe_x_from_dense(mlp, "copy", 8, family=family)  # default noise 1% of std(W_in)
    with torch.no_grad():
        used = layer.route(x).top_k_index.unique()
        y, ref = layer(x), mlp(x)
    assert len(used) > 2 and len(used) >= 6
    assert (y - ref).norm() / ref.norm() < 0.05
    assert not torch.equal(layer.W_enc[0], layer.W_enc[1])
    torch.testing.assert_close(layer.W_dec[0], layer.W_dec[1])  # noise goes to the encoders only


def test_activation_switch_is_explicit():
    mlp = _mlps("gpt2")[0]
    spec = moe_x_spec_for_mlp(mlp, "copy", 4, family="gpt2", activation="relu")
    with pytest.raises(ValueError, match=r"moe_x.activation='relu' differs from the dense MLP's 'gelu_new'"):
        init_moe_from_dense(MoeXLayer(spec).double(), mlp, "copy", family="gpt2")
    layer = init_moe_from_dense(MoeXLayer(spec).double(), mlp, "copy", family="gpt2", noise_std=0.0,
                                allow_activation_change=True)
    relu = moe_x_from_dense(mlp, "copy", 4, family="gpt2", activation="relu", noise_std=0.0)
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), relu(x))
        assert not torch.allclose(relu(x), mlp(x), atol=1e-3)
    torch.testing.assert_close(relu.W_enc[2], dense_mlp(mlp, "gpt2").w_in)


def test_llama_relu_switch_keeps_the_glu_form():
    dense = dense_mlp(_mlps("llama")[0], "llama")
    layer = moe_x_from_dense(dense, "split", 4, activation="relu")
    assert layer.spec.expert_glu and layer.spec.activation == "relu"
    x = _x()
    relufied = (torch.relu(x @ dense.w_in.T) * (x @ dense.w_up.T)) @ dense.w_out.T  # ReLU-fied gated MLP
    with torch.no_grad():
        torch.testing.assert_close(layer(x), relufied, rtol=1e-12, atol=1e-12)


def test_spec_for_mlp_from_module_and_shape():
    gpt2 = moe_x_spec_for_mlp(_mlps("gpt2")[0], "copy", 8, family="gpt2")
    fields = (gpt2.d_expert, gpt2.k, gpt2.expert_bias, gpt2.expert_glu, gpt2.activation)
    assert fields == (37, 2, True, False, "gelu_new")
    shape = MlpShape(d_model=64, d_hidden=256, activation="silu", glu=True)
    llama = moe_x_spec_for_mlp(shape, "split", 8, router="switch")
    assert (llama.d_expert, llama.k, llama.gate_scaling, llama.expert_bias, llama.expert_glu, llama.router) == (
        32, 8, "none", False, True, "switch"
    )
    gpt2_shape = moe_x_spec_for_mlp(MlpShape(64, 256, "gelu_pytorch_tanh", glu=False), "split", 8, k=2)
    assert gpt2_shape.expert_bias and gpt2_shape.activation == "gelu_new" and gpt2_shape.k == 2


@pytest.mark.parametrize(
    "method, fields, message",
    [
        ("copy", dict(d_expert=20), r"d_expert=20 but copy of a 37-wide MLP into 4 experts needs d_expert=37"),
        ("copy", dict(gate_scaling="none"), r"copy-upcycling needs gates that sum to 1"),
        ("split", dict(gate_scaling="softmax"), r"split-upcycling with gate_scaling='softmax'"),
        ("split", dict(expert_bias=False), r"the MLP has encoder biases but expert_bias=false"),
        ("split", dict(expert_glu=True), r"expert_glu=True but the MLP is not gated"),
    ],
)
def test_misfit_layers_are_rejected(method, fields, message):
    dense = dense_mlp(_mlps("gpt2")[0], "gpt2")
    spec = moe_x_spec_for_mlp(dense, method, 4, **fields)
    with pytest.raises(ValueError, match=message):
        init_moe_from_dense(MoeXLayer(spec).double(), dense, method)


def test_bad_arguments():
    dense = dense_mlp(_mlps("gpt2")[0], "gpt2")
    with pytest.raises(ValueError, match=r"method must be one of \['split', 'copy'\], got 'clone'"):
        moe_x_from_dense(dense, "clone")
    with pytest.raises(ValueError, match=r"clustering must be one of \['random', 'balanced_kmeans'\]"):
        moe_x_from_dense(dense, "split", 4, clustering="spectral")
    with pytest.raises(ValueError, match=r"cannot split 37 hidden neurons into 40 experts"):
        moe_x_from_dense(dense, "split", 40)
    with pytest.raises(ValueError, match=r"noise_std must be >= 0"):
        moe_x_from_dense(dense, "copy", 4, noise_std=-1.0)


def test_the_mlp_is_read_by_its_family_row_not_guessed_from_its_children():
    """dense_mlp reads the layout of the family it is told (families.py's row), so an MLP that does not have that
    layout is refused by name, and none is guessed: before, the first family layout whose child names the module had
    was taken, so a fused gate_up_proj MLP (Phi-3), which no row could express, was refused only for lacking the
    names, and an MLP with another layout's names would have been read with it."""
    llama, phi3 = _mlps("llama")[0], _mlps("phi3")[0]
    with pytest.raises(ValueError, match=r"cannot read the dense MLP LlamaMLP as a phi3 MLP: it has no gate_up_proj, "
                       r"activation_fn \(its children: gate_proj, up_proj, down_proj, act_fn\)"):
        dense_mlp(llama, "phi3")
    with pytest.raises(ValueError, match=r"cannot read the dense MLP Phi3MLP as a gpt2 MLP: it has no c_fc, c_proj"):
        layer_from_dense("moe_x", phi3, "split", 4, family="gpt2")
    with pytest.raises(ValueError, match=r"reading the dense MLP Linear needs its family: pass "
                       r"family=model.config.model_type"):
        dense_mlp(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"unsupported architecture 'opt'"):
        dense_mlp(llama, "opt")
    # The fused projection's output is [gate | up] (Phi3MLP chunks it so): the gate half is the one under φ.
    dense, fused = dense_mlp(phi3, "phi3"), phi3.gate_up_proj.weight
    assert torch.equal(dense.w_in, fused[:D_HIDDEN]) and torch.equal(dense.w_up, fused[D_HIDDEN:])


def test_a_fused_layout_names_both_halves():
    MlpLayout("gate_up_proj", "down_proj", activation="activation_fn", fused_halves=("up", "gate"))  # either order
    for halves, w_up in ((("gate", "gate"), None), (("gate", "up"), "up_proj")):
        with pytest.raises(ValueError, match=r"fused_halves must order 'gate' and 'up'"):
            MlpLayout("gate_up_proj", "down_proj", w_up=w_up, fused_halves=halves)


def test_a_kind_without_dense_init_modes_is_refused():
    """dense_init asks the kind (its spec's init_modes), so a kind that cannot hold a dense MLP is refused by name."""
    mlp = dense_mlp(_mlps("gpt2")[0], "gpt2")
    layer = build_sparse_layer(TranscoderSpec(d_in=D_MODEL, d_out=D_MODEL, num_latents=64, k=4)).double()
    expected = r"transcoder layers cannot start from a dense MLP .*; kinds that can: moe_x"
    with pytest.raises(ValueError, match=expected):
        init_from_dense(layer, mlp, "split")
    with pytest.raises(ValueError, match=expected):
        spec_for_dense("transcoder", mlp, "copy")
    with pytest.raises(ValueError, match=r"unknown sparse layer kind 'mox'"):
        spec_for_dense("mox", mlp, "copy")
