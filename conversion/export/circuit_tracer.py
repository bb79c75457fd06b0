"""circuit-tracer's per-layer transcoder set (attribution graphs), as its source defines it: safety-research/
circuit-tracer, circuit_tracer/utils/hf_utils.py `load_transcoders` (commit b00048e4710a66436b08364778f574753a7d2b63)
and circuit_tracer/transcoder/single_layer_transcoder.py `load_transcoder`, `load_transcoder_set`, `TranscoderSet`
(commit 196e2cecbae69532a5677630f6b7c99c6c275fe3), activation_functions.py `TopK` (commit b00048e4). Its TopK
loading is not in the registry release (circuit-tracer 0.5.0 reads ReLU / JumpReLU only).

    OUT/config.yaml              model_kind: transcoder_set, model_name (the base), feature_input_hook mlp.hook_in,
                                 feature_output_hook mlp.hook_out, activation: topk, k, scan
    OUT/layer_{i}.safetensors    W_enc (L', d), W_dec (L', d), b_enc (L',), b_dec (d,), W_skip (d, d) if any layer
                                 has a skip path; i = every decoder layer 0..n-1, one width L' at all of them

The tool encodes F.linear(x, W_enc, b_enc), then its TopK keeps the K largest pre-activations *without a ReLU*
(x · 1[topk]), and decodes acts @ W_dec + b_dec + x @ W_skipᵀ. On a token with fewer than K positive pre-activations
it would keep negative ones that TopK(ReLU(·)) zeroes. So the export appends K zero latents to every layer (zero
W_enc row, b_enc and W_dec row: pre-activation exactly 0 on every token). Then every token has K entries at >= 0,
a negative one can never be among the top K, and the chosen entries at 0 add nothing: the output equals the layer's
on every token, not just on most. Feature ids 0..L-1 are the layer's units; L..L+K-1 never fire (activation 0, which
circuit-tracer's sparse activations leave out).

Hooks: circuit-tracer wraps each TransformerLens MLP in a module with `hook_in` (the MLP's input, after the block's
norm: what the layer reads) and `hook_out` (its output), so the set needs every layer 0..n-1 (its TranscoderSet and
replacement model assume all of them) at one width and one k (one `k` in config.yaml).
"""

from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from .expressible import CoderLayer, ExportError

__all__ = ["FEATURE_INPUT_HOOK", "FEATURE_OUTPUT_HOOK", "check_transcoder_set", "write_circuit_tracer"]

FEATURE_INPUT_HOOK = "mlp.hook_in"
FEATURE_OUTPUT_HOOK = "mlp.hook_out"


def check_transcoder_set(widths: dict[int, int], ks: dict[int, int], num_layers: int, model: str) -> None:
    """Refuse a layer set circuit-tracer cannot hold: not every decoder layer, or more than one width or k.
    `widths` / `ks`: layer index -> units / K of each sparse layer."""
    missing = sorted(set(range(num_layers)) - set(widths))
    if missing:
        raise ExportError(
            f"circuit-tracer needs a sparse coder at every decoder layer 0..{num_layers - 1} (its per-layer set "
            f"and replacement model cover all of them), but layer(s) {missing} of {model} keep their dense MLP; "
            "convert every layer (recipe `layers: all`)"
        )
    for what, values in (("width (units)", widths), ("k", ks)):
        if len(set(values.values())) > 1:
            shown = ", ".join(f"layer {i}: {v}" for i, v in sorted(values.items()))
            raise ExportError(
                f"circuit-tracer's per-layer set has one {what} for every layer, but {model} has {shown}; convert "
                f"every layer with the same {what.split()[0]}"
            )


def write_circuit_tracer(layers: list[CoderLayer], folder: Path, *, model_name: str, scan: str) -> list[Path]:
    """Write config.yaml and layer_{i}.safetensors for `layers` (checked with `check_transcoder_set`); returns the
    files."""
    k = layers[0].coder.k
    skip = any(layer.coder.W_skip is not None for layer in layers)
    written = []
    for layer in layers:
        coder = layer.coder
        width, d_in = coder.W_enc.shape
        d_out = coder.W_dec.shape[1]
        pad = coder.W_enc.new_zeros(k, d_in), coder.b_enc.new_zeros(k), coder.W_dec.new_zeros(k, d_out)
        tensors = {
            "W_enc": torch.cat([coder.W_enc, pad[0]]),  # (L + K, I)
            "b_enc": torch.cat([coder.b_enc, pad[1]]),  # (L + K,)
            "W_dec": torch.cat([coder.W_dec, pad[2]]),  # (L + K, O)
            "b_dec": coder.b_dec,  # (O,)
        }
        if skip:  # every layer then has one (zeros where the layer has none): the set's skip flag is per set
            tensors["W_skip"] = coder.W_skip if coder.W_skip is not None else coder.W_enc.new_zeros(d_out, d_in)
        path = folder / f"layer_{layer.index}.safetensors"
        save_file({name: t.contiguous().cpu() for name, t in tensors.items()}, str(path))
        written.append(path)
    config = {
        "model_kind": "transcoder_set",
        "model_name": model_name,
        "feature_input_hook": FEATURE_INPUT_HOOK,
        "feature_output_hook": FEATURE_OUTPUT_HOOK,
        "activation": "topk",
        "k": k,
        "scan": scan,
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return [folder / "config.yaml", *written]
