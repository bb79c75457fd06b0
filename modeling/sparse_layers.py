"""Registry of sparse layer kinds: spec class + layer class, looked up by the `kind` string stored in configs."""

from typing import Any

from .jumprelu_transcoders import CltLayer, CltSpec, JumpReluTranscoderLayer, JumpReluTranscoderSpec
from .moe_x import MoeXLayer, MoeXSpec
from .monet import MonetHDLayer, MonetHDSpec, MonetVDLayer, MonetVDSpec
from .mumoe import MuMoECPSpec, MuMoELayer, MuMoETRSpec
from .mxd import MxdLayer, MxdSpec
from .routed_neurons import RoutedNeuronsLayer, RoutedNeuronsSpec
from .sparse_base import SparseLayer
from .sparse_spec import SparseSpec
from .transcoder import SkipTranscoderSpec, TranscoderLayer, TranscoderSpec

LAYER_KINDS: dict[str, tuple[type[SparseSpec], type[SparseLayer]]] = {
    "mxd": (MxdSpec, MxdLayer),
    "moe_x": (MoeXSpec, MoeXLayer),
    "monet_hd": (MonetHDSpec, MonetHDLayer),
    "monet_vd": (MonetVDSpec, MonetVDLayer),
    "mumoe_cp": (MuMoECPSpec, MuMoELayer),
    "mumoe_tr": (MuMoETRSpec, MuMoELayer),
    "routed_neurons": (RoutedNeuronsSpec, RoutedNeuronsLayer),
    "transcoder": (TranscoderSpec, TranscoderLayer),
    "skip_transcoder": (SkipTranscoderSpec, TranscoderLayer),
    "jumprelu_transcoder": (JumpReluTranscoderSpec, JumpReluTranscoderLayer),
    "clt": (CltSpec, CltLayer),
}

DEFAULT_KIND = "mxd"
"""The kind a recipe's `layer.kind` defaults to (the registry names kinds, so the default lives here too)."""


def spec_from_dict(data: dict[str, Any] | SparseSpec) -> SparseSpec:
    """Build and validate a spec from its JSON dict (`{"kind": "mxd", ...}`); specs pass through unchanged."""
    if isinstance(data, SparseSpec):
        return data
    if callable(getattr(data, "to_dict", None)):
        # A spec from another copy of these files (transformers may execute the remote-code modules more than
        # once, so class identity is not reliable): rebuild it from its JSON form.
        data = data.to_dict()
    if not isinstance(data, dict):
        raise ValueError(f"a sparse layer spec must be a dict with a 'kind' key, got {type(data).__name__}: {data!r}")
    kind = data.get("kind")
    if kind not in LAYER_KINDS:
        raise ValueError(f"unknown sparse layer kind {kind!r}; known kinds: {sorted(LAYER_KINDS)}")
    return LAYER_KINDS[kind][0].from_dict(data)


def build_sparse_layer(spec: dict[str, Any] | SparseSpec) -> SparseLayer:
    spec = spec_from_dict(spec)
    return LAYER_KINDS[spec.kind][1](spec)
