"""EleutherAI sparsify's on-disk sparse coders (`SparseCoder.save_to_disk` / `load_from_disk`, sparsify 1.3.3
sparse_coder.py), one folder per hookpoint:

    OUT/<hookpoint>/cfg.json          SparseCoderConfig fields + d_in; transcode: true (no b_dec subtracted from
                                      the input), activation "topk", k, num_latents, skip_connection
    OUT/<hookpoint>/sae.safetensors   encoder.weight (L, I), encoder.bias (L,), W_dec (L, I), b_dec (I,),
                                      W_skip (I, I) when the layer has a skip path

sparsify encodes TopK(ReLU(encoder(x))) and decodes W_decᵀ z + b_dec (+ W_skip x): a TopK sparse coder exactly, with
the names and layouts of expertize's own weights (the layer's input width equals its output width, as sparsify's
b_dec assumes). `SparseCoder.load_many(OUT, local=True)` loads them all; delphi's `--sparse_model OUT` and
SAELens's sparsify loader read the same folders.
"""

import json
from pathlib import Path

from safetensors.torch import save_file

from .expressible import CoderLayer, ExportError

__all__ = ["write_sparsify"]


def _config(layer: CoderLayer) -> dict:
    width, d_in = layer.coder.W_enc.shape
    return {
        "activation": "topk",
        "expansion_factor": max(1, round(width / d_in)),  # informational: num_latents is what sparsify builds
        "normalize_decoder": False,  # a training-time init choice; the decoder rows are used as they are
        "num_latents": int(width),
        "k": layer.coder.k,
        "multi_topk": False,
        "skip_connection": layer.coder.W_skip is not None,
        "transcode": True,
        "d_in": int(d_in),
    }


def write_sparsify(layers: list[CoderLayer], folder: Path) -> list[Path]:
    """Write every layer's sparsify folder under `folder`; returns the folders."""
    written = []
    for layer in layers:
        coder = layer.coder
        if coder.W_dec.shape[1] != coder.W_enc.shape[1]:
            raise ExportError(
                f"layer {layer.index}: sparsify's coders map a width onto itself (b_dec has d_in entries), but this "
                f"layer maps {coder.W_enc.shape[1]} to {coder.W_dec.shape[1]}"
            )
        tensors = {  # one dtype for all: sparsify builds the coder in the dtype of the file's first tensor
            "encoder.weight": coder.W_enc,  # (L, I)
            "encoder.bias": coder.b_enc,  # (L,)
            "W_dec": coder.W_dec,  # (L, I)
            "b_dec": coder.b_dec,  # (I,)
        }
        if coder.W_skip is not None:
            tensors["W_skip"] = coder.W_skip  # (I, I), applied as x @ W_skipᵀ like ours
        out = folder / layer.hookpoint
        out.mkdir(parents=True)
        save_file({name: t.contiguous().cpu() for name, t in tensors.items()}, str(out / "sae.safetensors"))
        (out / "cfg.json").write_text(json.dumps(_config(layer), indent=2) + "\n", encoding="utf-8")
        written.append(out)
    return written
