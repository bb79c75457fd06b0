"""The recipe's `variants:` list: several sparse layers trained on one activation stream, one model folder each.

    layer: {kind: mxd, k: 32, match_transcoder: 8}
    train: {lr: 1e-3, ...}
    output_dir: runs/sweep
    variants:
      - name: mxd-k32                                   # -> runs/sweep/mxd-k32/ (a complete model folder)
      - name: mxd-k8
        layer: {k: 8}                                   # merged over the recipe's layer: section
      - name: transcoder-k32
        layer: {kind: transcoder, match_transcoder: 8}  # another kind: replaces the layer: section
        train: {lr: 3e-3}                               # optimizer keys only (VARIANT_TRAIN_KEYS)

Each variant is an ordinary recipe (`loader.variant_recipes`): the recipe without `variants:`, its `layer:` section merged
with (or, when it names another kind, replaced by) the variant's, its optimizer keys overridden, and
`output_dir/NAME` as output folder. Its folder's recipe.resolved.yaml is that recipe, and training it alone with
`expertize upcycle` gives the same weights (tests/test_variants.py): `expertize upcycle` trains all variants in one
pass over the captured activations (`training.engine.train_together`) instead of capturing them once per variant.

What a variant may change is what does not change the activation stream: the sparse layer, and the optimizer of
its own parameters. Everything that decides which tokens arrive at which step (data, train.tokens_per_step,
train.seed, the shuffle) and what is shared (base model, layers, heal, eval, devices, checkpoint cadence) is the
recipe's.

An empty list (`variants: []`) means one model, as if the key were absent, and is not refused: `--set variants=[]` is
how a sweep recipe trains its own `layer:` section alone, and a resolved one-model recipe leaves the key out
(`recipe_to_dict`).
"""

import dataclasses
import re
from typing import Any

from .coerce import check_field_types, did_you_mean

__all__ = ["VARIANT_TRAIN_KEYS", "VariantConfig"]

VARIANT_TRAIN_KEYS = (
    "lr", "warmup_steps", "schedule", "min_lr_ratio", "betas", "weight_decay", "grad_clip", "loss", "precision",
    "auxk_coef", "auxk_k", "dead_window_tokens", "balance", "balance_rate", "balance_floor", "balance_anneal",
    "resample_every_tokens", "code_share_floor", "code_share_coef", "preact_coef",
    "threshold_lr_scale",
)
"""The `train:` keys a variant may set: its own optimizer and loss. The others fix the shared activation stream or
the run's cadence or its arithmetic (tokens_per_step, seed, shuffle_buffer_tokens, capture_batch_sequences,
capture_precision, tf32, compile, checkpoint_every, log_every, device, distill, log_with)."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclasses.dataclass
class VariantConfig:
    """One variant of the recipe's sparse layer (an item of `variants:`)."""

    name: str
    """Its folder under output_dir (letters, digits, '.', '_', '-'), and its name in logs and tables."""

    layer: dict[str, Any] = dataclasses.field(default_factory=dict)
    """`layer:` keys of this variant, merged over the recipe's `layer:` section; naming another `kind` replaces the
    section instead (one kind's fields rarely fit another)."""

    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    """`train:` keys of this variant's optimizer (one of VARIANT_TRAIN_KEYS), over the recipe's."""

    def __post_init__(self) -> None:
        check_field_types(self, "variants")
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"name {self.name!r} is not a folder name; use letters, digits, '.', '_' and '-' "
                "(e.g. mxd-k32)"
            )
        for key in self.train:
            if key not in VARIANT_TRAIN_KEYS:
                raise ValueError(
                    f"train.{key}: variant {self.name!r} cannot set train.{key}; a variant sets only its own "
                    f"optimizer ({', '.join(VARIANT_TRAIN_KEYS)}){did_you_mean(key, VARIANT_TRAIN_KEYS)}. The other "
                    "train: keys are shared by all variants (they train on one activation stream, step by step): "
                    "set them in the recipe's train: section, or write a separate recipe"
                )


def check_variants(variants: list[VariantConfig], distill: bool) -> None:
    """Whole-list checks of `Recipe.variants` (unique names; distillation on)."""
    names = [v.name for v in variants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"variants: the name {duplicates[0]!r} appears more than once; each variant needs its own")
    if variants and not distill:
        raise ValueError(
            "variants: need train.distill: true (variants share the distillation's activation stream); with "
            "train.distill: false write one recipe per model"
        )
