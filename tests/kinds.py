"""One row per sparse layer kind: the table that drives the contract battery (tests/test_kind_contract.py) and every
other test that must cover each kind. A new kind adds one row here (tests/test_kind_contract.py fails until it has
one); its own math stays in its own tests/test_<kind>.py.

A row holds what only a person can choose: a tiny spec, sized for transformers' tiny testers (d_model 32, MLP width
37), a second configuration of the same kind (its other forms and options) that the battery builds beside it, and
the kind's own spec errors (what every kind refuses, e.g. an unknown field, the battery checks by itself).
What the kind can do (AuxK, resampling, a router, a top-K code) is read from its layer class, never written here, so
the table cannot drift from the code.
"""

import dataclasses
from typing import Any

import torch

from expertize.modeling import LAYER_KINDS

D_MODEL, D_HIDDEN = 32, 37


@dataclasses.dataclass(frozen=True)
class KindRow:
    kind: str
    fields: dict[str, Any]
    """Spec fields beyond d_in / d_out and the MLP-derived ones (`tiny_spec` adds those). Non-zero decoders where a
    kind offers them, so that the layer's output is not a constant in tests."""
    variant: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Overrides of `fields` for the kind's other configuration (another form, router or optional parameters): the
    battery checks both, and builds models with the variant at layer 0 and the tiny spec at layer 1."""
    errors: tuple[tuple[dict[str, Any], str], ...] = ()
    """(overrides of `fields`, the message the spec must refuse them with, a regex) for the kind's own rules."""

    @property
    def spec_class(self):
        return LAYER_KINDS[self.kind][0]

    @property
    def layer_class(self):
        return LAYER_KINDS[self.kind][1]

    # -- capabilities, as the layer class declares them (modeling/sparse_base.py) -----------------------------------

    @property
    def has_auxk(self) -> bool:
        """The kind implements `auxk_reconstruction` (conversion/training/auxk.py's `supports_auxk`)."""
        return bool(getattr(self.layer_class, "supports_auxk", False))

    @property
    def supports_resampling(self) -> bool:
        return bool(self.layer_class.supports_resampling)

    @property
    def has_router(self) -> bool:
        return self.layer_class.router_distribution is not None

    @property
    def selects_top_k(self) -> bool:
        return bool(self.layer_class.selects_top_k_units)

    def has_field(self, name: str) -> bool:
        return name in {f.name for f in dataclasses.fields(self.spec_class)}


