"""The Hub bundle: config, model and sparse layer classes that travel with every saved expertize model."""

from .configuration_expertize import (
    ExpertizeGemma2Config,
    ExpertizeGemma3TextConfig,
    ExpertizeGPT2Config,
    ExpertizeGPTNeoXConfig,
    ExpertizeLlamaConfig,
    ExpertizeMistralConfig,
    ExpertizeOlmo2Config,
    ExpertizePhi3Config,
    ExpertizeQwen2Config,
    ExpertizeQwen3Config,
    ExpertizeStableLmConfig,
    MlpShape,
)
from .modeling_expertize import FAMILIES, ExpertizeModelMixin, Family, register_auto_classes
from .moe_x import MoeXLayer, MoeXRouting, MoeXSpec
from .monet import (
    MonetHDLayer,
    MonetHDSpec,
    MonetLayer,
    MonetRouting,
    MonetSpec,
    MonetVDLayer,
    MonetVDSpec,
)
from .jumprelu_transcoders import (
    CltLayer,
    CltSpec,
    CrossLayerError,
    JumpReluTranscoderLayer,
    JumpReluTranscoderSpec,
    link_cross_layer,
)
from .mumoe import MuMoECPSpec, MuMoELayer, MuMoESpec, MuMoETRSpec, entmax15
from .mxd import MxdLayer, MxdSpec
from .routed_neurons import RoutedNeuronsLayer, RoutedNeuronsSpec
from .sparse_base import Coder, SparseLayer
from .sparse_code import SparseCode
from .sparse_layers import LAYER_KINDS, build_sparse_layer, spec_from_dict
from .sparse_spec import SparseSpec
from .transcoder import SkipTranscoderSpec, TranscoderLayer, TranscoderSpec

register_auto_classes()

__all__ = [
    "CltLayer",
    "CltSpec",
    "Coder",
    "CrossLayerError",
    "FAMILIES",
    "LAYER_KINDS",
    "ExpertizeGPT2Config",
    "ExpertizeGemma2Config",
    "ExpertizeGemma3TextConfig",
    "ExpertizeGPTNeoXConfig",
    "ExpertizeLlamaConfig",
    "ExpertizeMistralConfig",
    "ExpertizeModelMixin",
    "ExpertizeOlmo2Config",
    "ExpertizePhi3Config",
    "ExpertizeQwen2Config",
    "ExpertizeQwen3Config",
    "ExpertizeStableLmConfig",
    "Family",
    "MlpShape",
    "JumpReluTranscoderLayer",
    "JumpReluTranscoderSpec",
    "MoeXLayer",
    "MoeXRouting",
    "MoeXSpec",
    "MonetHDLayer",
    "MonetHDSpec",
    "MonetLayer",
    "MonetRouting",
    "MonetSpec",
    "MonetVDLayer",
    "MonetVDSpec",
    "MuMoECPSpec",
    "MuMoELayer",
    "MuMoESpec",
    "MuMoETRSpec",
    "MxdLayer",
    "MxdSpec",
    "RoutedNeuronsLayer",
    "RoutedNeuronsSpec",
    "SkipTranscoderSpec",
    "SparseCode",
    "SparseLayer",
    "SparseSpec",
    "TranscoderLayer",
    "TranscoderSpec",
    "build_sparse_layer",
    "link_cross_layer",
    "entmax15",
    "spec_from_dict",
]
