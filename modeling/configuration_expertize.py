"""Config subclasses: a native transformers config plus `sparse_layers`, the per-layer sparse layer specs.

`sparse_layers` maps a decoder layer index (a string key in JSON) to a spec dict, e.g.
`{"2": {"kind": "mxd", "d_in": 64, "d_out": 64, "d_hidden": 172, "num_experts": 512, "k": 16, ...}}`.
Every other field is the native config's, unchanged, so a base checkpoint's config round-trips.
"""

import inspect
from typing import Any, NamedTuple

from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    StableLmConfig,
)

# Every bundle file must be a *direct* relative import of both entry files: transformers before PR #46022 (all of 4.x)
# copies only the entry file's direct relative imports into the module cache when loading from a local folder.
from .jumprelu_transcoders import JumpReluTranscoderSpec  # noqa: F401
from .latent_coder import LatentCoderSpec  # noqa: F401
from .moe_x import MoeXSpec  # noqa: F401
from .monet import MonetSpec  # noqa: F401
from .mumoe import MuMoESpec  # noqa: F401
from .mxd import MxdSpec  # noqa: F401
from .routed_neurons import RoutedNeuronsSpec  # noqa: F401
from .sparse_base import SparseLayer  # noqa: F401
from .sparse_code import SparseCode  # noqa: F401
from .sparse_kernels import sparse_rows_sum  # noqa: F401
from .sparse_layers import spec_from_dict
from .sparse_spec import SparseSpec
from .transcoder import TranscoderSpec  # noqa: F401


class MlpShape(NamedTuple):
    """The dense MLP a sparse layer replaces."""

    d_model: int
    """Input and output width (the residual stream)."""
    d_hidden: int
    """Hidden width."""
    activation: str
    """transformers activation name."""
    glu: bool
    """Gated (Llama-style `down(act(gate(x)) * up(x))`) or plain (`down(act(up(x)))`)."""


def _normalize_sparse_layers(sparse_layers: dict | None) -> dict[str, dict[str, Any]]:
    if sparse_layers is None:
        return {}
    if not isinstance(sparse_layers, dict):
        raise ValueError(
            f"sparse_layers must map layer index -> spec dict, got {type(sparse_layers).__name__}: {sparse_layers!r}"
        )
    out = {}
    for key, spec in sparse_layers.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"sparse_layers key {key!r} is not a layer index (an integer)") from None
        out[str(index)] = spec.to_dict() if callable(getattr(spec, "to_dict", None)) else dict(spec)
    return out


class _SparseLayersConfigMixin:
    """Shared by every family's config: parsing and validation of `sparse_layers` against the base MLP."""

    sparse_layers: dict[str, dict[str, Any]]

    def mlp_shape(self) -> MlpShape:
        return MlpShape(self.hidden_size, self.intermediate_size, self.hidden_act, glu=True)

    def sparse_layer_specs(self) -> dict[int, SparseSpec]:
        """The validated specs, keyed by integer layer index."""
        return {int(i): spec_from_dict(spec) for i, spec in sorted(self.sparse_layers.items(), key=lambda kv: int(kv[0]))}

    def _validate_sparse_layers(self) -> None:
        n_layers = self.num_hidden_layers
        shape = self.mlp_shape()
        for index, spec in self.sparse_layer_specs().items():
            if not 0 <= index < n_layers:
                raise ValueError(
                    f"sparse_layers: layer index {index} is out of range; this model has {n_layers} layers "
                    f"(valid indices 0..{n_layers - 1})"
                )
            for name in ("d_in", "d_out"):
                if getattr(spec, name) != shape.d_model:
                    raise ValueError(
                        f"sparse_layers[{index}]: {spec.kind}.{name}={getattr(spec, name)} does not match the base "
                        f"MLP's width {shape.d_model} (the model's hidden size); build the spec from the base model's "
                        "MLP shape"
                    )


