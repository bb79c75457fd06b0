"""One row per sparse layer kind: a tiny spec builder for tests, sized for transformers' tiny testers (d_model 32,
MLP width 37). Tests that must cover every kind iterate over `KINDS`; a new kind adds one row here."""

from typing import Any

from expertize.modeling import LAYER_KINDS

D_MODEL, D_HIDDEN = 32, 37

# kind -> spec fields beyond d_in / d_out (the MLP-derived fields, e.g. d_hidden, encoder, come from `tiny_spec`).
# Non-zero decoders where a kind offers them, so that the layer's output is not a constant in tests.
TINY_FIELDS: dict[str, dict[str, Any]] = {
    "mxd": dict(num_experts=16, k=4),
    "transcoder": dict(num_latents=64, k=4),
    "skip_transcoder": dict(num_latents=64, k=4),
    "moe_x": dict(d_expert=8, num_experts=8, k=2, decoder_init="paper"),
    "monet_hd": dict(d_hidden=32, num_experts=16, k=2, num_heads=2),
    "monet_vd": dict(d_hidden=32, num_experts=16, k=2, num_heads=2),
    "mumoe_cp": dict(num_experts=8, rank=16, decoder_init="paper"),
    "mumoe_tr": dict(num_experts=8, rank=8, rank_1=2, rank_2=2, decoder_init="paper"),
    "routed_neurons": dict(num_experts=48, k=4, num_shared=4, router_rank=8, decoder_init="paper"),
}

KINDS = sorted(TINY_FIELDS)
assert set(KINDS) == set(LAYER_KINDS), f"tests/kinds.py lacks a row for {sorted(set(LAYER_KINDS) - set(KINDS))}"


def tiny_spec(kind: str, d_model: int = D_MODEL, d_hidden: int = D_HIDDEN, activation: str = "gelu",
              glu: bool = False) -> dict[str, Any]:
    """The JSON spec dict of a tiny `kind` layer for an MLP of the given shape."""
    from expertize.modeling import MlpShape
    from expertize.modeling.sparse_base import canonical_activation

    spec_class = LAYER_KINDS[kind][0]
    fields = spec_class.mlp_defaults(MlpShape(d_model, d_hidden, activation, glu))
    if "activation" in fields:
        fields["activation"] = canonical_activation(fields["activation"])
    fields.update(TINY_FIELDS[kind])
    return spec_class(d_in=d_model, d_out=d_model, **fields).to_dict()
