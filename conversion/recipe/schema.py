"""Recipes: one typed dataclass tree (`Recipe`) read strictly from YAML, the input of `expertize upcycle RECIPE.yaml`.

    recipe.yaml ─► YAML (floats such as 3e-4 read as numbers; duplicate keys rejected)
               ─► `--set key=value` overrides (dotted keys, values parsed as YAML)
               ─► ${ENV_VAR} expansion in every string
               ─► dataclasses, every key and type checked (an unknown key is an error naming it, the file and
                   the valid keys)

The sections mirror the dataclasses one-to-one:

    base_model: gpt2              # Recipe
    layers: [8]
    layer: {kind: mxd, k: 32, match_transcoder: 32}   # LayerConfig
    data: {...}                   # expertize.conversion.data.text.DataConfig
    train: {...}                  # TrainConfig
    eval: {...}                   # EvalConfig
    output_dir: runs/gpt2-mxd-l8

Relative paths (data.paths, a local base_model, output_dir) are relative to the current working directory, as in
every command-line tool, not to the recipe file: ship recipes with `${EXPERTIZE_DATA}/...` style paths instead.

Numbers: an integer is accepted where a number is expected, and a float with an integral value (4.8e8) where an
integer is expected; booleans are never numbers.
"""

import ast
import copy
import dataclasses
import difflib
import inspect
import math
import os
import re
import textwrap
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from expertize.conversion.data.text import DataConfig
from expertize.conversion.recipe.param_match import match_parameter_count, mxd_experts_for_transcoder
from expertize.modeling.configuration_expertize import MlpShape
from expertize.modeling.sparse_base import SparseSpec, canonical_activation
from expertize.modeling.sparse_layers import LAYER_KINDS
from expertize.modeling.transcoder import TranscoderSpec
from ..errors import ExpertizeError

__all__ = [
    "EvalConfig",
    "LayerConfig",
    "Recipe",
    "RecipeError",
    "TrainConfig",
    "field_docs",
    "load_recipe",
    "recipe_from_dict",
    "recipe_to_dict",
    "resolve_layer_spec",
    "resolve_layers",
    "save_recipe",
]


class RecipeError(ExpertizeError, ValueError):
    """A recipe (file, override or field value) is invalid; the message names the key, the value and the fix."""


# ----------------------------------------------------------------------------------------------------------------
# The dataclass tree


# Recipe fields that map onto sparse spec fields of the same name (when the spec has them); `options` may not repeat
# them, and the spec fields the recipe derives from the base model may not be set at all.
_SPEC_FIELDS_FROM_RECIPE = ("k", "num_experts", "num_latents", "d_hidden", "encoder", "activation")
_SPEC_FIELDS_FROM_MODEL = ("d_in", "d_out")
_DENSE_INIT_KINDS = ("moe_x",)


