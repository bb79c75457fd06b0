"""Export for a community tool: a delphi latent cache (EleutherAI/delphi, automated interpretability).

delphi explains and scores latents from a cache of every non-zero activation, written by its `LatentCache.save_splits`
and read by its `LatentDataset` / `TensorBuffer` (delphi/latents/cache.py, loader.py). Per hookpoint (module path):

    OUT/<module>/<start>_<end>.safetensors    latents start..end (inclusive), `n_splits` files covering all units
        "locations"    (F, 3) uint16 (uint32 when a sequence index or a latent offset reaches 2**16):
                       (sequence index into "tokens", position, latent id - start)
        "activations"  (F,) float16
        "tokens"       (S, T) int64, every sequence read (the same in each file)
    OUT/<module>/config.json                  delphi's CacheConfig fields + "model_name"

`delphi` itself is not a dependency (it requires vLLM); the format is tested against its documented loader logic.
"""

import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from .corpora import InspectionError

__all__ = ["export_delphi", "split_ranges"]


def split_ranges(width: int, n_splits: int) -> list[tuple[int, int]]:
    """delphi's `_generate_split_indices`: inclusive (start, end) latent ranges of `n_splits` near-equal parts."""
    bounds = torch.linspace(0, width, steps=n_splits + 1).long().tolist()
    return list(zip(bounds[:-1], [b - 1 for b in bounds[1:]]))


def export_delphi(
    stats, output_dir: str | os.PathLike, n_splits: int = 5, model_name: str | None = None
) -> list[Path]:
    """Write a delphi latent cache of every inspected layer; `stats` must come from a pass with
    `InspectionSettings(collect_locations=True)` (the CLI's `--export delphi`)."""
    if stats.sequences is None:
        raise InspectionError("a delphi export needs every activation: run the inspection with collect_locations=True "
                              "(`expertize inspect ... --export delphi`)")
    out = Path(output_dir)
    tokens = stats.sequences.numpy().astype(np.int64)  # (S, T)
    written = []
    for index, layer in sorted(stats.layers.items()):
        where, values = layer.locations  # (F, 3) (sequence, position, unit), (F,)
        module_dir = out / layer.module
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
            "model_name": model_name or stats.model_name,
        }
        (module_dir / "config.json").write_text(json.dumps(config, indent=4), encoding="utf-8")
        written.append(module_dir / "config.json")
    return written
