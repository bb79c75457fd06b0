"""What a run folder records about how it was made: provenance.json and the card's Training rows.

Both are written once per run (`upcycle.publish`); the card and `expertize eval` read them back from the folder.
"""

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from expertize import __version__

from ..recipe.data import token_budget_to_sequences
from ..recipe import Recipe
from ..recipe.schedule_rule import ResolvedSchedule
from .local_paths import base_model_provenance, hub_id_of, packaged_name
from .run_folder import MODEL_CARD

EXAMPLE_PROMPT_TOKENS = 8
"""Tokens of held-out text in the card's generation example."""

PACKAGES = ("torch", "transformers", "accelerate", "datasets", "safetensors", "huggingface-hub", "peft", "lm-eval")


def recipe_summary(
    recipe: Recipe, total_steps: int, schedule: ResolvedSchedule, heal_schedule: ResolvedSchedule | None = None
) -> dict:
    """The card's Training rows (kept in metrics.json, so that a card refreshed later shows them too): `schedule`
    is the distillation's as its plan resolved it (training/distill_plan.py), `heal_schedule` the healing's."""
    data, train, heal = recipe.data, recipe.train, recipe.heal
    # A Hub dataset by its id; local files as such (never mistaken for Hub datasets).
    source = f"Hub dataset {data.name}" if data.source == "hub" else (
        "local text: " + ", ".join(Path(p).name for p in data.paths))
    healing = {}
    if heal is not None:
        if heal_schedule is None:
            raise ValueError("a recipe with a heal: section needs the healing's resolved schedule (heal_schedule)")
        rest = f"LoRA r={heal.lora_r} on {heal.lora_target_modules}, merged" if heal.rest == "lora" else "frozen"
        healing = {
            "healing": f"end to end, {heal.objective} objective, {heal.tokens:,} tokens, lr {heal.lr}, "
            f"{_warmup_and_decay(heal_schedule)}; rest of the model {rest}",
        }
    return {
        "training tokens": total_steps * train.tokens_per_step,
        "steps": total_steps,
        "tokens per step": train.tokens_per_step,
        "context length": data.context_length,
        "data": source,
        "loss": train.loss,
        "optimizer": f"AdamW (lr {_lr(train.lr, schedule)}, {_warmup_and_decay(schedule)})",
        "precision": train.precision,
        "seed": train.seed,
        **healing,
    }


def _lr(given, schedule: ResolvedSchedule) -> str:
    """The peak learning rate as the card shows it: "auto (0.01)" when the rule chose it, else as the recipe gave it."""
    return f"auto ({schedule.lr:.3g})" if schedule.lr_auto else f"{given}"


def _warmup_and_decay(schedule: ResolvedSchedule) -> str:
    """The warm-up and the decay as the card shows them: "warmup auto (20), cosine to 0.1 lr" when the rule chose
    the warm-up, "warmup 5000, constant" for a number."""
    warmup = f"auto ({schedule.warmup_steps})" if schedule.warmup_auto else f"{schedule.warmup_steps}"
    return f"warmup {warmup}, {schedule.decay()}"


def provenance(recipe: Recipe, *, device: torch.device | str | None = None, compute: dict | None = None) -> dict:
    """Versions, seed, git commit, the base model (as given, and its Hub id when it came from the Hub), the device
    the run actually trained on and how its arithmetic ran there (`compute`: training/compute.py's
    `compute_record`: TF32, the capture's and the layers' precision, attention kernel, AdamW kernel, compile)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "expertize": __version__,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "packages": versions,
        "seed": recipe.train.seed,
        **base_model_provenance(recipe.base_model),
        "base_revision": recipe.base_revision,
        "base_license": base_license(recipe.base_model, recipe.base_revision),
        "device": None if device is None else str(device),
        "compute": compute,
        "eval_sequences_per_token_budget": token_budget_to_sequences(recipe.data.eval_tokens, recipe.data.context_length),
    }


def base_license(base_model: str, revision: str | None = None) -> str | None:
    """The license of the base model as its own card states it (the `license:` metadata of its README.md: a local
    folder's, or a Hub model's README in the local Hugging Face cache; nothing is downloaded); for the model shipped
    with expertize, expertize's license. None when unknown: the card then asks the user to fill it in."""
    if packaged_name(base_model):
        return (metadata.metadata("expertize").get("License-Expression") or "").lower() or None
    readme = Path(os.path.expanduser(base_model)) / MODEL_CARD
    if not readme.is_file():
        hub_id = hub_id_of(base_model)
        if hub_id is None:
            return None
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(hub_id, MODEL_CARD, revision=revision)
        if not isinstance(cached, str):
            return None
        readme = Path(cached)
    from huggingface_hub import ModelCard

    try:
        license_ = ModelCard.load(readme).data.license
    except (OSError, ValueError):
        return None
    return license_ if isinstance(license_, str) and license_ and license_ != "unknown" else None


def example_prompt(eval_sequences: torch.Tensor, tokenizer, tokens: int = EXAMPLE_PROMPT_TOKENS) -> str | None:
    """The first `tokens` tokens of held-out text (special tokens left out), decoded: a generation example that fits
    the model's data (the card's loading snippet). None when there is no text."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [int(t) for t in eval_sequences[0].tolist() if int(t) not in special][:tokens] if len(eval_sequences) else []
    text = tokenizer.decode(ids).strip() if ids else ""
    return text or None


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