@dataclasses.dataclass
class LayerConfig:
    """The sparse layer that replaces each target MLP (recipe section `layer:`)."""

    kind: str = "mxd"
    """Sparse layer kind: "mxd", "transcoder" or "skip_transcoder" (any key of expertize.modeling.LAYER_KINDS)."""

    k: int = 32
    """K: active experts (mxd, routed kinds) or latents (transcoders) per token; for kinds with a top-k only."""

    num_experts: int | None = None
    """N, the number of experts (every kind except transcoders). Give it or `match_transcoder`, not both, unless
    the kind's parameter matching picks another field (μMoE: the rank)."""

    num_latents: int | None = None
    """transcoders: L, the dictionary size. Give it or `match_transcoder`, not both."""

    match_transcoder: float | None = None
    """Size the layer like a transcoder of `match_transcoder * d_in` latents: transcoders get exactly that many;
    mxd gets the N that matches that transcoder's parameter count (see `match_convention`); other kinds get the
    largest N (or the field their spec names as `match_field`, e.g. μMoE's rank) within that parameter count."""

    match_convention: Literal["exact", "paper"] = "exact"
    """mxd parameter matching: "exact" (largest N within the transcoder's parameter count) or "paper" (reproduces
    the MxD paper's Table 2: N = 21,490 for GPT-2)."""

    d_hidden: int | None = None
    """H, the width of the dense hidden code (mxd, μMoE) or the total expert width (Monet); default: the base
    MLP's width. Kinds without the field reject it."""

    encoder: Literal["auto", "mlp", "glu"] = "auto"
    """Dense encoder of mxd and μMoE: "auto" (glu when the base MLP is gated, else mlp), "mlp" or "glu"."""

    activation: str = "auto"
    """Hidden activation of kinds that have one: "auto" (the base MLP's: gelu_new for GPT-2, gelu for Pythia, silu
    for Llama; MoE-X keeps its ReLU), or gelu, gelu_new, silu, relu, relu2."""

    init: Literal["default", "split", "copy"] = "default"
    """Where the layer's weights start (moe_x only for split / copy): "default" (the layer's own init), "split"
    (the dense MLP's hidden neurons partitioned over the experts; with all experts on it equals the MLP) or "copy"
    (every expert a noisy copy of the MLP). See expertize.conversion.surgery.dense_init."""

    init_clustering: Literal["random", "balanced_kmeans"] = "random"
    """split: how neurons are grouped into experts (random, or balanced k-means on their input weights)."""

    init_noise: float | None = None
    """copy: relative std of the noise on each expert's encoder (breaks the router's ties); null: the default 0.01."""

    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Further fields of the layer's spec, passed through and validated by it, e.g. {random_k: true} or
    {unit_norm_experts: true} or {encoder_bias: false} for mxd."""

    def __post_init__(self) -> None:
        _check_field_types(self, "layer")
        if self.kind not in LAYER_KINDS:
            raise ValueError(
                f"layer.kind: unknown kind {self.kind!r}{_did_you_mean(self.kind, LAYER_KINDS)}; "
                f"known kinds: {', '.join(sorted(LAYER_KINDS))}"
            )
        for name in ("k", "num_experts", "num_latents", "d_hidden"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"layer.{name}: must be >= 1, got {value}")
        if self.match_transcoder is not None and not self.match_transcoder > 0:
            raise ValueError(
                "layer.match_transcoder: must be a positive expansion factor (transcoder latents per input dim), "
                f"got {self.match_transcoder}"
            )
        if self.activation != "auto":
            try:
                self.activation = canonical_activation(self.activation)
            except ValueError as e:
                raise ValueError(f"layer.activation: {e}, or 'auto'") from None
        self._check_fields_apply()
        self._check_size()
        self._check_options()
        if self.init != "default" and self.kind not in _DENSE_INIT_KINDS:
            raise ValueError(
                f"layer.init={self.init!r}: initialization from the dense MLP is implemented for "
                f"{', '.join(_DENSE_INIT_KINDS)}, not {self.kind!r}; use init: default"
            )
        if self.init_noise is not None and (self.init != "copy" or not self.init_noise >= 0):
            raise ValueError(f"layer.init_noise: a number >= 0 for init: copy only, got {self.init_noise!r} with "
                             f"init: {self.init}")

    def _check_fields_apply(self) -> None:
        """Fields the kind's spec does not have must keep their defaults (e.g. layer.encoder for a transcoder)."""
        spec_fields = _spec_field_names(self.kind)
        for name in _SPEC_FIELDS_FROM_RECIPE:
            if name not in spec_fields and getattr(self, name) != _field_default(LayerConfig, name):
                kinds = ", ".join(kind for kind in sorted(LAYER_KINDS) if name in _spec_field_names(kind))
                raise ValueError(
                    f"layer.{name}={getattr(self, name)!r} does not apply to layer.kind={self.kind!r}; remove it "
                    f"(it applies to kinds: {kinds})"
                )

    def _check_size(self) -> None:
        """Exactly one of the explicit unit count and match_transcoder, unless matching sizes another field."""
        units = self.units_field
        if units is None:
            raise ValueError(f"layer.kind={self.kind!r}: its spec has neither num_experts nor num_latents")
        explicit = getattr(self, units)
        match_field = _match_field(self.kind)
        if match_field == units:
            if (explicit is None) == (self.match_transcoder is None):
                state = "both are set" if explicit is not None else "neither is set"
                raise ValueError(
                    f"layer: give exactly one of layer.{units} (explicit size) and layer.match_transcoder (size "
                    f"matched to a transcoder of that expansion factor) for layer.kind={self.kind!r}; {state}"
                )
        else:
            # e.g. μMoE: the expert count is a free choice and parameter matching picks the rank.
            if self.match_transcoder is not None and match_field in self.options:
                raise ValueError(
                    f"layer: layer.match_transcoder chooses {match_field} for layer.kind={self.kind!r}; remove "
                    f"layer.options.{match_field} or layer.match_transcoder"
                )
            if explicit is None and _field_default(LAYER_KINDS[self.kind][0], units) is dataclasses.MISSING:
                raise ValueError(f"layer.{units}: required for layer.kind={self.kind!r}")
        if self.match_convention != "exact" and self.kind != "mxd":
            raise ValueError(
                f"layer.match_convention={self.match_convention!r} applies to mxd only (the MxD paper's Table 2); "
                f"remove it for layer.kind={self.kind!r}"
            )

    def _check_options(self) -> None:
        reserved = set(_SPEC_FIELDS_FROM_RECIPE) | set(_SPEC_FIELDS_FROM_MODEL) | {"kind"}
        allowed = sorted(_spec_field_names(self.kind) - reserved)
        for name in self.options:
            if name in _SPEC_FIELDS_FROM_RECIPE or name == "kind":
                raise ValueError(f"layer.options.{name}: not an option; set layer.{name} instead")
            if name in _SPEC_FIELDS_FROM_MODEL:
                raise ValueError(f"layer.options.{name}: not an option; it is taken from the base model's MLP")
            if name not in allowed:
                raise ValueError(
                    f"layer.options.{name}: unknown option for layer.kind={self.kind!r}"
                    f"{_did_you_mean(name, allowed)}; valid options: {', '.join(allowed) or '(none)'}"
                )

    @property
    def units_field(self) -> str | None:
        """The spec field that counts this kind's units: "num_experts" (mxd) or "num_latents" (transcoders)."""
        fields = _spec_field_names(self.kind)
        return next((name for name in ("num_experts", "num_latents") if name in fields), None)


