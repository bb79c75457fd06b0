"""Where the base model's modules live: one device (the default), or spread over devices and disk with accelerate's
big-model loading (the recipe's `device_map`, `max_memory`, `offload_folder`, transformers' own names).

`resolve_placement` turns the recipe's keys into the explicit {module: device} map that loading will use — a named
strategy ("auto", "balanced", "balanced_low_0", "sequential") is resolved here the way transformers resolves it, on
a weightless copy of the model — and refuses, before any weight is read, a map that cannot run what the run asks:
a target layer's MLP must *run* where it is placed, since its input and output are captured there and its module
is swapped for the sparse layer in the evaluation. A module offloaded to "disk" (or to "cpu" in a map with
accelerators, where accelerate streams its weights to the accelerator at each forward) is only a weight store.
The sparse layers train on train.device; captured activations are moved there.
"""

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ExpertizeError
from .families import family_info

__all__ = ["BasePlacement", "PlacementError", "is_dispatched", "resolve_placement"]

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
OFFLOADED = "disk"


class PlacementError(ExpertizeError, ValueError):
    """The recipe's device_map / max_memory / offload_folder cannot place the base as the run needs."""


@dataclass(frozen=True)
class BasePlacement:
    """The explicit map the base loads with, and the rest of accelerate's loading arguments."""

    device_map: dict[str, Any]
    max_memory: dict | None
    offload_folder: str | None

    def load_kwargs(self) -> dict[str, Any]:
        """`from_pretrained` keyword arguments."""
        kwargs: dict[str, Any] = {"device_map": self.device_map}
        if self.max_memory is not None:
            kwargs["max_memory"] = self.max_memory
        if self.offload_folder is not None:
            kwargs["offload_folder"] = self.offload_folder
        return kwargs

    @property
    def offloads(self) -> bool:
        return OFFLOADED in self.device_map.values()

    def record(self) -> dict[str, Any]:
        """For provenance.json: which device held which modules (devices as strings)."""
        return {"device_map": {k: str(v) for k, v in self.device_map.items()}}


def is_dispatched(model) -> bool:
    """Whether `model` was loaded with a device map (accelerate's hooks move its tensors; never `.to()` it)."""
    return getattr(model, "hf_device_map", None) is not None


def _max_memory(given: dict | None) -> dict | None:
    """YAML keys as accelerate reads them: GPU indices as ints ("0" -> 0), "cpu" / "disk" / "mps" as they are."""
    if given is None:
        return None
    return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in given.items()}


def resolve_placement(recipe, config, layer_ids: list[int]) -> BasePlacement | None:
    """The base's placement for `recipe` (None without `device_map`), checked against `layer_ids`."""
    if recipe.device_map is None:
        for key in ("max_memory", "offload_folder"):
            if getattr(recipe, key) is not None:
                raise PlacementError(f"{key} is set but device_map is not; it applies only to a base spread with "
                                     "device_map (auto, balanced, balanced_low_0, sequential or a map)")
        return None
    if recipe.heal is not None:
        raise PlacementError(
            "device_map with a heal: section: healing trains the whole spliced model on train.device, so it needs "
            "the base there; remove the heal: section or device_map"
        )
    if recipe.eval.lm_eval_tasks:
        raise PlacementError(
            "device_map with eval.lm_eval_tasks: lm-evaluation-harness runs the models on train.device; run "
            "`expertize eval OUTPUT_DIR` afterwards on a machine that holds the model, or remove device_map"
        )
    max_memory = _max_memory(recipe.max_memory)
    device_map = recipe.device_map
    if isinstance(device_map, str):
        device_map = _inferred_map(config, device_map, max_memory, getattr(torch, recipe.dtype))
    else:
        device_map = {k: int(v) if isinstance(v, str) and v.isdigit() else v for k, v in device_map.items()}
    placement = BasePlacement(device_map=device_map, max_memory=max_memory, offload_folder=recipe.offload_folder)
    _check_targets(placement, config, layer_ids, given=recipe.device_map)
    if placement.offloads and not placement.offload_folder:
        raise PlacementError(
            "device_map places modules on disk but offload_folder is not set; set offload_folder to a folder with "
            "room for them (or give the devices more max_memory)"
        )
    if placement.offload_folder:
        os.makedirs(placement.offload_folder, exist_ok=True)
    return placement


def _inferred_map(config, strategy: str, max_memory: dict | None, dtype: torch.dtype) -> dict:
    """transformers' own resolution of a named strategy, on the model built on the meta device (no weights)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.accelerate import _get_device_map

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return dict(_get_device_map(model, strategy, max_memory, None))


def _executing(device: Any, accelerators: bool) -> bool:
    """Whether a module placed on `device` runs there (rather than being streamed from it)."""
    if device == OFFLOADED:
        return False
    return not (accelerators and str(device) == "cpu")


def _check_targets(placement: BasePlacement, config, layer_ids: list[int], *, given) -> None:
    """Refuse a map that leaves a target layer's MLP (or any module in it) on a weight store."""
    blocks = family_info(config.model_type).blocks_path
    devices = placement.device_map
    accelerators = any(str(d) not in ("cpu", OFFLOADED) for d in devices.values())
    for i in layer_ids:
        mlp = f"{blocks}.{i}.mlp"
        covering = {name: d for name, d in devices.items()
                    if name == "" or mlp == name or mlp.startswith(name + ".") or name.startswith(mlp + ".")}
        if not covering:
            raise PlacementError(f"device_map names no device for layer {i}'s MLP ({mlp}); map it, or one of its "
                                 f"parents, e.g. {blocks}.{i}")
        stored = {name: d for name, d in covering.items() if not _executing(d, accelerators)}
        if stored:
            where = ", ".join(f"{name or '(the whole model)'} -> {d}" for name, d in sorted(stored.items()))
            how = "the map you gave" if isinstance(given, dict) else f"device_map: {given} resolved to"
            raise PlacementError(
                f"{how} {where}: layer {i} is a target layer, and its MLP must run where it is placed (its input "
                "and output are captured there), not be streamed from "
                f"{'disk' if OFFLOADED in stored.values() else 'the CPU'}; give that device more max_memory, or "
                f"place {blocks}.{i} on a device explicitly"
            )
