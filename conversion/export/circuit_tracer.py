"""circuit-tracer's per-layer transcoder set (attribution graphs).

Two layouts, chosen by the layers' activation:

- **JumpReLU sets: the registry's circuit-tracer 0.5.0 reads them** (`load_transcoder_set` -> `load_relu_transcoder`,
  circuit_tracer/transcoder/single_layer_transcoder.py of the 0.5.0 wheel). It loads each layer_{i}.safetensors with
  a strict `load_state_dict` into a `SingleLayerTranscoder` sized by b_enc / b_dec, whose activation is
  `JumpReLU(threshold)` (x * (x > threshold)) when the file holds `activation_function.threshold` and ReLU otherwise;
  it never reads config.yaml's `activation` or `k`.

      OUT/config.yaml              model_kind: transcoder_set, model_name (the base), feature_input_hook mlp.hook_in,
                                   feature_output_hook mlp.hook_out, scan
      OUT/layer_{i}.safetensors    W_enc (L, d), W_dec (L, d), b_enc (L,), b_dec (d,), activation_function.threshold
                                   (L,), W_skip (d, d) if any layer has a skip path; i = every decoder layer 0..n-1

- **TopK sets: only circuit-tracer from its repository reads them** (its TopK loading, PR #94, commit b00048e4 of
  circuit_tracer/utils/hf_utils.py `load_transcoders` and 196e2ce of single_layer_transcoder.py, is not in 0.5.0).
  0.5.0 would load such a file *silently as a ReLU transcoder* (every positive latent fires: L0 ~3x K on a skip
  transcoder's layers, outputs off by ~0.7), so a TopK set is written only when asked for by name
  (`allow_topk`, `expertize export --circuit-tracer-topk`). Its config.yaml adds `activation: topk` and `k`. That
  TopK keeps the K largest pre-activations *without a ReLU* (x · 1[topk]); on a token with fewer than K positive
  pre-activations it would keep negative ones that TopK(ReLU(·)) zeroes, so the export appends K zero latents to every
  layer (zero W_enc row, b_enc and W_dec row: pre-activation exactly 0 on every token), and the output equals the
  layer's on every token. Feature ids 0..L-1 are the layer's units; L..L+K-1 never fire.

Hooks: circuit-tracer wraps each TransformerLens MLP in a module with `hook_in` (the MLP's input, after the block's
norm: what the layer reads) and `hook_out` (its output), so the set needs every layer 0..n-1 (its TranscoderSet and
replacement model assume all of them) at one width.
"""

import importlib.util
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from expertize.modeling import LAYER_KINDS

from .expressible import CoderLayer, ExportError, kinds_computing

__all__ = ["FEATURE_INPUT_HOOK", "FEATURE_OUTPUT_HOOK", "check_clt", "check_transcoder_set", "is_clt",
           "write_attribution_kit", "write_circuit_tracer", "write_circuit_tracer_clt"]

FEATURE_INPUT_HOOK = "mlp.hook_in"
FEATURE_OUTPUT_HOOK = "mlp.hook_out"


def check_transcoder_set(widths: dict[int, int], ks: dict[int, int | None], activations: dict[int, str],
                         num_layers: int, model: str, *, allow_topk: bool = False) -> None:
    """Refuse a layer set circuit-tracer cannot hold, or that its registry release would misread: not every decoder
    layer, more than one width, TopK layers unless `allow_topk` (then one k), TopK mixed with other activations.
    `widths` / `ks` / `activations`: layer index -> units / k / the `Coder`'s activation of each sparse layer."""
    missing = sorted(set(range(num_layers)) - set(widths))
    if missing:
        raise ExportError(
            f"circuit-tracer needs a sparse coder at every decoder layer 0..{num_layers - 1} (its per-layer set "
            f"and replacement model cover all of them), but layer(s) {missing} of {model} keep their dense MLP; "
            "convert every layer (recipe `layers: all`)"
        )
    topk = sorted(i for i, a in activations.items() if a == "topk")
    if topk and len(topk) < len(activations):
        raise ExportError(
            f"{model} mixes TopK layers ({topk}) with others: a circuit-tracer set is read with one activation "
            "rule; convert every layer with the same kind"
        )
    if topk and not allow_topk:
        readable = kinds_computing(RELEASED)
        raise ExportError(
            f"{model}'s layers are TopK coders, which the registry's circuit-tracer (0.5.0) reads silently as ReLU "
            "coders (every positive latent fires, so its graphs would not be of these layers); train a kind it "
            f"reads, {readable} (layer.kind; layer.k = the target L0), or, for circuit-tracer installed from its "
            "repository (TopK since PR #94), pass --circuit-tracer-topk"
        )
    checked = (("width (units)", widths), ("k", ks)) if topk else (("width (units)", widths),)
    for what, values in checked:
        if len(set(values.values())) > 1:
            shown = ", ".join(f"layer {i}: {v}" for i, v in sorted(values.items()))
            raise ExportError(
                f"circuit-tracer's per-layer set has one {what} for every layer, but {model} has {shown}; convert "
                f"every layer with the same {what.split()[0]}"
            )


