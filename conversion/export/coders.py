"""The exports that hold the layers themselves, as sparse coders (and a whole CLT): sparsify, circuit-tracer and
SAELens."""

import os
from pathlib import Path

from .expressible import ExportError, coder_layers, planned_coders
from .endpoints import EXPORT_RECORD, base_model_name, checked_source, staged_output

__all__ = ["CODER_TARGETS", "export_coders"]

CODER_TARGETS = ("sparsify", "circuit-tracer", "saelens")
"""The targets that hold the layers themselves (as sparse coders); delphi holds their activations instead."""


def export_coders(model_dir: str | os.PathLike, target: str, output: str | os.PathLike, *,
                  base_model: str | None = None, circuit_tracer_topk: bool = False) -> Path:
    """Write every sparse layer of `model_dir` for `target` (one of `CODER_TARGETS`) into the new folder `output`.

    Everything that can be refused is refused before the weights load: a layer no coder (its kind's reason) or one
    whose activation the target does not compute, a cross-layer transcoder for another target than circuit-tracer,
    for circuit-tracer a layer set that is not every layer at one width (and one k), TopK layers unless
    `circuit_tracer_topk` (the registry's circuit-tracer would read them as ReLU), an unnamed base model, an output
    that exists or cannot be written; for SAELens, TopK layers (it has no TopK transcoder). A selection bias is read
    from the weights, then refused the same way."""
    import json

    from ..progress import quiet_library_progress
    from ..surgery.splice import load_expertize_model
    from .circuit_tracer import check_transcoder_set, is_clt, write_attribution_kit, write_circuit_tracer
    from .saelens import saelens_architecture, write_saelens
    from .sparsify import write_sparsify

    if target not in CODER_TARGETS:
        raise ExportError(f"unknown export target {target!r}; choose one of {', '.join(CODER_TARGETS)} or delphi")
    config = checked_source(model_dir)
    name = base_model_name(model_dir, base_model)
    if is_clt(config["sparse_layers"]):
        return _export_clt(model_dir, config, target, output, name)
    planned = planned_coders(config["sparse_layers"], target)
    if target == "circuit-tracer":
        check_transcoder_set({i: c.W_enc.shape[0] for i, c in planned.items()}, {i: c.k for i, c in planned.items()},
                             {i: c.activation for i, c in planned.items()}, _num_layers(config, model_dir),
                             str(model_dir), allow_topk=circuit_tracer_topk)
    if target == "saelens":
        for i, coder in planned.items():
            saelens_architecture(coder.activation, coder.W_skip is not None, f"layer {i} of {model_dir}")
    need = sum(4 * sum(t.numel() for t in c if hasattr(t, "numel")) for c in planned.values())  # float32 bound
    with quiet_library_progress():  # one line of outcome, no loading bar
        layers = coder_layers(load_expertize_model(model_dir), target)
    record = _record(target, model_dir, name, {str(layer.index): layer.hookpoint for layer in layers})
    with staged_output(output, need_bytes=need) as staging:
        if target == "sparsify":
            write_sparsify(layers, staging)
        elif target == "saelens":
            write_saelens(layers, staging, model_name=name, prepend_bos=_prepend_bos(model_dir))
        else:
            write_circuit_tracer(layers, staging, model_name=name, scan=f"{Path(name).name}/{record['source']}")
            write_attribution_kit(Path(model_dir), staging)
            if layers[0].coder.activation == "topk":
                record["zero_latents_appended"] = layers[0].coder.k  # ids >= the layer's width never fire
        (staging / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return Path(output)


def _export_clt(model_dir, config: dict, target: str, output, name: str) -> Path:
    """A cross-layer transcoder's folder, as circuit-tracer's CLT, or as SAELens's per-layer view of it."""
    import json

    from expertize.modeling import LAYER_KINDS

    from ..progress import quiet_library_progress
    from ..surgery.splice import load_expertize_model
    from .circuit_tracer import check_clt, write_attribution_kit, write_circuit_tracer_clt
    from .saelens import write_saelens_clt

    title = next(LAYER_KINDS[f["kind"]][0].title for f in config["sparse_layers"].values())
    if target == "sparsify":
        raise ExportError(f"{model_dir} is a {title}, which {target} cannot hold (a layer's output reads every earlier "
                          "layer's latents); export it --to circuit-tracer, saelens (per layer) or delphi")
    check_clt(config["sparse_layers"], _num_layers(config, model_dir), str(model_dir))
    need = sum(4 * fields["num_latents"] * (fields["d_in"] + 2 + len(fields["sources"]) * fields["d_out"])
               for fields in config["sparse_layers"].values())  # float32 bound
    with quiet_library_progress():
        layers = load_expertize_model(model_dir).sparse_layers()
    record = _record(target, model_dir, name, {str(i): title for i in sorted(layers)})
    with staged_output(output, need_bytes=need) as staging:
        if target == "saelens":  # one JumpReLU transcoder per source layer; its later writes beside it
            write_saelens_clt(layers, staging, model_name=name, prepend_bos=_prepend_bos(model_dir))
        else:
            write_circuit_tracer_clt(layers, staging, model_name=name, scan=f"{Path(name).name}/{record['source']}")
            write_attribution_kit(Path(model_dir), staging)
        (staging / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return Path(output)


def _prepend_bos(model_dir) -> bool:
    """Whether the folder's run started its text with BOS (SAELens's `prepend_bos`, which its tools read)."""
    from transformers import AutoTokenizer

    from ..data.run_reading import TextReading

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    return TextReading.of_folder(model_dir).prompt_bos(tokenizer)


def _num_layers(config: dict, model_dir) -> int:
    """The decoder layers of `model_dir`'s base (circuit-tracer's sets and CLTs cover every one)."""
    from ..surgery.families import family_info

    return family_info(config["model_type"]).config_class.from_pretrained(model_dir).num_hidden_layers


def _record(target: str, model_dir, base_model: str, layers: dict[str, str]) -> dict:
    """What EXPORT_RECORD holds: the target, the source folder's name, the base model, expertize's version, and
    per layer index its hookpoint (a CLT: its kind's title)."""
    from expertize import __version__

    return {"target": target, "source": Path(model_dir).resolve().name, "base_model": base_model,
            "expertize": __version__, "layers": layers}