ROWS: dict[str, KindRow] = {
    row.kind: row
    for row in [
        KindRow("mxd", dict(num_experts=16, k=4),
                dict(encoder="glu", activation="silu", encoder_bias=False, selection_bias=True),
                errors=((dict(k=2.5), r"mxd.k must be an integer"),
                        (dict(encoder="moe"), r"mxd.encoder must be one of"))),
        KindRow("transcoder", dict(num_latents=64, k=4), dict(selection_bias=True)),
        KindRow("skip_transcoder", dict(num_latents=64, k=4), dict(selection_bias=True)),
        # A lone CLT layer here (sources unset: it reads only its own latents); tests/test_clt.py places layers
        # across a model and checks what they read from each other.
        KindRow("clt", dict(num_latents=64, k=4), dict(sparsity_coef=0.5, bandwidth=0.25),
                errors=((dict(skip_connection=True), r"clt.skip_connection must be false"),
                        (dict(sources=[1, 0]), r"clt.sources must be a non-empty ascending list"))),
        KindRow("jumprelu_transcoder", dict(num_latents=64, k=4), dict(skip_connection=True, sparsity_coef=0.5),
                errors=((dict(k=65), r"jumprelu_transcoder.k=65 exceeds jumprelu_transcoder.num_latents=64"),
                        (dict(bandwidth=0), r"jumprelu_transcoder.bandwidth must be a positive number, got 0"))),
        KindRow("moe_x", dict(d_expert=8, num_experts=8, k=2, decoder_init="paper"),
                dict(router="switch", expert_glu=True, expert_bias=True, activation="gelu_new", selection_bias=True),
                errors=(
                    (dict(k=9), r"moe_x.k=9 exceeds moe_x.num_experts=8"),
                    (dict(router="linear"), r"moe_x.router must be one of \['sparsity', 'switch'\], got 'linear'"),
                    (dict(sigma_mode="sigma"), r"moe_x.sigma_mode must be one of"),
                    (dict(gate_scaling="sigmoid"), r"moe_x.gate_scaling must be one of"),
                    (dict(load_balance_counting="all"), r"moe_x.load_balance_counting must be one of"),
                    (dict(load_balance_coef=-0.1), r"moe_x.load_balance_coef must be a finite number >= 0, got -0.1"),
                    (dict(load_balance_coef=True), r"moe_x.load_balance_coef must be a finite number"),
                    (dict(d_expert=0), r"moe_x.d_expert must be >= 1, got 0"),
                    (dict(expert_bias="yes"), r"moe_x.expert_bias must be true or false"),
                    (dict(bias_aware_router=True, expert_bias=False), r"bias_aware_router=true needs expert_bias"),
                    (dict(router="switch", sigma_mode="var_literal"), r"only apply to router='sparsity'"),
                )),
        KindRow("monet_hd", dict(d_hidden=32, num_experts=16, k=2, num_heads=2), dict(routing="topk"), errors=(
            (dict(num_experts=20),
             r"monet_hd.num_experts must be a perfect square.*got 20; the nearest are 16 and 25"),
            (dict(num_experts=1), r"monet_hd.num_experts must be >= 4"),
            (dict(k=5), r"monet_hd.k=5 exceeds √num_experts=4"),
            (dict(d_hidden=37), r"monet_hd.d_hidden=37 must be a multiple of 4.*use 36 or 40"),
            (dict(routing="sorted"), r"monet_hd.routing must be one of \['quantile', 'topk'\]"),
            (dict(ambiguity_coef=-1.0), r"monet_hd.ambiguity_coef must be >= 0"),
            (dict(uniformity_coef="high"), r"monet_hd.uniformity_coef must be a finite number"),
            (dict(bn_momentum=0), r"monet_hd.bn_momentum must lie in \(0, 1\]"),
            (dict(num_heads=0), r"monet_hd.num_heads must be >= 1"),
        )),
        KindRow("monet_vd", dict(d_hidden=32, num_experts=16, k=2, num_heads=2), dict(routing="topk"), errors=(
            (dict(d_hidden=12), r"monet_vd.d_hidden=12 must be a multiple of 8.*halves; use 8 or 16"),
            (dict(d_out=7), r"monet_vd.d_out must be even"),
        )),
        KindRow("mumoe_cp", dict(num_experts=8, rank=16, decoder_init="paper"),
                dict(form="block", encoder="glu", activation="silu"), errors=(
            (dict(gate_norm="batchnorm"), r"mumoe_cp.gate_norm='batchnorm' is not supported: BatchNorm makes the"),
            (dict(gate_norm="rms"), r"mumoe_cp.gate_norm must be one of \['layernorm', 'none'\]"),
            (dict(form="sandwich"), r"mumoe_cp.form must be one of \['block', 'encoder'\]"),
            (dict(rank=0), r"mumoe_cp.rank must be >= 1, got 0"),
            (dict(rank=2.5), r"mumoe_cp.rank must be an integer"),
            (dict(gate_activation="sparsemax"), r"mumoe_cp.gate_activation must be one of"),
            (dict(expert_init_std=-1.0), r"mumoe_cp.expert_init_std must be a finite number >= 0"),
            (dict(encoder_bias="yes"), r"mumoe_cp.encoder_bias must be true or false"),
            (dict(k=4), r"unknown field\(s\) \['k'\] for sparse layer kind 'mumoe_cp'"),
            (dict(rank_1=4), r"unknown field\(s\) \['rank_1'\] for sparse layer kind 'mumoe_cp'"),
            (dict(decoder_init="xavier"), r"mumoe_cp.decoder_init must be one of \['paper', 'zeros'\]"),
        )),
        KindRow("mumoe_tr", dict(num_experts=8, rank=8, rank_1=2, rank_2=2, decoder_init="paper"),
                dict(form="block", expert_bias=False),
                errors=((dict(rank_2=0), r"mumoe_tr.rank_2 must be >= 1, got 0"),)),
        KindRow("routed_neurons", dict(num_experts=48, k=4, num_shared=4, router_rank=8, decoder_init="paper"),
                dict(num_shared=0, router_rank=0), errors=(
            (dict(num_shared=-1), r"routed_neurons.num_shared must be >= 0, got -1"),
            (dict(router_rank=-2), r"routed_neurons.router_rank must be >= 0, got -2"),
            (dict(router_rank=2.5), r"routed_neurons.router_rank must be an integer"),
            (dict(decoder_init="normal"), r"routed_neurons.decoder_init must be one of \['paper', 'zeros'\]"),
        )),
    ]
}

