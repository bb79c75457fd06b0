"""Model families on the conversion side: which base model_types expertize converts, and every fact conversion needs
about a family beyond the bundle's classes, one row per model_type.

The bundle's table `expertize.modeling.FAMILIES` (model_type -> `Family(config_class, base_model_class,
causal_lm_class)`, with `.blocks_path`) is the one list of supported families; `_FACTS` here holds, per family, what
the saved model never needs:

    lora          the attention projections healing adapts by default (PEFT suffixes), and whether they are Conv1D
    mlp           the MLP's child names and form (`MlpLayout`): what dense_init.py reads to start a layer from the
                  dense MLP (two gated projections or one fused gate/up projection, as Phi-3's `gate_up_proj`)
    final_norm    where the final norm is and how it scales (`FinalNorm`; Gemma's RMSNorm scales by 1 + weight)
    positions     the config attribute that says how many positions the model reads
    logit_softcap the config attribute of a soft cap on the logits (Gemma 2: logits = cap · tanh(logits / cap))

A new family adds its classes and `FAMILIES` row in the bundle and its row here; nothing else in conversion/ names
it (CONTRIBUTING.md, "Add a model family").
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from expertize.modeling import FAMILIES, Family, MlpShape

from ..errors import ExpertizeError

__all__ = [
    "EXPERTIZE_PREFIX",
    "FamilyFacts",
    "FinalNorm",
    "MlpLayout",
    "attention_projections",
    "base_family",
    "conv1d_attention",
    "decoder_blocks",
    "family_facts",
    "family_info",
    "final_norm",
    "final_norm_scale",
    "lm_logits",
    "mlp_layout",
    "mlp_shape",
    "model_positions",
]

EXPERTIZE_PREFIX = "expertize_"
"""An expertize model's model_type is this prefix + its base model_type."""


@dataclass(frozen=True)
class MlpLayout:
    """How a family's dense MLP names its weights: y = w_out(φ(gate x) [* up x]), where gate is `w_in` and up is
    `w_up` (two projections), or gate and up are the two halves of one fused projection `w_in` (`fused_halves`)."""

    w_in: str
    """The projection under φ (GPT-2 `c_fc`, GPT-NeoX `dense_h_to_4h`, Llama-likes `gate_proj`), or the fused gate/up
    projection (Phi-3 `gate_up_proj`)."""
    w_out: str
    """The output projection (`c_proj`, `dense_4h_to_h`, `down_proj`)."""
    w_up: str | None = None
    """The linear branch of a gated (GLU) MLP (`up_proj`); None for a plain MLP or a fused one."""
    activation: str = "act"
    """The attribute holding φ (`act`, Llama-likes `act_fn`, Phi-3 `activation_fn`)."""
    transposed: bool = False
    """The projections are transformers `Conv1D` modules, whose weights are stored (in, out) (GPT-2)."""
    fused_halves: tuple[str, str] | None = None
    """A fused gated MLP: `w_in` is one projection (2H outputs) whose output the MLP chunks in two along its last
    dimension; this names the halves in order, "gate" (under φ) and "up" (the linear branch). Phi-3's
    `gate_up_proj`: ("gate", "up"). None: gate and up are separate modules (or the MLP is plain)."""

    def __post_init__(self):
        if self.fused_halves is not None and (sorted(self.fused_halves) != ["gate", "up"] or self.w_up is not None):
            raise ValueError(f"MlpLayout.fused_halves must order 'gate' and 'up' (e.g. ('gate', 'up')) with w_up=None "
                             f"(the fused projection holds both), got {self.fused_halves!r} and w_up={self.w_up!r}")

    @property
    def children(self) -> tuple[str, ...]:
        """The MLP's attributes dense_init reads: the projections and φ."""
        return tuple(name for name in (self.w_in, self.w_up, self.w_out, self.activation) if name is not None)


