"""Stacking: a run whose `base_model` is itself an expertize model (a folder of an earlier run).

One recipe converts its layers with one kind; a model with different kinds at different layers is made in steps, each
run starting from the folder of the last (docs/upcycle.md#stacking). Each run distils its MLPs from the model it starts
from, so its own ΔCE is measured against that intermediate model; what the whole model costs is measured against the
dense model the chain started from, the *original*:

    dense ──run 1──► folder A (layer 1 sparse) ──run 2──► folder B (layers 1 and 2 sparse)
                     provenance: base_model = dense           provenance: base_model = A

metrics.json["stacking"] (`stacking_metrics`) records the layers the base already had, the original model and the
final model's CE against it; the card and the end-of-run summary read it. A layer that is already sparse in the base
is refused (`check_not_sparse`): distilling it would imitate the sparse layer, not the dense MLP.
"""

import math
import os
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ExpertizeError
from ..publishing.model_folder import recorded_base_model
from ..surgery.families import EXPERTIZE_PREFIX
from ..surgery.splice import load_base_model, local_model_type
from ..training.losses import next_token_ce

__all__ = ["STACKING_DOCS", "base_sparse_layers", "check_not_sparse", "original_base_model", "stacking_metrics"]

STACKING_DOCS = "docs/upcycle.md#stacking"
MAX_CHAIN = 32
"""Folders followed back to the original at most (a provenance loop is reported, not followed forever)."""


def base_sparse_layers(config) -> dict[int, str]:
    """The layers a base model's config already has as sparse layers: index -> kind ({} for a dense base)."""
    return {int(i): str(spec.get("kind")) for i, spec in (getattr(config, "sparse_layers", None) or {}).items()}


def original_base_model(base_model: str) -> str | None:
    """The dense model a chain of expertize folders started from, following each folder's recorded base model
    (provenance.json, else recipe.resolved.yaml); `base_model` itself when it is not an expertize folder, None when a
    folder of the chain records no base (made by save_model)."""
    current = base_model
    for _ in range(MAX_CHAIN):
        if not local_model_type(os.path.expanduser(current)).startswith(EXPERTIZE_PREFIX):
            return current
        current = recorded_base_model(os.path.expanduser(current))
        if current is None:
            return None
    return None


def check_not_sparse(base_model: str, config, layer_ids: list[int]) -> None:
    """Refuse layers that are already sparse in the base model: their `.mlp` is a sparse layer, so distillation would
    imitate it (a copy of a copy), not the dense MLP."""
    inherited = base_sparse_layers(config)
    again = sorted(set(layer_ids) & set(inherited))
    if not again:
        return
    kinds = ", ".join(f"layer {i}: {inherited[i]}" for i in again)
    dense = [i for i in range(config.num_hidden_layers) if i not in inherited]
    original = original_base_model(base_model)
    start_over = f"the dense model it was made from ({original})" if original else "a dense model"
    raise ExpertizeError(
        f"layers {again} of base_model {base_model!r} are already sparse ({kinds}, from an earlier run): distilling "
        f"them again would imitate that sparse layer, not the dense MLP. List only dense layers (here {dense}) to add "
        f"sparse layers to this model ({STACKING_DOCS}), or start from {start_over} to convert them anew"
    )


@torch.no_grad()
def _mean_ce(model: torch.nn.Module, eval_sequences: torch.Tensor, batch_sequences: int) -> float:
    """Mean next-token CE (nats) of `model` on (S, L) sequences, as the evaluation's `ce.*` entries average it: over
    every predicted token."""
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    for start in range(0, eval_sequences.shape[0], batch_sequences):
        input_ids = eval_sequences[start : start + batch_sequences].to(device)  # (B, L)
        logits = model(input_ids=input_ids, use_cache=False).logits  # (B, L, V)
        total += float(next_token_ce(logits, input_ids).double().sum())
        tokens += input_ids.shape[0] * (input_ids.shape[1] - 1)
    return total / max(tokens, 1)


def stacking_metrics(
    base_model: str,
    config,
    eval_sequences: torch.Tensor,
    spliced_ce: float | None,
    *,
    batch_sequences: int,
    dtype: torch.dtype,
    device: torch.device,
    log: Callable[[str], None] = lambda message: None,
) -> dict[str, Any] | None:
    """metrics.json["stacking"] for a run on an expertize base (None for a dense base): the base's sparse layers,
    the original dense model, its CE on the run's held-out sequences and the final model's ΔCE against it
    (`spliced_ce` − that CE). The original is loaded on `device` for one pass; where it cannot be found or loaded its
    CE is null and `log` says why."""
    inherited = base_sparse_layers(config)
    if not inherited:
        return None
    original = original_base_model(base_model)
    record: dict[str, Any] = {
        "base_sparse_layers": {str(i): kind for i, kind in sorted(inherited.items())},
        "original_base_model": original,
        "original_ce": None,
        "delta_original": None,
    }
    if original is None:
        log(f"base_model {base_model} is an expertize model that records no base model, so the cost against the "
            "original dense model is not measured")
        return record
    try:
        model = load_base_model(original, dtype=dtype).to(device).eval()
    except (OSError, ValueError) as e:
        log(f"the original dense model {original} could not be loaded ({e}); the cost against it is not measured")
        return record
    ce = _mean_ce(model, eval_sequences, batch_sequences)
    del model
    record["original_ce"] = ce
    if spliced_ce is not None and math.isfinite(spliced_ce):
        record["delta_original"] = spliced_ce - ce
    return record