@dataclasses.dataclass
class TrainConfig:
    """Optimization of the sparse layers against the frozen MLPs (recipe section `train:`)."""

    lr: float = 1e-4
    """Peak learning rate (AdamW)."""

    warmup_steps: int = 5000
    """Linear warm-up from 0 to `lr` over this many steps (MxD paper: 5,000)."""

    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning rate after warm-up: "constant" (MxD paper), or "cosine" / "linear" decay to lr * min_lr_ratio."""

    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine / linear schedules, as a fraction of `lr`."""

    tokens_per_step: int = 4096
    """Activation rows (tokens) per optimizer step (MxD paper: 4,096)."""

    loss: Literal["nmse", "fvu", "mse"] = "nmse"
    """Training loss: "nmse" (MxD paper: mean over tokens of ||y - ŷ||² / ||y||, per output dim), "fvu" (fraction
    of variance unexplained) or "mse"."""

    precision: Literal["fp32", "bf16"] = "fp32"
    """Arithmetic of the sparse layers' training: "fp32" (MxD paper) or "bf16" autocast."""

    seed: int = 0
    """Seed of the sparse layers' initialization and of the activation shuffle."""

    checkpoint_every: int = 1000
    """Write a resumable checkpoint every this many steps (0: only at the end)."""

    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; null: no clipping."""

    weight_decay: float = 0.0
    """AdamW weight decay (MxD paper: 0)."""

    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas [beta1, beta2]."""

    shuffle_buffer_tokens: int = 65536
    """Captured activations are shuffled across sequences in a buffer of this many tokens (MxD paper: 524,288)."""

    capture_batch_sequences: int = 32
    """Sequences per base-model forward when capturing activations."""

    log_every: int = 50
    """Log the training metrics every this many steps."""

    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:N" or "mps"."""

    distill: bool = True
    """Layer-wise distillation on captured activations. false: skip it (e.g. a MoE initialized from the dense MLP
    and then healed end to end; needs a `heal:` section)."""

    def __post_init__(self) -> None:
        _check_field_types(self, "train")
        if not self.lr > 0:
            raise ValueError(f"train.lr: must be > 0, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio: must lie in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay: must be >= 0, got {self.weight_decay}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"train.grad_clip: must be > 0 (or null for no clipping), got {self.grad_clip}")
        for name in ("tokens_per_step", "shuffle_buffer_tokens", "capture_batch_sequences", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "checkpoint_every", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}: must be >= 0, got {getattr(self, name)}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"train.betas: expected two numbers in [0, 1) such as [0.9, 0.999], got {self.betas}")
        if self.shuffle_buffer_tokens < self.tokens_per_step:
            raise ValueError(
                f"train.shuffle_buffer_tokens={self.shuffle_buffer_tokens} is smaller than one step "
                f"(train.tokens_per_step={self.tokens_per_step}); raise it to at least tokens_per_step"
            )
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ValueError(f"train.device: expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got {self.device!r}")