def write_circuit_tracer(layers: list[CoderLayer], folder: Path, *, model_name: str, scan: str) -> list[Path]:
    """Write config.yaml and layer_{i}.safetensors for `layers` (checked with `check_transcoder_set`); returns the
    files."""
    topk = layers[0].coder.activation == "topk"
    skip = any(layer.coder.W_skip is not None for layer in layers)
    written = []
    for layer in layers:
        coder = layer.coder
        width, d_in = coder.W_enc.shape
        d_out = coder.W_dec.shape[1]
        pad = coder.k if topk else 0  # TopK only: K zero latents, so no negative pre-activation is ever kept
        tensors = {
            "W_enc": torch.cat([coder.W_enc, coder.W_enc.new_zeros(pad, d_in)]),  # (L + pad, I)
            "b_enc": torch.cat([coder.b_enc, coder.b_enc.new_zeros(pad)]),  # (L + pad,)
            "W_dec": torch.cat([coder.W_dec, coder.W_dec.new_zeros(pad, d_out)]),  # (L + pad, O)
            "b_dec": coder.b_dec,  # (O,)
        }
        if coder.activation == "jumprelu":
            tensors["activation_function.threshold"] = coder.threshold  # (L,): 0.5.0's JumpReLU reads this key
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
    }
    if topk:
        config.update(activation="topk", k=layers[0].coder.k)
    config["scan"] = scan
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return [folder / "config.yaml", *written]


# -- cross-layer transcoders -----------------------------------------------------------------------------------------
# circuit-tracer 0.5.0's `load_clt` (circuit_tracer/transcoder/cross_layer_transcoder.py `_load_state_dict`): a folder
# with, for every layer i of the model,
#     W_enc_{i}.safetensors    W_enc_{i} (L, d), b_enc_{i} (L,), b_dec_{i} (d,), threshold_{i} (L,) (JumpReLU; a
#                              folder without thresholds loads as ReLU)
#     W_dec_{i}.safetensors    W_dec_{i} (L, n - i, d): what latent l of layer i writes into layer i + j at [l, j]
# n_layers is the number of W_enc files; every layer reads and writes, one width, no skip path here.


RELEASED = ("jumprelu", "relu")
"""The coder activations circuit-tracer 0.5.0 (the registry's) reads; its TopK (`TARGET_ACTIVATIONS`' third) only
from its repository."""


def _spec_class(fields: dict):
    return LAYER_KINDS[fields["kind"]][0]


def is_clt(sparse_layers: dict) -> bool:
    """Whether a config's `sparse_layers` (index -> spec dict) hold a cross-layer kind's layers."""
    return any(_spec_class(fields).cross_layer for fields in sparse_layers.values())


