"""Model families on the conversion side: which base model_types expertize converts, and what conversion needs to
know about them beyond the bundle's classes.

The bundle's table `expertize.modeling.FAMILIES` (model_type -> `Family(config_class, base_model_class,
causal_lm_class)`, with `.blocks_path`) is the one list of supported families; this module adds only what the saved
model never needs (the LoRA defaults of healing). A new family adds its classes and row in the bundle and its row in
`_LORA` here; nothing else names it.
"""

from dataclasses import dataclass

from torch import nn

from expertize.modeling import FAMILIES, Family, MlpShape

__all__ = [
    "EXPERTIZE_PREFIX",
    "attention_projections",
    "base_family",
    "conv1d_attention",
    "decoder_blocks",
    "family_info",
    "mlp_shape",
]

EXPERTIZE_PREFIX = "expertize_"
"""An expertize model's model_type is this prefix + its base model_type."""


@dataclass(frozen=True)
class _LoraDefaults:
    attention: tuple[str, ...]
    """The attention projections (suffix names, as PEFT matches them) LoRA adapts by default. They must differ from
    the MLP's names (GPT-2's MLP also has a `c_proj`, hence the `attn.` prefix)."""
    conv1d: bool = False
    """The projections are transformers `Conv1D` modules (weights stored (in, out)): PEFT needs fan_in_fan_out."""


_LLAMA_LIKE = _LoraDefaults(("q_proj", "k_proj", "v_proj", "o_proj"))
_LORA: dict[str, _LoraDefaults] = {
    "gpt2": _LoraDefaults(("attn.c_attn", "attn.c_proj"), conv1d=True),
    "gpt_neox": _LoraDefaults(("attention.query_key_value", "attention.dense")),
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
}


def base_family(model_type: str) -> str:
    """The family key in `FAMILIES` for a base (or expertize) model_type; a clear error for anything else."""
    family = str(model_type).removeprefix(EXPERTIZE_PREFIX)
    if family not in FAMILIES:
        raise ValueError(
            f"unsupported architecture {model_type!r}: expertize can splice sparse layers into "
            f"{', '.join(sorted(FAMILIES))} models"
        )
    return family


def family_info(model_type: str) -> Family:
    """The bundle's `Family` row (config, base model and causal LM classes, blocks path) of a base or expertize
    model_type."""
    return FAMILIES[base_family(model_type)]


def mlp_shape(config) -> MlpShape:
    """The dense MLP shape (d_model, d_hidden, activation, glu) of a base or expertize model config."""
    return family_info(config.model_type).config_class.mlp_shape(config)


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a base or expertize causal LM of any supported family."""
    return model.get_submodule(family_info(model.config.model_type).blocks_path)


def attention_projections(family: str) -> list[str]:
    """LoRA's default target modules for `family` (a base model_type): its attention projections."""
    return list(_LORA[base_family(family)].attention)


def conv1d_attention(family: str) -> bool:
    """Whether `family`'s attention projections are transformers `Conv1D` modules (GPT-2)."""
    return _LORA[base_family(family)].conv1d
