"""Resolution of a recipe against the base model: its layer indices, and the validated sparse layer spec of each MLP.

    layer: section + MlpShape of the base MLP ─► spec fields ─► parameter matching (match_transcoder)
                                               ─► the kind's SparseSpec, validated

Field values come, by priority: layer.options > explicit recipe fields (k, d_hidden, encoder, activation, unit
count) > the kind's `mlp_defaults(shape)` (the "auto" values derived from the dense MLP). Everything kind-specific
is read from the spec class; nothing here names a kind.
"""

import re
from typing import Any

from expertize.modeling.configuration_expertize import MlpShape
from expertize.modeling.sparse_base import canonical_activation
from expertize.modeling.sparse_spec import SparseSpec
from expertize.modeling.transcoder import TranscoderSpec

from .coerce import RecipeError
from .param_match import match_parameter_count
from .layer_config import LayerConfig, has_selection_bias, spec_class, spec_field_names
from .schema import Recipe

__all__ = ["resolve_layer_spec", "resolve_layers"]


def resolve_layers(recipe: Recipe, num_layers: int) -> list[int]:
    """The recipe's layer indices (sorted), checked against a base model with `num_layers` decoder layers."""
    if recipe.layers == "all":
        return list(range(num_layers))
    for index in recipe.layers:
        if index >= num_layers:
            raise RecipeError(
                f"layers: index {index} is out of range; {recipe.base_model} has {num_layers} layers (valid indices "
                f"0..{num_layers - 1})"
            )
    return sorted(recipe.layers)


def resolve_layer_spec(layer: LayerConfig, shape: MlpShape, balance: str = "none") -> SparseSpec:
    """Build the validated sparse layer spec for one MLP of shape `shape` from the recipe's `layer:` section.

    `balance` is the recipe's `train.balance`: "bias" gives the kinds that choose a top K a selection bias
    (`selection_bias: true`, the buffer the balancer moves); other kinds are built as they are."""
    spec_cls = spec_class(layer.kind)
    spec_fields = spec_field_names(layer.kind)
    units, match_field = spec_cls.units_field, spec_cls.size_field()  # units_field: one of UNITS_FIELDS

    fields: dict[str, Any] = {"kind": layer.kind, "d_in": shape.d_model, "d_out": shape.d_model}
    fields.update(spec_cls.mlp_defaults(shape, init=layer.init, num_units=getattr(layer, units)))
    if "activation" in fields and layer.activation == "auto":
        fields["activation"] = _auto_activation(fields["activation"])
    # Explicit recipe fields; null / "auto" leave the value derived from the MLP or the spec's default.
    explicit = {
        "k": layer.k,
        "d_hidden": layer.d_hidden,
        "encoder": None if layer.encoder == "auto" else layer.encoder,
        "activation": None if layer.activation == "auto" else layer.activation,
        units: getattr(layer, units),
    }
    fields.update({name: value for name, value in explicit.items() if name in spec_fields and value is not None})
    if balance != "none" and has_selection_bias(layer.kind):
        fields["selection_bias"] = True
    fields.update(layer.options)

    derived = ""
    if layer.match_transcoder is not None:
        latents = round(layer.match_transcoder * shape.d_model)
        fields[match_field], derived = _match(spec_cls, fields, match_field, latents, layer)
    try:
        return spec_cls.from_dict(fields)
    except (ValueError, TypeError) as e:
        # The spec names its fields `<kind>.<name>`; name the recipe keys instead.
        message = re.sub(
            rf"\b{re.escape(layer.kind)}\.(\w+)",
            lambda m: f"layer.options.{m[1]}" if m[1] in layer.options else f"layer.{m[1]}",
            str(e),
        )
        raise RecipeError(f"layer: {message}{derived}") from None


def _match(spec_cls: type[SparseSpec], fields: dict, field: str, latents: int, layer: LayerConfig) -> tuple[int, str]:
    """(value of `field` matching a transcoder of `latents` latents, the explanation appended to errors)."""
    spec_kwargs = {name: value for name, value in fields.items() if name != "kind"}
    try:
        value = spec_cls.matched_size(spec_kwargs, latents, layer.match_convention)
        if value is not None:
            return value, (f" ({field}={value} was matched to a {layer.match_transcoder}x transcoder by "
                           f"layer.match_transcoder, convention {layer.match_convention!r})")
        target = TranscoderSpec(d_in=fields["d_in"], d_out=fields["d_out"], num_latents=latents, k=1).num_parameters()
        value = match_parameter_count(spec_cls, spec_kwargs, field, target)
    except ValueError as e:
        raise RecipeError(f"layer.match_transcoder={layer.match_transcoder}: {e}") from None
    return value, (f" ({field}={value} is the largest value within a {layer.match_transcoder}x transcoder's "
                   f"{target:,} parameters)")


def _auto_activation(activation: str) -> str:
    """The base MLP's activation (layer.activation: auto) in the sparse layers' spelling."""
    try:
        return canonical_activation(activation)
    except ValueError:
        raise RecipeError(
            f"layer.activation: 'auto' cannot use the base MLP's activation {activation!r}, which the sparse "
            "layers do not implement; set layer.activation to one of gelu, gelu_new, relu, silu"
        ) from None
