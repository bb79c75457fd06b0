"""Model classes: the native transformers models with `.mlp` of the configured decoder layers swapped for sparse
layers at construction. Every other parameter keeps its native name, so a base checkpoint's state dict fills
everything except the new layers.

Part of the Hub bundle (`save_pretrained` copies this file and its single-dot imports next to the weights).
"""

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    Gemma2ForCausalLM,
    Gemma2Model,
    Gemma3ForCausalLM,
    Gemma3TextModel,
    GPT2LMHeadModel,
    GPT2Model,
    GPTNeoXForCausalLM,
    GPTNeoXModel,
    LlamaForCausalLM,
    LlamaModel,
    MistralForCausalLM,
    MistralModel,
    Olmo2ForCausalLM,
    Olmo2Model,
    Phi3ForCausalLM,
    Phi3Model,
    PreTrainedModel,
    Qwen2ForCausalLM,
    Qwen2Model,
    Qwen3ForCausalLM,
    Qwen3Model,
    StableLmForCausalLM,
    StableLmModel,
)
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

# Every bundle file must be a *direct* relative import of both entry files: transformers before PR #46022 (all of 4.x)
# copies only the entry file's direct relative imports into the module cache when loading from a local folder.
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
)
from .jumprelu_transcoders import link_cross_layer
from .latent_coder import LatentCoderLayer  # noqa: F401
from .moe_x import MoeXLayer  # noqa: F401
from .monet import MonetLayer  # noqa: F401
from .mumoe import MuMoELayer  # noqa: F401
from .mxd import MxdLayer  # noqa: F401
from .routed_neurons import RoutedNeuronsLayer  # noqa: F401
from .sparse_base import SparseLayer
from .sparse_code import SparseCode  # noqa: F401
from .sparse_kernels import sparse_rows_sum  # noqa: F401
from .sparse_layers import build_sparse_layer
from .sparse_spec import SparseSpec  # noqa: F401
from .transcoder import TranscoderLayer  # noqa: F401


_INIT_KNOWS_CUSTOM_CODE = "is_custom_code" in inspect.signature(PreTrainedModel._initialize_weights).parameters
"""transformers 5 passes `is_custom_code` to `_initialize_weights`; 4.x's takes the module only."""


def _native_forward_signature(native_forward) -> inspect.Signature:
    """The native forward's signature plus the keyword `output_router_logits` (before `**kwargs`)."""
    signature = inspect.signature(native_forward)
    params = list(signature.parameters.values())
    if "output_router_logits" not in signature.parameters:
        extra = inspect.Parameter("output_router_logits", inspect.Parameter.KEYWORD_ONLY, default=None)
        at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
        params.insert(at, extra)
    return signature.replace(parameters=params)


def expose_native_forward(cls: type) -> type:
    """Give `cls` a forward whose signature is its native parent's (plus `output_router_logits`).

    transformers and its clients read the forward signature to decide what to pass: `generate()` builds
    `position_ids` from the attention mask only if the forward takes them (left-padded batches of absolute-position
    families otherwise decode at shifted positions), asks for `logits_to_keep`, builds a default attention mask and
    validates model kwargs; `Trainer` keeps only dataset columns the forward names; PEFT and the pipelines inspect
    it too. The mixins' `forward(*args, **kwargs)` would hide all of that, so each class gets a thin wrapper that
    carries the native signature and docstring and calls the mixin's forward.
    """
    native = next(base for base in cls.__mro__ if not issubclass(base, ExpertizeModelMixin) and "forward" in vars(base))
    mixin_forward = cls.forward

    @functools.wraps(native.forward)
    def forward(self, *args, **kwargs):
        return mixin_forward(self, *args, **kwargs)

    forward.__signature__ = _native_forward_signature(native.forward)
    forward.__doc__ = (native.forward.__doc__ or "") + (mixin_forward.__doc__ or "")
    cls.forward = forward
    return cls