@dataclass(frozen=True)
class FinalNorm:
    """The norm before the unembedding, as its linear part acts on a direction d (O,): [centre] then scale."""

    path: str
    """Attribute path from the causal LM (base or expertize), e.g. "model.norm"."""
    centres: bool
    """LayerNorm subtracts the mean before scaling; RMSNorm does not."""
    weight_offset: float = 0.0
    """The per-channel scale is `weight + weight_offset`: 0 for LayerNorm / Llama's RMSNorm, 1 for Gemma's RMSNorm
    (`x̂ · (1 + weight)`, weights stored around 0)."""


@dataclass(frozen=True)
class FamilyFacts:
    """What conversion knows about one family (one row of `_FACTS`)."""

    lora: tuple[str, ...]
    """The attention projections (suffix names, as PEFT matches them) LoRA adapts by default. They must differ from
    the MLP's names (GPT-2's MLP also has a `c_proj`, hence the `attn.` prefix)."""
    mlp: MlpLayout
    final_norm: FinalNorm
    conv1d_attention: bool = False
    """The projections in `lora` are transformers `Conv1D` modules (weights stored (in, out)): PEFT needs
    fan_in_fan_out."""
    positions: str = "max_position_embeddings"
    """The config attribute holding the number of positions the model reads (GPT-2: `n_positions`)."""
    logit_softcap: str | None = None
    """The config attribute of the final logit soft cap, where the family has one (its value may be null)."""


_GPT2_MLP = MlpLayout("c_fc", "c_proj", activation="act", transposed=True)
_NEOX_MLP = MlpLayout("dense_h_to_4h", "dense_4h_to_h", activation="act")
_GATED_MLP = MlpLayout("gate_proj", "down_proj", w_up="up_proj", activation="act_fn")
_FUSED_GATED_MLP = MlpLayout("gate_up_proj", "down_proj", activation="activation_fn", fused_halves=("gate", "up"))
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_RMS_NORM = FinalNorm("model.norm", centres=False)
_LLAMA_LIKE = FamilyFacts(_ATTENTION, _GATED_MLP, _RMS_NORM)
_GEMMA = FamilyFacts(_ATTENTION, _GATED_MLP, FinalNorm("model.norm", centres=False, weight_offset=1.0),
                     logit_softcap="final_logit_softcapping")

_FACTS: dict[str, FamilyFacts] = {
    "gpt2": FamilyFacts(("attn.c_attn", "attn.c_proj"), _GPT2_MLP, FinalNorm("transformer.ln_f", centres=True),
                        conv1d_attention=True, positions="n_positions"),
    "gpt_neox": FamilyFacts(("attention.query_key_value", "attention.dense"), _NEOX_MLP,
                            FinalNorm("gpt_neox.final_layer_norm", centres=True)),
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,  # q/k norms live inside the attention; the MLP and final norm are Llama's
    "olmo2": _LLAMA_LIKE,  # no norm before the MLP: it reads the residual stream itself (capture hooks the MLP)
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    # Phi-3: Llama's block, with fused attention (qkv_proj) and MLP (gate_up_proj: gate half first) projections.
    "phi3": FamilyFacts(("qkv_proj", "o_proj"), _FUSED_GATED_MLP, _RMS_NORM),
    # StableLM: Llama's names, LayerNorms (the final one centres); stablelm-2-12b's parallel residual feeds the MLP
    # the attention's input norm, which capture reads at the MLP either way.
    "stablelm": FamilyFacts(_ATTENTION, _GATED_MLP, FinalNorm("model.norm", centres=True)),
}

_POSITION_ATTRIBUTES = ("n_positions", "max_position_embeddings", "n_ctx")
"""For a model_type outside the table (e.g. a base model evaluated by `expertize tasks`): where a config may state its
context length, in the order lm-eval's HFLM reads them (its max_length)."""


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