@dataclasses.dataclass
class HealConfig:
    """End-to-end healing after distillation (recipe section `heal:`; leave it out for none).

    The spliced model trains on text: the sparse layers fully, the rest of the model frozen or adapted with LoRA
    (merged into the weights before saving). Routed layers' auxiliary losses are added, times
    `router_aux_loss_coef`. Runs on one process.
    """

    tokens: int = 1_000_000
    """Healing budget in tokens (sequences of data.context_length from the train split, from its start)."""

    batch_sequences: int = 8
    """Sequences per optimizer step."""

    objective: Literal["kl", "lm"] = "kl"
    """"kl": KL(base ‖ healed) of the next-token distributions (match the dense model's outputs); "lm": next-token
    cross-entropy on the text."""

    lr: float = 1e-4
    """Peak learning rate (AdamW) of everything that trains."""

    warmup_steps: int = 100
    """Linear warm-up steps."""

    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """Learning rate after warm-up."""

    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine / linear schedules, as a fraction of `lr`."""

    rest: Literal["frozen", "lora"] = "frozen"
    """The non-sparse weights: "frozen", or "lora" (PEFT LoRA on `lora_target_modules`, merged before saving)."""

    lora_r: int = 8
    """LoRA rank."""

    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""

    lora_target_modules: list[str] | Literal["auto"] = "auto"
    """Modules LoRA adapts (PEFT suffix names); "auto": the attention projections of the base family (GPT-2
    attn.c_attn, attn.c_proj; GPT-NeoX attention.query_key_value, attention.dense; Llama-like q/k/v/o_proj); []:
    none (with lora_target_parameters)."""

    lora_target_parameters: list[str] = dataclasses.field(default_factory=list)
    """Sparse-layer parameters adapted by LoRA instead of trained fully (PEFT `target_parameters`, e.g.
    ["mlp.W_enc", "mlp.W_dec"] for MoE-X's 3-D expert weights). Needs rest: lora."""

    aux_loss_coef: float = 1.0
    """Factor on the routed layers' auxiliary losses (router_aux_loss_coef of the saved config)."""

    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; null: no clipping."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    log_every: int = 10
    """Log the healing metrics every this many steps."""

    checkpoint_every: int = 200
    """Write a resumable checkpoint every this many steps (0: none until the end)."""

    def __post_init__(self) -> None:
        _check_field_types(self, "heal")
        if not self.lr > 0:
            raise ValueError(f"heal.lr: must be > 0, got {self.lr}")
        for name in ("tokens", "batch_sequences", "lora_r", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"heal.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "checkpoint_every", "weight_decay", "aux_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"heal.{name}: must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"heal.min_lr_ratio: must lie in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"heal.grad_clip: must be > 0 (or null for no clipping), got {self.grad_clip}")
        if self.rest != "lora":
            for name, is_set in (
                ("lora_target_parameters", bool(self.lora_target_parameters)),
                ("lora_target_modules", self.lora_target_modules != "auto"),
            ):
                if is_set:
                    raise ValueError(f"heal.{name}: LoRA settings need heal.rest: lora (it is {self.rest!r})")
        if self.lora_target_modules != "auto" and not self.lora_target_modules and not self.lora_target_parameters:
            raise ValueError(
                'heal.lora_target_modules: empty and no heal.lora_target_parameters; list module names or write "auto"'
            )


@dataclasses.dataclass
class EvalConfig:
    """Evaluation after training, on the held-out documents of `data` (recipe section `eval:`)."""

    batch_sequences: int = 16
    """Sequences per forward pass of the evaluation."""

    generation_prompts: int = 32
    """Held-out prompts whose greedy continuations are compared between the base and the spliced model (MxD paper:
    512); 0 skips the comparison."""

    prompt_tokens: int = 4
    """Tokens of each prompt."""

    continuation_tokens: int = 32
    """Tokens generated after each prompt."""

    histogram: bool = True
    """Record how often each expert / latent fires (dead and dense units)."""

    lm_eval_tasks: list[str] = dataclasses.field(default_factory=list)
    """lm-evaluation-harness task names to run on the base and the spliced model after training (empty: none), e.g.
    [expertize_stories_ppl, expertize_stories_cloze] (offline tasks shipped with expertize) or [hellaswag]."""

    lm_eval_num_fewshot: int | None = None
    """Few-shot examples per lm-eval prompt; null: each task's default."""

    lm_eval_limit: int | float | None = None
    """Documents per lm-eval task (a fraction when < 1); null: all of them. Partial results: smoke tests only."""

    lm_eval_batch_size: int = 8
    """Requests per forward pass of the lm-eval runs."""

    lm_eval_include_paths: list[str] = dataclasses.field(default_factory=list)
    """Extra folders of lm-eval task YAMLs (e.g. written by `expertize tasks`); the shipped offline tasks are
    always available."""

    def __post_init__(self) -> None:
        _check_field_types(self, "eval")
        for name in ("batch_sequences", "prompt_tokens", "continuation_tokens", "lm_eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name}: must be >= 1, got {getattr(self, name)}")
        if self.generation_prompts < 0:
            raise ValueError(f"eval.generation_prompts: must be >= 0, got {self.generation_prompts}")
        if self.lm_eval_num_fewshot is not None and self.lm_eval_num_fewshot < 0:
            raise ValueError(f"eval.lm_eval_num_fewshot: must be >= 0 (or null), got {self.lm_eval_num_fewshot}")
        if self.lm_eval_limit is not None and not self.lm_eval_limit > 0:
            raise ValueError(
                f"eval.lm_eval_limit: must be > 0 (documents per task, or a fraction < 1) or null, got "
                f"{self.lm_eval_limit}"
            )
        if any(not task.strip() for task in self.lm_eval_tasks):
            raise ValueError(f"eval.lm_eval_tasks: empty task name in {self.lm_eval_tasks}")
        for path in self.lm_eval_include_paths:
            if not Path(path).is_dir():
                raise ValueError(f"eval.lm_eval_include_paths: {path!r} is not a folder of task YAMLs")


@dataclasses.dataclass(kw_only=True)
class Recipe:
    """Everything `expertize upcycle` needs: which MLPs of which model become which sparse layer, and how."""

    base_model: str
    """Dense model to convert: a Hub id (gpt2, meta-llama/Llama-3.2-3B) or a local directory."""

    base_revision: str | None = None
    """Hub revision (branch, tag or commit) of base_model; null: the default branch."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the base model is loaded in (it only produces the activations the sparse layers learn from)."""

    layers: list[int] | Literal["all"]
    """Decoder layer indices whose MLPs are replaced, e.g. [8], or "all"."""

    layer: LayerConfig = dataclasses.field(default_factory=LayerConfig)
    """The sparse layer used at every index in `layers`."""

    data: DataConfig
    """Text the activations are captured on."""

    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Optimization."""

    heal: HealConfig | None = None
    """End-to-end healing of the spliced model after distillation; null: none."""

    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Evaluation after training."""

    output_dir: str
    """Folder receiving checkpoints, metrics, recipe.resolved.yaml and the converted model."""

    def __post_init__(self) -> None:
        _check_field_types(self, "")
        for name in ("base_model", "output_dir"):
            if not getattr(self, name).strip():
                raise ValueError(f"{name}: must not be empty")
        if isinstance(self.layers, list):
            if not self.layers:
                raise ValueError('layers: empty; list the layer indices to convert, e.g. [8], or write "all"')
            negative = [i for i in self.layers if i < 0]
            if negative:
                raise ValueError(f"layers: indices count from 0, got {negative}")
            duplicates = sorted({i for i in self.layers if self.layers.count(i) > 1})
            if duplicates:
                raise ValueError(f"layers: index {duplicates[0]} appears more than once in {self.layers}")
        if not self.train.distill and self.heal is None:
            raise ValueError(
                "train.distill is false and there is no heal: section, so nothing would train; add a heal: section "
                "or set train.distill: true"
            )


# ----------------------------------------------------------------------------------------------------------------
# Resolution against the base model


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


def resolve_layer_spec(layer: LayerConfig, shape: MlpShape) -> SparseSpec:
    """Build the validated sparse layer spec for one MLP of shape `shape` from the recipe's `layer:` section."""
    spec_cls = LAYER_KINDS[layer.kind][0]
    spec_fields = _spec_field_names(layer.kind)
    fields: dict[str, Any] = {"kind": layer.kind, "d_in": shape.d_model, "d_out": shape.d_model}
    if "k" in spec_fields:
        fields["k"] = layer.k
    derived = ""
    if "d_hidden" in spec_fields:
        fields["d_hidden"] = layer.d_hidden if layer.d_hidden is not None else shape.d_hidden
    if "encoder" in spec_fields:
        fields["encoder"] = ("glu" if shape.glu else "mlp") if layer.encoder == "auto" else layer.encoder
    if "activation" in spec_fields:
        fields["activation"] = _auto_activation(shape) if layer.activation == "auto" else layer.activation
    if layer.kind == "moe_x":
        fields.update(_moe_x_fields(layer, shape))
    fields.update(layer.options)

    units, match_field = layer.units_field, _match_field(layer.kind)
    if getattr(layer, units) is not None:
        fields[units] = getattr(layer, units)
    if layer.match_transcoder is None:
        pass
    elif units == "num_latents":
        fields[units] = round(layer.match_transcoder * shape.d_model)
        derived = (
            f" ({units}={fields[units]} = round(layer.match_transcoder={layer.match_transcoder} x "
            f"d_in={shape.d_model}))"
        )
    elif layer.kind == "mxd":
        try:
            fields[units] = mxd_experts_for_transcoder(
                shape.d_model,
                shape.d_model,
                fields["d_hidden"],
                layer.match_transcoder,
                encoder=fields["encoder"],
                encoder_bias=fields.get("encoder_bias", True),
                convention=layer.match_convention,
            )
        except ValueError as e:
            raise RecipeError(f"layer.match_transcoder={layer.match_transcoder}: {e}") from None
        derived = (f" ({units}={fields[units]} was matched to a {layer.match_transcoder}x transcoder by "
                   f"layer.match_transcoder, convention {layer.match_convention!r})")
    else:
        latents = round(layer.match_transcoder * shape.d_model)
        target = TranscoderSpec(d_in=shape.d_model, d_out=shape.d_model, num_latents=latents, k=1).num_parameters()
        spec_kwargs = {name: value for name, value in fields.items() if name != "kind"}
        try:
            fields[match_field] = match_parameter_count(spec_cls, spec_kwargs, match_field, target)
        except ValueError as e:
            raise RecipeError(f"layer.match_transcoder={layer.match_transcoder}: {e}") from None
        derived = (f" ({match_field}={fields[match_field]} is the largest value within a "
                   f"{layer.match_transcoder}x transcoder's {target:,} parameters)")
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


def _moe_x_fields(layer: LayerConfig, shape: MlpShape) -> dict[str, Any]:
    """MoE-X fields the recipe derives from the base MLP (layer.options still override them).

    Experts mirror the MLP's form (GLU experts for gated MLPs, encoder biases where the MLP has them) and its width:
    d_expert = ceil(H / M) (the dense width split over the experts), or H for init: copy. M is layer.num_experts, or
    the spec's default 8 when layer.match_transcoder chooses M (then set options.d_expert to size experts yourself). `activation: auto` keeps
    the MLP's activation when the weights come from it (an exact split / copy) and is MoE-X's ReLU otherwise; the
    GELU/SiLU -> ReLU switch of an upcycled layer is explicit (activation: relu), and its cost before training is in
    metrics.json["init"].
    """
    num_experts = layer.num_experts if layer.num_experts is not None else _field_default(
        LAYER_KINDS["moe_x"][0], "num_experts")
    return {
        "d_expert": shape.d_hidden if layer.init == "copy" else math.ceil(shape.d_hidden / num_experts),
        "expert_glu": shape.glu,
        "expert_bias": not shape.glu,  # GPT-2 / Pythia MLPs have biases, Llama-like gated ones do not
        # split with k < M: K · softmax keeps the experts' scale while the router still gets a gradient.
        "gate_scaling": "k_softmax" if layer.init == "split" else "softmax",
        "activation": (
            ("relu" if layer.init == "default" else _auto_activation(shape))
            if layer.activation == "auto" else layer.activation
        ),
    }


def _auto_activation(shape: MlpShape) -> str:
    try:
        return canonical_activation(shape.activation)
    except ValueError:
        raise RecipeError(
            f"layer.activation: 'auto' cannot use the base MLP's activation {shape.activation!r}, which the sparse "
            "layers do not implement; set layer.activation to one of gelu, gelu_new, relu, silu"
        ) from None


# ----------------------------------------------------------------------------------------------------------------
# Loading and saving


def load_recipe(path: str | os.PathLike, overrides: Iterable[str] = ()) -> Recipe:
    """Read a recipe file strictly, apply `--set` style overrides ("train.lr=3e-4", "layers=[2,3]"), expand
    ${ENV_VARS} in strings and validate every key and value."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"recipe file {str(path)!r} does not exist (relative to {os.getcwd()!r})") from None
    try:
        tree = yaml.load(text, Loader=_RecipeLoader)
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if tree is None:
        raise RecipeError(f"{path}: the recipe is empty; start from one of the shipped recipes (recipes/*.yaml)")
    return recipe_from_dict(tree, overrides, source=str(path))


def recipe_from_dict(tree: Mapping[str, Any], overrides: Iterable[str] = (), source: str = "<recipe>") -> Recipe:
    """`load_recipe` for an already-parsed mapping; `source` names it in error messages."""
    src = _Source(source)
    if not isinstance(tree, Mapping):
        raise RecipeError(f"{source}: a recipe is a mapping of sections (base_model:, layers:, ...), got "
                          f"{type(tree).__name__}")
    tree = copy.deepcopy(dict(tree))
    for override in overrides:
        _apply_override(tree, override, src)
    tree = _expand_env(tree, "", src)
    return _build(Recipe, tree, "", src)


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain, YAML/JSON-able dict of every field (defaults included, env vars expanded); `recipe_from_dict` of it
    gives an equal Recipe."""
    return _plain(recipe)


def save_recipe(recipe: Recipe, path: str | os.PathLike) -> None:
    """Write `recipe_to_dict(recipe)` as YAML (e.g. `recipe.resolved.yaml` in the output folder)."""
    text = yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=None, allow_unicode=True)
    Path(path).write_text(text, encoding="utf-8")


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass, by field name (for --help and error messages)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that reads 3e-4 as a float (YAML 1.2; PyYAML's 1.1 rules need a dot) and rejects duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class _Source:
    """Where recipe values come from, for error messages: the file, or the `--set` override that set a key."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.overrides: dict[str, str] = {}

    def where(self, key: str) -> str:
        for set_key, text in reversed(self.overrides.items()):
            if key == set_key or key.startswith(set_key + ".") or key.startswith(set_key + "["):
                return f"--set {text}"
        return self.name

    def error(self, key: str, message: str) -> RecipeError:
        return RecipeError(f"{self.where(key)}: {message}")


def _apply_override(tree: dict[str, Any], text: str, src: _Source) -> None:
    key, sep, raw_value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"--set {text}: expected KEY=VALUE with a dotted key, e.g. train.lr=3e-4 or layers=[2,3]")
    try:
        value = yaml.load(raw_value, Loader=_RecipeLoader)
    except yaml.YAMLError as e:
        raise RecipeError(f"--set {text}: the value is not valid YAML: {e}") from None
    parts = key.split(".")
    where = f"--set {text}"
    tp: Any = Recipe
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i])
        cls = _dataclass_in(tp)
        if cls is not None:
            names = _init_field_names(cls)
            if part not in names:
                raise RecipeError(f"{where}: {_unknown_key_message(prefix, part, names)}")
            tp = get_type_hints(cls)[part]
        elif get_origin(_strip_optional(tp)) in (dict, Mapping):
            tp = get_args(_strip_optional(tp))[1] if get_args(_strip_optional(tp)) else Any
        else:
            raise RecipeError(f"{where}: {prefix!r} is a value, not a section; set it with --set {prefix}=VALUE")
    node = tree
    for part in parts[:-1]:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise RecipeError(f"{where}: cannot set {key!r}: {part!r} holds {node!r} in {src.name}, not a section")
    node[parts[-1]] = value
    src.overrides[key] = text


_ENV_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ENV_VAR_HINTS = {"EXPERTIZE_DATA": "/path/to/data, the folder holding models/ and corpora/"}


def _expand_env(value: Any, key: str, src: _Source) -> Any:
    """Replace ${NAME} by the environment variable NAME in every string of the tree (keys left alone)."""
    if isinstance(value, dict):
        return {k: _expand_env(v, _join(key, k), src) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{key}[{i}]", src) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        name = match[1]
        found = os.environ.get(name)
        if not found:
            state = "is not set" if found is None else "is empty"
            what = _ENV_VAR_HINTS.get(name, "...")
            raise src.error(
                key,
                f"{key}: {value!r} uses the environment variable {name}, which {state}; set it "
                f"(export {name}={what}) or give the value with --set {key}=...",
            )
        return found

    return _ENV_VAR.sub(substitute, value)


def _build(cls: type, raw: Any, prefix: str, src: _Source) -> Any:
    """Instantiate dataclass `cls` from the mapping `raw` at dotted key `prefix`, checking every key and type."""
    if raw is None:  # a section whose keys are all commented out
        raw = {}
    if not isinstance(raw, Mapping):
        raise src.error(
            prefix, f"{prefix}: expected a section (a mapping of keys), got {raw!r} ({type(raw).__name__})"
        )
    names = _init_field_names(cls)
    for name in raw:
        if name not in names:
            raise src.error(_join(prefix, str(name)), _unknown_key_message(prefix, str(name), names))
    hints = get_type_hints(cls)
    kwargs, missing = {}, []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = _join(prefix, f.name)
        if f.name in raw:
            try:
                kwargs[f.name] = _coerce(raw[f.name], hints[f.name], key, src)
            except _Mismatch as e:
                raise src.error(e.key, str(e)) from None
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            missing.append(f.name)
    if missing:
        docs = field_docs(cls)
        listed = "; ".join(f"{_join(prefix, name)} ({docs.get(name, 'no description')})" for name in missing)
        raise RecipeError(f"{src.name}: missing required key(s): {listed}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, OSError) as e:
        message = str(e)
        if prefix and not message.startswith((prefix + ".", prefix + ":", prefix + " ")):
            message = f"{prefix}: {message}"
        touched = [text for key, text in src.overrides.items() if not prefix or key.split(".")[0] == prefix]
        where = src.name + (f" with --set {' --set '.join(touched)}" if touched else "")
        raise RecipeError(f"{where}: {message}") from None


class _Mismatch(Exception):
    def __init__(self, key: str, value: Any, expected: str, hint: str = "") -> None:
        super().__init__(f"{key}: expected {expected}, got {value!r} ({type(value).__name__}){hint}")
        self.key = key


_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
_PLURALS = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


def _describe(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if tp in _NAMES:
        return _NAMES[tp]
    if origin is Literal:
        if len(args) == 1:
            return repr(args[0])
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {_PLURALS[args[0]]}" if args and args[0] in _PLURALS else "a list"
    if dataclasses.is_dataclass(tp):
        return "a section (a mapping of keys)"
    if origin in (dict, Mapping):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, src: _Source) -> Any:
    """`value` checked against the type hint `tp` (and converted: int -> float, integral float -> int, lists)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(value, option, key, src)
            except _Mismatch as e:
                errors.append((option, e))
        # A list with a bad item: report the item, not the whole union.
        for option, error in errors:
            if isinstance(value, list) and get_origin(option) in (list, tuple) and error.key != key:
                raise error
        raise _Mismatch(key, value, _describe(tp), _list_hint(value, options))
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        hint = _did_you_mean(value, [a for a in args if isinstance(a, str)]) if isinstance(value, str) else ""
        raise _Mismatch(key, value, _describe(tp), hint)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            item_type = args[0] if args else Any
            items = [_coerce(v, item_type, f"{key}[{i}]", src) for i, v in enumerate(value)]
            return items if origin is list else tuple(items)
        raise _Mismatch(key, value, _describe(tp), _list_hint(value, [tp]))
    elif origin in (dict, Mapping) or tp in (dict, Mapping):
        if isinstance(value, Mapping):
            key_type, value_type = args if args else (Any, Any)
            return {
                _coerce(k, key_type, _join(key, str(k)), src): _coerce(v, value_type, _join(key, str(k)), src)
                for k, v in value.items()
            }
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping) or value is None:
            return _build(tp, value, key, src)
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        return value
    raise _Mismatch(key, value, _describe(tp))