def _register_output_capture(model: nn.Module) -> None:
    """Record `model`'s (re-classed) class in transformers' output-capture registry.

    transformers 5 keys `_can_record_outputs` by the instance's class name when a model is constructed; a base model
    re-classed after its `__init__` (`_adopt_base_model`) would otherwise find no entry, and `output_hidden_states` /
    `output_attentions` would silently return None in a process that never built that class directly.
    """
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # transformers 4.x: the forward itself collects hidden states and attentions
        return
    _CAN_RECORD_REGISTRY[model] = model._can_record_outputs


class ExpertizeModelMixin:
    """Shared by every family's base model and causal LM."""

    _blocks_path: str
    """Attribute path from the model to its `nn.ModuleList` of decoder blocks."""
    _auto_map: dict[str, str]
    """Written into config.json on save, so that all three Auto classes resolve to the copied files."""

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, SparseLayer):
            module.reset_parameters()  # uses torch.nn.init, which transformers guards against re-initializing loads
        else:
            super()._init_weights(module)

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        # transformers treats classes outside its package as custom code and then skips a module whose own
        # parameters are all flagged as initialized, in case its `_init_weights` writes tensors in place. That skip
        # also drops inits a parent module does for its children — GPT-2's 1/√(2·n_layer) c_proj scaling, done in
        # GPT2Attention / GPT2MLP — on the lazy (meta-device) path. Every init here goes through torch.nn.init or
        # transformers' init functions, which never overwrite loaded weights, so the native rule applies.
        if not _INIT_KNOWS_CUSTOM_CODE:  # transformers 4.x: no custom-code rule to undo
            return super()._initialize_weights(module)
        super()._initialize_weights(module, is_custom_code=False)

    def transformer_blocks(self) -> nn.ModuleList:
        """The decoder blocks (`model.transformer_blocks()[i].mlp` is decoder layer i's MLP, in every family).

        Not named `decoder_blocks`: TransformerLens's bridge forwards unknown attributes to the wrapped model and
        reads `decoder_blocks` (with `encoder_blocks`) as the mark of an encoder-decoder model."""
        return self.get_submodule(self._blocks_path)

    def sparse_layers(self) -> dict[int, SparseLayer]:
        """The sparse layers by decoder layer index (looking through adapter wrappers such as PEFT's)."""
        layers = {}
        for i, block in enumerate(self.transformer_blocks()):
            mlp = block.mlp
            if not isinstance(mlp, SparseLayer) and callable(getattr(mlp, "get_base_layer", None)):
                mlp = mlp.get_base_layer()
            if isinstance(mlp, SparseLayer):
                layers[i] = mlp
        return layers

    def save_pretrained(self, *args, **kwargs):
        self.config.auto_map = dict(self._auto_map)
        return super().save_pretrained(*args, **kwargs)

    def _wants_router_logits(self, output_router_logits: bool | None) -> bool:
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        return bool(output_router_logits)

    @contextlib.contextmanager
    def _recording_router_outputs(self) -> Iterator[list[SparseLayer]]:
        """Turn on the layers' router side channel for one forward; yields the layers in decoder order.

        Only the context that switched recording on clears the stashed tensors, after its caller has read them.
        """
        layers = list(self.sparse_layers().values())
        previous = [layer.record_router_outputs for layer in layers]
        for layer in layers:
            if not layer.record_router_outputs:
                layer.clear_router_outputs()
            layer.record_router_outputs = True
        try:
            yield layers
        finally:
            for layer, was_on in zip(layers, previous):
                layer.record_router_outputs = was_on
                if not was_on:
                    layer.clear_router_outputs()

    @staticmethod
    def _router_outputs(layers: list[SparseLayer]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """(router logits of the routed layers in decoder order, summed auxiliary loss or None)."""
        router_logits = tuple(layer.router_logits for layer in layers if layer.router_logits is not None)
        aux = [layer.aux_loss for layer in layers if layer.aux_loss is not None]
        aux_loss = torch.stack([a.float().to(aux[0].device) for a in aux]).sum() if aux else None
        return router_logits, aux_loss


class ExpertizeBaseModelMixin(ExpertizeModelMixin):
    _inside_causal_lm = False
    """Set on the base model of a causal LM: the causal LM's forward collects the router outputs, and the native
    causal-LM code expects the native output type from its base model."""

    def forward(self, *args, output_router_logits: bool | None = None, **kwargs):
        if self._inside_causal_lm or not self._wants_router_logits(output_router_logits):
            return super().forward(*args, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        with self._recording_router_outputs() as layers:
            out = super().forward(*args, return_dict=True, **kwargs)
            router_logits, _ = self._router_outputs(layers)
        result = MoeModelOutputWithPast(
            last_hidden_state=out.last_hidden_state,
            past_key_values=getattr(out, "past_key_values", None),
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            router_logits=router_logits,
        )
        return result.to_tuple() if return_dict is False else result

    def _install_sparse_layers(self) -> None:
        blocks = self.transformer_blocks()
        for index, spec in self.config.sparse_layer_specs().items():
            blocks[index].mlp = build_sparse_layer(spec)
        link_cross_layer({index: blocks[index].mlp for index in self.config.sparse_layer_specs()})
        # Initializes only modules not yet flagged as initialized, i.e. the new sparse layers; refreshes tied keys.
        self.post_init()


class ExpertizeCausalLMMixin(ExpertizeModelMixin):
    _base_class: type
    _base_attr: str

    def forward(self, *args, output_router_logits: bool | None = None, **kwargs):
        """The native forward; with `output_router_logits` (argument or config) a `MoeCausalLMOutputWithPast` whose
        `router_logits` holds one (T, E) tensor per routed sparse layer and whose `aux_loss` is the sum of the layers'
        weighted auxiliary losses, added to `loss` times `config.router_aux_loss_coef` (transformers' MoE convention).
        """
        if not self._wants_router_logits(output_router_logits):
            return super().forward(*args, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        with self._recording_router_outputs() as layers:
            out = super().forward(*args, return_dict=True, **kwargs)
            router_logits, aux_loss = self._router_outputs(layers)
        loss = out.loss
        if loss is not None and aux_loss is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        result = MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=out.logits,
            past_key_values=out.past_key_values,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            router_logits=router_logits,
        )
        return result.to_tuple() if return_dict is False else result

    def _adopt_base_model(self) -> None:
        # The native causal-LM __init__ built a native base model. Rebuilding it as ours would initialize the whole
        # network twice, so re-class it in place instead (our subclass adds methods, no state) and swap its MLPs.
        # Being an Expertize base model matters beyond this call: transformers initializes missing weights of a
        # nested PreTrainedModel with *its* `_init_weights`, which must know the sparse layers.
        base = getattr(self, self._base_attr)
        base.__class__ = self._base_class
        _register_output_capture(base)
        base._inside_causal_lm = True
        base._install_sparse_layers()
        self.post_init()


def _auto_map(config_cls: type, base_cls: type, causal_cls: type) -> dict[str, str]:
    return {
        "AutoConfig": f"configuration_expertize.{config_cls.__name__}",
        "AutoModel": f"modeling_expertize.{base_cls.__name__}",
        "AutoModelForCausalLM": f"modeling_expertize.{causal_cls.__name__}",
    }


# -- GPT-2 (`transformer.h[i].mlp`) ----------------------------------------------------------------------------------


class ExpertizeGPT2Model(ExpertizeBaseModelMixin, GPT2Model):
    config_class = ExpertizeGPT2Config
    _blocks_path = "h"

    def __init__(self, config: ExpertizeGPT2Config):
        super().__init__(config)
        self._install_sparse_layers()


class ExpertizeGPT2ForCausalLM(ExpertizeCausalLMMixin, GPT2LMHeadModel):
    config_class = ExpertizeGPT2Config
    _blocks_path = "transformer.h"
    _base_class, _base_attr = ExpertizeGPT2Model, "transformer"

    def __init__(self, config: ExpertizeGPT2Config):
        super().__init__(config)
        self._adopt_base_model()


# -- GPT-NeoX / Pythia (`gpt_neox.layers[i].mlp`; parallel residual) ------------------------------------------------


class ExpertizeGPTNeoXModel(ExpertizeBaseModelMixin, GPTNeoXModel):
    config_class = ExpertizeGPTNeoXConfig
    _blocks_path = "layers"

    def __init__(self, config: ExpertizeGPTNeoXConfig):
        super().__init__(config)
        self._install_sparse_layers()


class ExpertizeGPTNeoXForCausalLM(ExpertizeCausalLMMixin, GPTNeoXForCausalLM):
    config_class = ExpertizeGPTNeoXConfig
    _blocks_path = "gpt_neox.layers"
    _base_class, _base_attr = ExpertizeGPTNeoXModel, "gpt_neox"

    def __init__(self, config: ExpertizeGPTNeoXConfig):
        super().__init__(config)
        self._adopt_base_model()

    # Checkpoints name the LM head `lm_head`, its transformers-5 name (5.x renames `embed_out` only for the native
    # class: conversion_mapping skips custom code). transformers 4.x calls it `embed_out`; its loader and saver call
    # these two hooks on the instance (5.x calls neither), so rename there when the head is `embed_out`.
    def _fix_state_dict_key_on_load(self, key: str) -> tuple[str, bool]:
        if key.startswith("lm_head.") and "embed_out" in self._modules:
            return "embed_out." + key[len("lm_head.") :], True
        return super()._fix_state_dict_key_on_load(key)

    def _fix_state_dict_key_on_save(self, key: str) -> tuple[str, bool]:
        if key.startswith("embed_out.") and "embed_out" in self._modules:
            return "lm_head." + key[len("embed_out.") :], True
        return super()._fix_state_dict_key_on_save(key)


# -- Llama and Llama-like families (`model.layers[i].mlp`; gated SiLU MLP) -------------------------------------------


class ExpertizeLlamaModel(ExpertizeBaseModelMixin, LlamaModel):
    config_class = ExpertizeLlamaConfig
    _blocks_path = "layers"

    def __init__(self, config: ExpertizeLlamaConfig):
        super().__init__(config)
        self._install_sparse_layers()


class ExpertizeLlamaForCausalLM(ExpertizeCausalLMMixin, LlamaForCausalLM):
    config_class = ExpertizeLlamaConfig
    _blocks_path = "model.layers"
    _base_class, _base_attr = ExpertizeLlamaModel, "model"

    def __init__(self, config: ExpertizeLlamaConfig):
        super().__init__(config)
        self._adopt_base_model()


class ExpertizeMistralModel(ExpertizeBaseModelMixin, MistralModel):
    config_class = ExpertizeMistralConfig
    _blocks_path = "layers"

    def __init__(self, config: ExpertizeMistralConfig):
        super().__init__(config)
        self._install_sparse_layers()


class ExpertizeMistralForCausalLM(ExpertizeCausalLMMixin, MistralForCausalLM):
    config_class = ExpertizeMistralConfig
    _blocks_path = "model.layers"
    _base_class, _base_attr = ExpertizeMistralModel, "model"

    def __init__(self, config: ExpertizeMistralConfig):
        super().__init__(config)
        self._adopt_base_model()


class ExpertizeQwen2Model(ExpertizeBaseModelMixin, Qwen2Model):
    config_class = ExpertizeQwen2Config
    _blocks_path = "layers"

    def __init__(self, config: ExpertizeQwen2Config):
        super().__init__(config)
        self._install_sparse_layers()


class ExpertizeQwen2ForCausalLM(ExpertizeCausalLMMixin, Qwen2ForCausalLM):
    config_class = ExpertizeQwen2Config
    _blocks_path = "model.layers"
    _base_class, _base_attr = ExpertizeQwen2Model, "model"

    def __init__(self, config: ExpertizeQwen2Config):
        super().__init__(config)
        self._adopt_base_model()


class ExpertizeQwen3Model(ExpertizeBaseModelMixin, Qwen3Model):
    config_class = ExpertizeQwen3Config
    _blocks_path = "layers"

    def __init__(self, config: ExpertizeQwen3Config):
        super().__init__(config)
        self._install_sparse_layers()


class ExpertizeQwen3ForCausalLM(ExpertizeCausalLMMixin, Qwen3ForCausalLM):
    config_class = ExpertizeQwen3Config
    _blocks_path = "model.layers"
    _base_class, _base_attr = ExpertizeQwen3Model, "model"

    def __init__(self, config: ExpertizeQwen3Config):
        super().__init__(config)
        self._adopt_base_model()


# -- OLMo-2 (`model.layers[i].mlp`; no norm before the MLP, `post_feedforward_layernorm` after it) -------------------


class ExpertizeOlmo2Model(ExpertizeBaseModelMixin, Olmo2Model):
    config_class = ExpertizeOlmo2Config
    _blocks_path = "layers"

    def __init__(self, config: ExpertizeOlmo2Config):
        super().__init__(config)
        self._install_sparse_layers()


class ExpertizeOlmo2ForCausalLM(ExpertizeCausalLMMixin, Olmo2ForCausalLM):
    config_class = ExpertizeOlmo2Config
    _blocks_path = "model.layers"
    _base_class, _base_attr = ExpertizeOlmo2Model, "model"

    def __init__(self, config: ExpertizeOlmo2Config):
        super().__init__(config)
        self._adopt_base_model()


# -- Phi-3 (Llama's block; fused qkv_proj and gate_up_proj inside the attention and the MLP) and StableLM (Llama's
#    names, LayerNorms) ---------------------------------------------------------------------------------------------


class ExpertizePhi3Model(ExpertizeBaseModelMixin, Phi3Model):
    config_class = ExpertizePhi3Config
    _blocks_path = "layers"

    def __init__(self, config: ExpertizePhi3Config):
        super().__init__(config)
        self._install_sparse_layers()


class ExpertizePhi3ForCausalLM(ExpertizeCausalLMMixin, Phi3ForCausalLM):
    config_class = ExpertizePhi3Config
    _blocks_path = "model.layers"
    _base_class, _base_attr = ExpertizePhi3Model, "model"

    def __init__(self, config: ExpertizePhi3Config):
        super().__init__(config)
        self._adopt_base_model()


class ExpertizeStableLmModel(ExpertizeBaseModelMixin, StableLmModel):
    config_class = ExpertizeStableLmConfig
    _blocks_path = "layers"

    def __init__(self, config: ExpertizeStableLmConfig):
        super().__init__(config)
        self._install_sparse_layers()


class ExpertizeStableLmForCausalLM(ExpertizeCausalLMMixin, StableLmForCausalLM):
    config_class = ExpertizeStableLmConfig
    _blocks_path = "model.layers"
    _base_class, _base_attr = ExpertizeStableLmModel, "model"

    def __init__(self, config: ExpertizeStableLmConfig):
        super().__init__(config)
        self._adopt_base_model()


# -- Gemma 2 and Gemma 3 text (`model.layers[i].mlp` between `pre_feedforward_layernorm` and
#    `post_feedforward_layernorm`; scaled embeddings, soft-capped logits, RMSNorm scaling by 1 + weight) ------------


class ExpertizeGemma2Model(ExpertizeBaseModelMixin, Gemma2Model):
    config_class = ExpertizeGemma2Config
    _blocks_path = "layers"

    def __init__(self, config: ExpertizeGemma2Config):
        super().__init__(config)
        self._install_sparse_layers()


class ExpertizeGemma2ForCausalLM(ExpertizeCausalLMMixin, Gemma2ForCausalLM):
    config_class = ExpertizeGemma2Config
    _blocks_path = "model.layers"
    _base_class, _base_attr = ExpertizeGemma2Model, "model"

    def __init__(self, config: ExpertizeGemma2Config):
        super().__init__(config)
        self._adopt_base_model()


class ExpertizeGemma3TextModel(ExpertizeBaseModelMixin, Gemma3TextModel):
    config_class = ExpertizeGemma3TextConfig
    _blocks_path = "layers"

    def __init__(self, config: ExpertizeGemma3TextConfig):
        super().__init__(config)
        self._install_sparse_layers()


class ExpertizeGemma3ForCausalLM(ExpertizeCausalLMMixin, Gemma3ForCausalLM):
    config_class = ExpertizeGemma3TextConfig
    _blocks_path = "model.layers"
    _base_class, _base_attr = ExpertizeGemma3TextModel, "model"

    def __init__(self, config: ExpertizeGemma3TextConfig):
        super().__init__(config)
        self._adopt_base_model()


class Family(NamedTuple):
    """One supported model family: the expertize classes that wrap its native transformers classes.

    A new family adds its config class (configuration_expertize.py), its two model classes above and one row of
    `FAMILIES`; the conversion side adds its row of facts (LoRA targets, MLP child names, final norm, positions, logit
    soft cap) in expertize.conversion.surgery.families.
    """

    config_class: type
    """The expertize config (native config + `sparse_layers`), e.g. ExpertizeGPT2Config."""
    base_model_class: type
    """The headless model (AutoModel), e.g. ExpertizeGPT2Model."""
    causal_lm_class: type
    """The causal LM (AutoModelForCausalLM), e.g. ExpertizeGPT2ForCausalLM."""

    @property
    def blocks_path(self) -> str:
        """Attribute path from the causal LM (base or expertize) to its `nn.ModuleList` of decoder blocks, e.g.
        "transformer.h" for GPT-2: `model.get_submodule(family.blocks_path)[i].mlp` is decoder layer i's MLP."""
        return self.causal_lm_class._blocks_path


# Keyed by the base model_type (the expertize model_type is "expertize_" + it).
FAMILIES: dict[str, Family] = {
    "gpt2": Family(ExpertizeGPT2Config, ExpertizeGPT2Model, ExpertizeGPT2ForCausalLM),
    "gpt_neox": Family(ExpertizeGPTNeoXConfig, ExpertizeGPTNeoXModel, ExpertizeGPTNeoXForCausalLM),
    "llama": Family(ExpertizeLlamaConfig, ExpertizeLlamaModel, ExpertizeLlamaForCausalLM),
    "mistral": Family(ExpertizeMistralConfig, ExpertizeMistralModel, ExpertizeMistralForCausalLM),
    "qwen2": Family(ExpertizeQwen2Config, ExpertizeQwen2Model, ExpertizeQwen2ForCausalLM),
    "qwen3": Family(ExpertizeQwen3Config, ExpertizeQwen3Model, ExpertizeQwen3ForCausalLM),
    "olmo2": Family(ExpertizeOlmo2Config, ExpertizeOlmo2Model, ExpertizeOlmo2ForCausalLM),
    "gemma2": Family(ExpertizeGemma2Config, ExpertizeGemma2Model, ExpertizeGemma2ForCausalLM),
    "gemma3_text": Family(ExpertizeGemma3TextConfig, ExpertizeGemma3TextModel, ExpertizeGemma3ForCausalLM),
    "phi3": Family(ExpertizePhi3Config, ExpertizePhi3Model, ExpertizePhi3ForCausalLM),
    "stablelm": Family(ExpertizeStableLmConfig, ExpertizeStableLmModel, ExpertizeStableLmForCausalLM),
}

for _config_cls, _base_cls, _causal_cls in FAMILIES.values():
    expose_native_forward(_base_cls)
    expose_native_forward(_causal_cls)
    _base_cls._auto_map = _causal_cls._auto_map = _auto_map(_config_cls, _base_cls, _causal_cls)
    # Saved folders point the Auto classes at these files (auto_map).
    _config_cls.register_for_auto_class()
    _base_cls.register_for_auto_class("AutoModel")
    _causal_cls.register_for_auto_class("AutoModelForCausalLM")


def register_auto_classes() -> None:
    """Register every family with AutoConfig / AutoModel / AutoModelForCausalLM in this process, so that
    `AutoModelForCausalLM.from_config(ExpertizeLlamaConfig(...))` works. Called when `expertize.modeling` is imported;
    not when transformers loads these files as a folder's remote code (a model type registered from there would let
    a later `trust_remote_code=False` load run the custom code without asking)."""
    for config_cls, base_cls, causal_cls in FAMILIES.values():
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, base_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, causal_cls, exist_ok=True)
