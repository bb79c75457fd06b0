"""delphi's latent cache (EleutherAI/delphi, automated interpretability): every non-zero activation of every sparse
layer over named corpora, the input of delphi's explainers and scorers.

delphi explains and scores latents from a cache of every non-zero activation, written by its `LatentCache.save_splits`
and read by its `LatentDataset` / `TensorBuffer` (delphi/latents/cache.py, loader.py). Per hookpoint (the MLP's module
path below the base model, e.g. `layers.3.mlp`: what delphi's own caching names it):

    OUT/<hookpoint>/<start>_<end>.safetensors    latents start..end (inclusive), `n_splits` files covering all units
        "locations"    (F, 3) uint16 (uint32 when a sequence index or a latent offset reaches 2**16):
                       (sequence index into "tokens", position, latent id - start)
        "activations"  (F,) float16
        "tokens"       (S, T) int64, every sequence read (the same in each file)
    OUT/<hookpoint>/config.json                  delphi's CacheConfig fields + "model_name": a loadable name of the
                                                 base model (delphi's loader reads its tokenizer from there)

The activations are the folder's own sparse code (what `expertize inspect` reads), so every kind exports: no format
question arises. delphi's command line cannot load `trust_remote_code` models; its Python path (`LatentDataset` ->
an explainer and a scorer with your own client) reads this cache: docs/export.md#delphi.
"""

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from .expressible import ExportError, hookpoint
from .endpoints import base_model_name, checked_source, staged_output

__all__ = ["delphi_cache_from_folder", "export_delphi", "split_ranges"]


def split_ranges(width: int, n_splits: int) -> list[tuple[int, int]]:
    """delphi's `_generate_split_indices`: inclusive (start, end) latent ranges of `n_splits` near-equal parts."""
    bounds = torch.linspace(0, width, steps=n_splits + 1).long().tolist()
    return list(zip(bounds[:-1], [b - 1 for b in bounds[1:]]))


def export_delphi(
    stats, output_dir: str | os.PathLike, *, model_name: str, model_type: str, n_splits: int = 5
) -> list[Path]:
    """Write a delphi latent cache of every inspected layer of a `model_type` model into `output_dir`; `stats` must
    come from a pass with `InspectionSettings(collect_locations=True)`; `model_name` names the base model."""
    if stats.sequences is None:
        raise ExportError("a delphi export needs every activation: run the inspection with collect_locations=True "
                              "(`expertize inspect ... --export delphi`)")
    out = Path(output_dir)
    tokens = stats.sequences.numpy().astype(np.int64)  # (S, T)
    written = []
    for index, layer in sorted(stats.layers.items()):
        where, values = layer.locations  # (F, 3) (sequence, position, unit), (F,)
        module_dir = out / hookpoint(model_type, index)
        module_dir.mkdir(parents=True, exist_ok=True)
        for start, end in split_ranges(layer.num_units, min(n_splits, layer.num_units)):
            mask = (where[:, 2] >= start) & (where[:, 2] <= end)
            locations = where[mask].numpy().copy()
            locations[:, 2] -= start
            small = locations.shape[0] == 0 or (locations[:, 2].max() < 2**16 and locations[:, 0].max() < 2**16)
            locations = locations.astype(np.uint16 if small else np.uint32)
            path = module_dir / f"{start}_{end}.safetensors"
            save_file(
                {"locations": locations, "activations": values[mask].half().numpy(), "tokens": tokens}, str(path)
            )
            written.append(path)
        config = {
            "dataset_repo": ",".join(stats.domains),
            "dataset_split": "expertize inspect corpora",
            "dataset_name": "",
            "dataset_column": "text",
            "batch_size": stats.settings.batch_size,
            "cache_ctx_len": int(tokens.shape[1]),
            "n_tokens": int(tokens.size),
            "n_splits": min(n_splits, layer.num_units),
            "model_name": model_name,
        }
        (module_dir / "config.json").write_text(json.dumps(config, indent=4), encoding="utf-8")
        written.append(module_dir / "config.json")
    return written


def delphi_target(model_dir: str | os.PathLike, base_model: str | None = None) -> dict:
    """`export_delphi`'s naming of a folder's base: {"model_name", "model_type"}; a folder that is not a whole
    expertize folder, or names no loadable base, is refused here, before any pass over text."""
    config = checked_source(model_dir)
    return {"model_name": base_model_name(model_dir, base_model), "model_type": config["model_type"]}


def delphi_cache_from_folder(
    model_dir: str | os.PathLike,
    output: str | os.PathLike,
    corpora: Mapping[str, str],
    settings,
    *,
    base_model: str | None = None,
    device: "str | torch.device" = "cpu",
    progress: Callable[[int, int], None] | None = None,
    reading=None,
) -> list[Path]:
    """`expertize export MODEL_DIR --to delphi OUTPUT`: one inspection pass of the folder over `corpora` ({name:
    path}) with `settings` (an `InspectionSettings`; every activation is collected), written as a delphi cache.
    `reading` (data/run_reading.TextReading): how the corpora are read; default: as the folder's run read its text."""
    import dataclasses

    from ..inspection import inspect_folder

    target = delphi_target(model_dir, base_model)  # refused before the pass, not after it
    settings = dataclasses.replace(settings, collect_locations=True)
    with staged_output(output) as staging:
        stats = inspect_folder(model_dir, corpora, settings, device=device, progress=progress, reading=reading)
        export_delphi(stats, staging, **target)
    return sorted(Path(output).iterdir())
