"""SAELens's on-disk transcoders (`SAE.save_model` / `SAE.load_from_disk`, sae_lens 6.54 saes/transcoder.py), one
folder per layer, named by its input hook:

    OUT/blocks.{i}.mlp.hook_in/cfg.json                 architecture, d_in, d_sae, d_out, dtype, device,
                                                        apply_b_dec_to_input false, normalize_activations none,
                                                        metadata (sae_lens_version >= 6, hook_name, hook_name_out,
                                                        model_name, prepend_bos, expertize's own fields)
    OUT/blocks.{i}.mlp.hook_in/sae_weights.safetensors  W_enc (I, L) (SAELens multiplies x @ W_enc: the transpose of
                                                        ours), b_enc (L,), W_dec (L, O), b_dec (O,), threshold (L,)
                                                        for JumpReLU, W_skip (O, I) with a skip path

Architectures (SAELens's classes; its registry has no TopK transcoder):

    jumprelu      -> jumprelu_transcoder / jumprelu_skip_transcoder: ReLU(pre) · 1[pre > threshold], the same as
                     ours, pre · 1[pre > threshold], because every threshold is > 0
    relu          -> transcoder / skip_transcoder
    topk          refused (SAELens would read the file as a ReLU transcoder: every positive latent fires);
                     docs/export.md gives the one-class workaround

A cross-layer transcoder's source layer i is written as the JumpReLU transcoder of its own layer: its encoder and
thresholds exactly (the same latents), and as W_dec its decoder into layer i itself. SAELens holds one output per
transcoder, so what its latents write into the later layers j > i goes beside it in `cross_layer_decoders.safetensors`
(`W_dec_to_{j}` (L, O)), not read by SAELens: the per-layer view's output is layer i's own part of the CLT's output at
layer i (the CLT adds every earlier layer's writes there).

Hooks are TransformerLens 4's (`TransformerBridge`, which expertize's adapters extend: conversion/export/
transformer_lens.py): `blocks.{i}.mlp.hook_in` is what the layer reads (after the block's norm),
`blocks.{i}.hook_mlp_out` what it writes.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .expressible import CoderLayer, ExportError, kinds_computing

__all__ = ["SAELENS_VERSION", "input_hook", "output_hook", "saelens_architecture", "write_saelens",
           "write_saelens_clt"]

SAELENS_VERSION = "6.54.0"
"""The SAELens release whose loader this layout is read by (tests/test_saelens.py); >= 6 keeps its pre-6 renames
off."""

ARCHITECTURES = {  # (our coder activation, a skip path) -> SAELens's architecture name (its class, not our kind)
    ("jumprelu", False): "jumprelu_transcoder",
    ("jumprelu", True): "jumprelu_skip_transcoder",
    ("relu", False): "transcoder",
    ("relu", True): "skip_transcoder",
}


def _topk_refusal() -> str:
    readable = kinds_computing(("jumprelu", "relu"))
    return ("SAELens has no TopK class (its transcoders are ReLU, JumpReLU and their skip variants), so it would read "
            "these layers as ReLU transcoders, every positive latent firing; train a kind it reads, "
            f"{readable} (layer.kind; layer.k = the target L0), or register a TopK class of your own in SAELens and "
            "load the --to sparsify export into it (docs/export.md#saelens)")


def input_hook(index: int) -> str:
    return f"blocks.{index}.mlp.hook_in"


def output_hook(index: int) -> str:
    return f"blocks.{index}.hook_mlp_out"


def saelens_architecture(activation: str, skip: bool, where: str) -> str:
    """SAELens's architecture name of a coder with `activation` and a skip path or not; refuses TopK (`where` names
    the layers)."""
    if activation == "topk":
        raise ExportError(f"{where}: {_topk_refusal()}")
    if (activation, skip) not in ARCHITECTURES:
        raise ExportError(f"{where}: SAELens's transcoders compute ReLU or JumpReLU, not {activation}")
    return ARCHITECTURES[activation, skip]


def _config(architecture: str, d_in: int, d_sae: int, d_out: int, index: int, model_name: str, prepend_bos: bool,
            extra: dict) -> dict:
    return {
        "architecture": architecture,
        "d_in": d_in,
        "d_sae": d_sae,
        "d_out": d_out,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": False,  # a transcoder's b_dec is its output's bias (SAELens refuses true)
        "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": {
            "sae_lens_version": SAELENS_VERSION,
            "sae_lens_training_version": None,
            "model_name": model_name,
            "hook_name": input_hook(index),
            "hook_name_out": output_hook(index),
            "hook_head_index": None,
            "prepend_bos": prepend_bos,
            "context_size": None,
            "dataset_path": None,
            **extra,
        },
    }


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({name: t.detach().contiguous().float().cpu() for name, t in tensors.items()}, str(path))


def _write(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    folder.mkdir(parents=True)
    _save(tensors, folder / "sae_weights.safetensors")
    (folder / "cfg.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def write_saelens(layers: list[CoderLayer], folder: Path, *, model_name: str, prepend_bos: bool) -> list[Path]:
    """Write every layer's SAELens folder under `folder` (checked: `saelens_architecture` refuses what SAELens would
    misread); returns the folders."""
    written = []
    for layer in layers:
        coder = layer.coder
        architecture = saelens_architecture(coder.activation, coder.W_skip is not None, f"layer {layer.index}")
        d_sae, d_in = coder.W_enc.shape
        d_out = coder.W_dec.shape[1]
        tensors = {
            "W_enc": coder.W_enc.T,  # (I, L): SAELens computes x @ W_enc
            "b_enc": coder.b_enc,  # (L,)
            "W_dec": coder.W_dec,  # (L, O)
            "b_dec": coder.b_dec,  # (O,)
        }
        if coder.threshold is not None:
            tensors["threshold"] = coder.threshold  # (L,)
        if coder.W_skip is not None:
            tensors["W_skip"] = coder.W_skip  # (O, I): SAELens adds x @ W_skipᵀ, as ours
        extra = {"expertize_target_l0": coder.k, "expertize_hookpoint": layer.hookpoint}
        config = _config(architecture, int(d_in), int(d_sae), int(d_out), layer.index, model_name, prepend_bos, extra)
        written.append(_write(folder / input_hook(layer.index), tensors, config))
    return written


def write_saelens_clt(layers: dict, folder: Path, *, model_name: str, prepend_bos: bool) -> list[Path]:
    """Write each source layer of the CLT `layers` (model layer index -> `CltLayer`; every layer reads 0..i, checked
    with circuit_tracer.check_clt) as its own layer's JumpReLU transcoder, with its writes into later layers beside
    it (module docstring); returns the folders."""
    n = len(layers)
    written = []
    for i in range(n):
        layer = layers[i]
        d_sae, d_in = layer.W_enc.shape
        d_out = layer.b_dec.shape[0]
        tensors = {"W_enc": layer.W_enc.T, "b_enc": layer.b_enc, "W_dec": layer.decoder_from(i), "b_dec": layer.b_dec,
                   "threshold": layer.threshold}
        extra = {"expertize_target_l0": int(layer.spec.k), "expertize_cross_layer": {
            "layer": i, "writes_to": list(range(i, n)),
            "note": "W_dec is this layer's decoder into its own MLP output; its writes into later layers are in "
                    "cross_layer_decoders.safetensors (W_dec_to_{j}), which SAELens does not read"}}
        config = _config(ARCHITECTURES["jumprelu", False], int(d_in), int(d_sae), int(d_out), i, model_name,
                         prepend_bos, extra)
        out = _write(folder / input_hook(i), tensors, config)
        later = {f"W_dec_to_{j}": layers[j].decoder_from(i) for j in range(i + 1, n)}  # (L, O) each
        if later:
            _save(later, out / "cross_layer_decoders.safetensors")
        written.append(out)
    return written