def _legacy_rope_kwargs(parent: type, kwargs: dict) -> dict:
    """transformers 5 writes RoPE settings as one `rope_parameters` dict; transformers 4.x configs take `rope_theta`
    and `rope_scaling` (GPT-NeoX: `rotary_emb_base`, `rotary_pct`) instead and would keep the dict as an unused
    attribute, silently running with their defaults. Where `parent` has no `rope_parameters` argument (4.x), translate.
    """
    params = inspect.signature(parent.__init__).parameters
    if "rope_parameters" in params or not isinstance(kwargs.get("rope_parameters"), dict):
        return kwargs
    kwargs = dict(kwargs)
    rope = dict(kwargs.pop("rope_parameters"))
    legacy = {}
    if "full_attention" in rope and "rope_local_base_freq" in params:
        # Gemma 3 keeps one dict per attention type; 4.x reads the global layers' settings as the usual fields and
        # the local (sliding-window) layers' base as `rope_local_base_freq`.
        local = rope.get("sliding_attention") or {}
        if "rope_theta" in local:
            legacy["rope_local_base_freq"] = local["rope_theta"]
        rope = dict(rope["full_attention"])
    if "rope_theta" in rope:
        legacy["rotary_emb_base" if "rotary_emb_base" in params else "rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        legacy["rotary_pct" if "rotary_pct" in params else "partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    if rope.get("rope_type", "default") != "default":
        legacy["rope_scaling"] = rope  # 4.x's rope_scaling: the same dict without rope_theta
    return {**legacy, **kwargs}  # legacy keys already in the config win


def _init_config(self, parent: type, sparse_layers: dict | None, kwargs: dict) -> None:
    # Only new attribute names may be set before the parent __init__ (it resets the native fields).
    self.sparse_layers = _normalize_sparse_layers(sparse_layers)
    # transformers' MoE names: the forward returns router logits and the auxiliary loss when asked, and adds
    # `router_aux_loss_coef * aux_loss` to the LM loss. The layers' aux losses are already weighted by their own
    # specs' coefficients (e.g. MoE-X's λ = 0.001), so the default global factor is 1.
    output_router_logits = kwargs.pop("output_router_logits", False)
    router_aux_loss_coef = kwargs.pop("router_aux_loss_coef", 1.0)
    parent.__init__(self, **_legacy_rope_kwargs(parent, kwargs))
    self.output_router_logits = output_router_logits
    self.router_aux_loss_coef = router_aux_loss_coef
    self._validate_sparse_layers()


class ExpertizeGPT2Config(_SparseLayersConfigMixin, GPT2Config):
    model_type = "expertize_gpt2"

    def __init__(self, sparse_layers: dict | None = None, **kwargs):
        _init_config(self, GPT2Config, sparse_layers, kwargs)

    def mlp_shape(self) -> MlpShape:
        return MlpShape(self.n_embd, self.n_inner or 4 * self.n_embd, self.activation_function, glu=False)


class ExpertizeGPTNeoXConfig(_SparseLayersConfigMixin, GPTNeoXConfig):
    model_type = "expertize_gpt_neox"

    def __init__(self, sparse_layers: dict | None = None, **kwargs):
        _init_config(self, GPTNeoXConfig, sparse_layers, kwargs)

    def mlp_shape(self) -> MlpShape:
        return MlpShape(self.hidden_size, self.intermediate_size, self.hidden_act, glu=False)


class ExpertizeLlamaConfig(_SparseLayersConfigMixin, LlamaConfig):
    model_type = "expertize_llama"

    def __init__(self, sparse_layers: dict | None = None, **kwargs):
        _init_config(self, LlamaConfig, sparse_layers, kwargs)


class ExpertizeMistralConfig(_SparseLayersConfigMixin, MistralConfig):
    model_type = "expertize_mistral"

    def __init__(self, sparse_layers: dict | None = None, **kwargs):
        _init_config(self, MistralConfig, sparse_layers, kwargs)


class ExpertizeQwen2Config(_SparseLayersConfigMixin, Qwen2Config):
    model_type = "expertize_qwen2"

    def __init__(self, sparse_layers: dict | None = None, **kwargs):
        _init_config(self, Qwen2Config, sparse_layers, kwargs)


class ExpertizeQwen3Config(_SparseLayersConfigMixin, Qwen3Config):
    model_type = "expertize_qwen3"

    def __init__(self, sparse_layers: dict | None = None, **kwargs):
        _init_config(self, Qwen3Config, sparse_layers, kwargs)


class ExpertizeOlmo2Config(_SparseLayersConfigMixin, Olmo2Config):
    model_type = "expertize_olmo2"

    def __init__(self, sparse_layers: dict | None = None, **kwargs):
        _init_config(self, Olmo2Config, sparse_layers, kwargs)


class ExpertizePhi3Config(_SparseLayersConfigMixin, Phi3Config):
    """Phi-3: the MLP is gated under Llama's config names (its gate and up projections are one fused module, which
    the shape does not see: d_hidden is `intermediate_size`, the width of each half)."""

    model_type = "expertize_phi3"

    def __init__(self, sparse_layers: dict | None = None, **kwargs):
        _init_config(self, Phi3Config, sparse_layers, kwargs)


class ExpertizeStableLmConfig(_SparseLayersConfigMixin, StableLmConfig):
    model_type = "expertize_stablelm"

    def __init__(self, sparse_layers: dict | None = None, **kwargs):
        _init_config(self, StableLmConfig, sparse_layers, kwargs)


class _GemmaMlpShape:
    """Gemma's configs name the MLP's activation `hidden_activation` (gelu_pytorch_tanh), not `hidden_act`."""

    def mlp_shape(self) -> MlpShape:
        return MlpShape(self.hidden_size, self.intermediate_size, self.hidden_activation, glu=True)


class ExpertizeGemma2Config(_GemmaMlpShape, _SparseLayersConfigMixin, Gemma2Config):
    model_type = "expertize_gemma2"

    def __init__(self, sparse_layers: dict | None = None, **kwargs):
        _init_config(self, Gemma2Config, sparse_layers, kwargs)


class ExpertizeGemma3TextConfig(_GemmaMlpShape, _SparseLayersConfigMixin, Gemma3TextConfig):
    """Gemma 3's text-only causal LM (`Gemma3ForCausalLM`: gemma-3-270m, gemma-3-1b; model_type "gemma3_text")."""

    model_type = "expertize_gemma3_text"

    def __init__(self, sparse_layers: dict | None = None, **kwargs):
        _init_config(self, Gemma3TextConfig, sparse_layers, kwargs)