def check_clt(sparse_layers: dict, num_layers: int, model: str) -> None:
    """Refuse a CLT circuit-tracer cannot hold: not every decoder layer, a layer of another kind, a layer that does not
    read every earlier layer, more than one width."""
    specs = {int(i): _spec_class(fields) for i, fields in sparse_layers.items()}
    cross = next(spec for spec in specs.values() if spec.cross_layer)
    others = sorted(i for i, spec in specs.items() if not spec.cross_layer)
    if others:
        raise ExportError(f"{model} mixes {cross.title} layers with other kinds (layers {others}); circuit-tracer "
                          "reads one CLT over every layer")
    missing = sorted(set(range(num_layers)) - set(specs))
    if missing:
        raise ExportError(
            f"circuit-tracer's {cross.title} covers every decoder layer 0..{num_layers - 1}, but {model}'s CLT "
            f"leaves out layer(s) {missing}; convert every layer (recipe `layers: all`)")
    for i, fields in sparse_layers.items():
        if fields.get("sources") is None:
            raise ExportError(f"layer {i} of {model} is a lone CLT layer (no sources: it was not converted with the "
                              "others as one CLT); circuit-tracer's CLT has layer i read every layer 0..i — convert "
                              f"with a recipe over every layer (layers: all, layer.kind: {cross.kind})")
        if fields.get("sources") != list(range(int(i) + 1)):
            raise ExportError(f"layer {i} of {model}'s CLT reads layers {fields.get('sources')}, and circuit-tracer's "
                              f"CLT has layer {i} read every layer 0..{i}")
    widths = {int(i): fields["num_latents"] for i, fields in sparse_layers.items()}
    if len(set(widths.values())) > 1:
        raise ExportError(f"circuit-tracer's CLT has one width at every layer, but {model} has {widths}")


def write_circuit_tracer_clt(layers: dict, folder: Path, *, model_name: str, scan: str) -> list[Path]:
    """Write config.yaml, W_enc_{i} and W_dec_{i}.safetensors of the CLT `layers` (model layer index -> `CltLayer`,
    checked with `check_clt`); returns the files."""
    n = len(layers)
    written = []
    for i in range(n):
        layer = layers[i]
        encoder = {
            f"W_enc_{i}": layer.W_enc.detach(),  # (L, d)
            f"b_enc_{i}": layer.b_enc.detach(),  # (L,)
            f"b_dec_{i}": layer.b_dec.detach(),  # (d,): layer i's output bias
            f"threshold_{i}": layer.threshold.detach(),  # (L,)
        }
        # what layer i's latents write into each layer j >= i: (L, n-i, d)
        decoder = {f"W_dec_{i}": torch.stack([layers[j].decoder_from(i) for j in range(i, n)], dim=1)}
        for name, tensors in ((f"W_enc_{i}", encoder), (f"W_dec_{i}", decoder)):
            path = folder / f"{name}.safetensors"
            save_file({key: t.contiguous().float().cpu() for key, t in tensors.items()}, str(path))
            written.append(path)
    config = {
        "model_kind": "cross_layer_transcoder",
        "model_name": model_name,
        "feature_input_hook": FEATURE_INPUT_HOOK,
        "feature_output_hook": FEATURE_OUTPUT_HOOK,
        "scan": scan,
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return [folder / "config.yaml", *written]


ATTRIBUTE_SCRIPT = Path(importlib.util.find_spec("expertize.circuit_tracer_attribute").origin)
"""Copied into every circuit-tracer export as attribute.py: the offline route to a graph (its docstring)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def write_attribution_kit(model_dir: Path, folder: Path) -> list[Path]:
    """attribute.py and tokenizer/ (the model folder's tokenizer, its tokenizer_config.json rewritten so that
    transformers 4.57, circuit-tracer 0.5.0's pin, reads it) into the export `folder`; returns the files."""
    import json
    import shutil

    from expertize.circuit_tracer_attribute import fix_tokenizer_config

    written = [folder / "attribute.py"]
    shutil.copyfile(ATTRIBUTE_SCRIPT, written[0])
    tokenizer = folder / "tokenizer"
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        source = Path(model_dir) / name
        if not source.is_file():
            continue
        if name == "tokenizer_config.json":
            fixed = fix_tokenizer_config(json.loads(source.read_text(encoding="utf-8")))
            (tokenizer / name).write_text(json.dumps(fixed, indent=2) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(source, tokenizer / name)
        written.append(tokenizer / name)
    return written
