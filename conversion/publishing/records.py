"""What a run folder records about how it was made: provenance.json and the card's Training rows.

Both are written once per run (`upcycle.publish`); the card and `expertize eval` read them back from the folder.
"""

import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from expertize import __version__

from ..recipe.data import token_budget_to_sequences
from ..recipe import Recipe
from .local_paths import base_model_provenance

PACKAGES = ("torch", "transformers", "accelerate", "datasets", "safetensors", "huggingface-hub", "peft", "lm-eval")


def recipe_summary(recipe: Recipe, total_steps: int) -> dict:
    """The card's Training rows (kept in metrics.json, so that a card refreshed later shows them too)."""
    data, train, heal = recipe.data, recipe.train, recipe.heal
    source = data.name if data.source == "hub" else ", ".join(Path(p).name for p in data.paths)
    healing = {}
    if heal is not None:
        rest = f"LoRA r={heal.lora_r} on {heal.lora_target_modules}, merged" if heal.rest == "lora" else "frozen"
        healing = {
            "healing": f"end to end, {heal.objective} objective, {heal.tokens:,} tokens, lr {heal.lr}; rest of the "
            f"model {rest}",
        }
    return {
        "training tokens": total_steps * train.tokens_per_step,
        "steps": total_steps,
        "tokens per step": train.tokens_per_step,
        "context length": data.context_length,
        "data": f"{data.source}: {source}",
        "loss": train.loss,
        "optimizer": f"AdamW (lr {train.lr}, warmup {train.warmup_steps}, {train.schedule})",
        "precision": train.precision,
        "seed": train.seed,
        **healing,
    }


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
        "device": None if device is None else str(device),
        "compute": compute,
        "eval_sequences_per_token_budget": token_budget_to_sequences(recipe.data.eval_tokens, recipe.data.context_length),
    }


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