def family_facts(model_type: str) -> FamilyFacts:
    """The conversion-side row of a base or expertize model_type."""
    family = base_family(model_type)
    if family not in _FACTS:  # a bundle family without its row here: a contributor's omission, named
        raise ValueError(f"family {family!r} has no row in conversion/surgery/families.py's _FACTS; add one "
                         "(CONTRIBUTING.md, 'Add a model family')")
    return _FACTS[family]


def mlp_shape(config) -> MlpShape:
    """The dense MLP shape (d_model, d_hidden, activation, glu) of a base or expertize model config."""
    return family_info(config.model_type).config_class.mlp_shape(config)


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a base or expertize causal LM of any supported family."""
    return model.get_submodule(family_info(model.config.model_type).blocks_path)


def attention_projections(family: str) -> list[str]:
    """LoRA's default target modules for `family` (a base model_type): its attention projections."""
    return list(family_facts(family).lora)


def conv1d_attention(family: str) -> bool:
    """Whether `family`'s attention projections are transformers `Conv1D` modules (GPT-2)."""
    return family_facts(family).conv1d_attention


def mlp_layout(model_type: str) -> MlpLayout:
    """The MLP layout of a base or expertize model_type's family (what dense_init reads its dense MLP by)."""
    return family_facts(model_type).mlp


def final_norm(model: nn.Module) -> nn.Module:
    """The final norm before the unembedding (GPT-2 `ln_f`, GPT-NeoX `final_layer_norm`, Llama-likes `norm`)."""
    return model.get_submodule(family_facts(model.config.model_type).final_norm.path)


def final_norm_scale(model: nn.Module) -> tuple[bool, torch.Tensor | None]:
    """(whether the final norm centres, its per-channel scale (O,) float32 or None): the norm's linear part, which
    vocabulary effects apply to a unit's direction. The scale is `weight + weight_offset` (Gemma: 1 + weight)."""
    facts = family_facts(model.config.model_type).final_norm
    weight = getattr(final_norm(model), "weight", None)
    scale = None if weight is None else weight.detach().float() + facts.weight_offset
    return facts.centres, scale


def lm_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The logits the causal LM computes from the last decoder block's output `hidden` (B, T, d): final norm, LM
    head, and the family's logit soft cap where its config sets one -> (B, T, V)."""
    logits = model.get_output_embeddings()(final_norm(model)(hidden))
    attribute = family_facts(model.config.model_type).logit_softcap
    cap = getattr(model.config, attribute, None) if attribute else None
    if cap:  # as the native forward does it (divide, tanh, multiply), so that the result is bit for bit its own
        logits = torch.tanh(logits / cap) * cap
    return logits


def model_positions(config: Any) -> int | None:
    """How many positions a model reads, from its family's positions attribute (`max_position_embeddings`, GPT-2's
    `n_positions`; outside the table, the first of lm-eval's names that is set); None when its config does not say.
    `config`: a transformers config or a config.json dict."""
    get = config.get if isinstance(config, dict) else (lambda key: getattr(config, key, None))
    family = str(get("model_type") or "").removeprefix(EXPERTIZE_PREFIX)
    names = (_FACTS[family].positions,) if family in _FACTS else _POSITION_ATTRIBUTES
    for key in names:
        value = get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_context_length(length: int, config: Any, *, setting: str, model: str = "the model") -> None:
    """Refuse a sequence length beyond the model's positions (a learned position embedding has no row for them: an
    IndexError deep inside the forward; rotary models were never trained there). `setting` is how the user gives
    the length: a recipe key ("data.context_length") or a flag ("--context-length")."""
    positions = model_positions(config)
    if positions is not None and length > positions:
        flag = setting.startswith("-")
        given = f"{setting} {length}" if flag else f"{setting}={length}"
        fix = f"{setting} {positions}" if flag else f"--set {setting}={positions}"
        raise ExpertizeError(
            f"{given} is longer than {model} reads: it has {positions} positions (its config.json); use {fix} or less"
        )