def _list_hint(value: Any, options: list[Any]) -> str:
    if isinstance(value, (str, int, float)) and any(get_origin(o) in (list, tuple) for o in options):
        return f"; for a single item write [{value}]"
    return ""


def _check_field_types(obj: Any, prefix: str) -> None:
    """Type-check (and normalize) the fields of a dataclass built directly in Python, not through the loader."""
    hints = get_type_hints(type(obj))
    src = _Source("<python>")
    for f in dataclasses.fields(obj):
        try:
            setattr(obj, f.name, _coerce(getattr(obj, f.name), hints[f.name], _join(prefix, f.name), src))
        except _Mismatch as e:
            raise ValueError(str(e)) from None


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(f"cannot serialise the non-finite number {value}")
    return value


# ----------------------------------------------------------------------------------------------------------------
# Small helpers


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_key_message(prefix: str, name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f" (did you mean {_join(prefix, close[0])!r}?)" if close else ""
    if not hint:  # a key put in the wrong section: `lr:` at the top level -> train.lr
        elsewhere = [key for key in _all_keys(Recipe) if key.rsplit(".", 1)[-1] == name]
        if elsewhere:
            hint = f" (did you mean {elsewhere[0]!r}?)"
    under = f"under {prefix!r}" if prefix else "at the top level"
    return f"unknown key {_join(prefix, name)!r}{hint}; valid keys {under}: {', '.join(names)}"


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    hints = get_type_hints(cls)
    for name in _init_field_names(cls):
        key = _join(prefix, name)
        keys.append(key)
        inner = _dataclass_in(hints[name])
        if inner is not None:
            keys.extend(_all_keys(inner, key))
    return keys


def _init_field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _dataclass_in(tp: Any) -> type | None:
    tp = _strip_optional(tp)
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _field_default(cls: type, name: str) -> Any:
    """The field's default (dataclasses.MISSING when it has none)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _match_field(kind: str) -> str | None:
    """The spec field that parameter matching (layer.match_transcoder) chooses: the unit count unless the spec
    names another (`match_field`, e.g. μMoE's rank)."""
    spec_cls = LAYER_KINDS[kind][0]
    names = _spec_field_names(kind)
    units = next((name for name in ("num_experts", "num_latents") if name in names), None)
    return getattr(spec_cls, "match_field", units)


def _spec_field_names(kind: str) -> set[str]:
    return {f.name for f in dataclasses.fields(LAYER_KINDS[kind][0])}
