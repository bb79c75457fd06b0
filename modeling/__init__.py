"""The Hub bundle: config, model and sparse layer classes that travel with every saved expertize model."""

from .configuration_expertize import (
    ExpertizeGPT2Config,
    ExpertizeGPTNeoXConfig,
    ExpertizeLlamaConfig,
    ExpertizeMistralConfig,
    ExpertizeQwen2Config,
    MlpShape,
)
from .modeling_expertize import FAMILIES, ExpertizeModelMixin
from .mxd import MxdLayer, MxdSpec
from .sparse_base import SparseCode, SparseLayer, SparseSpec
from .sparse_layers import LAYER_KINDS, build_sparse_layer, spec_from_dict
from .transcoder import SkipTranscoderSpec, TranscoderLayer, TranscoderSpec

__all__ = [
    "FAMILIES",
    "LAYER_KINDS",
    "ExpertizeGPT2Config",
    "ExpertizeGPTNeoXConfig",
    "ExpertizeLlamaConfig",
    "ExpertizeMistralConfig",
    "ExpertizeModelMixin",
    "ExpertizeQwen2Config",
    "MlpShape",
    "MxdLayer",
    "MxdSpec",
    "SkipTranscoderSpec",
    "SparseCode",
    "SparseLayer",
    "SparseSpec",
    "TranscoderLayer",
    "TranscoderSpec",
    "build_sparse_layer",
    "spec_from_dict",
]