KINDS = sorted(ROWS)
TINY_FIELDS: dict[str, dict[str, Any]] = {kind: row.fields for kind, row in ROWS.items()}
AUXK_KINDS = [kind for kind in KINDS if ROWS[kind].has_auxk]


def tiny_spec(kind: str, d_model: int = D_MODEL, d_hidden: int = D_HIDDEN, activation: str = "gelu",
              glu: bool = False, variant: bool = False, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON spec dict of a tiny `kind` layer for an MLP of the given shape: its row's fields (`variant`: with its
    row's variant overrides), or `fields` for a kind without a row (the toy kind of tests/toy_kind.py)."""
    from expertize.modeling import MlpShape
    from expertize.modeling.sparse_base import canonical_activation

    spec_class = LAYER_KINDS[kind][0]
    defaults = spec_class.mlp_defaults(MlpShape(d_model, d_hidden, activation, glu))
    if "activation" in defaults:
        defaults["activation"] = canonical_activation(defaults["activation"])
    if fields is None:
        row = ROWS[kind]
        fields = {**row.fields, **row.variant} if variant else row.fields
    return spec_class(d_in=d_model, d_out=d_model, **{**defaults, **fields}).to_dict()


# -- helpers every kind's tests share ---------------------------------------------------------------------------------


def randomized(layer: torch.nn.Module, seed: int = 0, dtype: torch.dtype = torch.float64,
               std: float = 1.0) -> torch.nn.Module:
    """`layer` in `dtype` with every parameter drawn from a seeded N(0, std²): a fresh layer's zero decoders and
    biases would make the output a constant and hide bugs."""
    gen = torch.Generator().manual_seed(seed)
    layer.to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
    return layer


def outputs_and_grads(layer: torch.nn.Module, fn, x: torch.Tensor):
    """(output, d/dx, {parameter: gradient}) of a fixed linear functional of `fn(x)`."""
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = fn(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def assert_same_with_grads(layer: torch.nn.Module, fast, slow, x: torch.Tensor, rtol: float = 1e-10,
                           atol: float = 1e-10, grad_rtol: float | None = None) -> None:
    """`fast(x)` equals the reference `slow(x)`: outputs, input gradients and every parameter's gradient (float64)."""
    out_f, gx_f, gp_f = outputs_and_grads(layer, fast, x)
    out_s, gx_s, gp_s = outputs_and_grads(layer, slow, x)
    torch.testing.assert_close(out_f, out_s, rtol=rtol, atol=atol)
    torch.testing.assert_close(gx_f, gx_s, rtol=rtol, atol=atol)
    assert gp_f.keys() == gp_s.keys()
    for name in gp_f:
        torch.testing.assert_close(gp_f[name], gp_s[name], rtol=grad_rtol or rtol, atol=atol, msg=f"grad of {name}")


def check_spec(spec) -> None:
    """A spec survives its JSON form unchanged, counts its layer's parameters exactly, and touches some of them per
    token at a positive cost (the battery's round trip, shared with the per-kind files' own configurations)."""
    import json

    from expertize.modeling import build_sparse_layer, spec_from_dict

    assert spec_from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.num_parameters() == sum(p.numel() for p in build_sparse_layer(spec).parameters())
    assert 0 < spec.active_parameters() <= spec.num_parameters() and spec.flops_per_token() > 0
