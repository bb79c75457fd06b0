"""The exports that hold the layers themselves, as TopK sparse coders: sparsify and circuit-tracer."""

import os
from pathlib import Path

from .expressible import ExportError, coder_layers, planned_coders
from .endpoints import EXPORT_RECORD, base_model_name, checked_source, staged_output

__all__ = ["CODER_TARGETS", "export_coders"]

CODER_TARGETS = ("sparsify", "circuit-tracer")
"""The targets that hold the layers themselves (as TopK sparse coders); delphi holds their activations instead."""


def export_coders(model_dir: str | os.PathLike, target: str, output: str | os.PathLike, *,
                  base_model: str | None = None) -> Path:
    """Write every sparse layer of `model_dir` for `target` (one of `CODER_TARGETS`) into the new folder `output`.

    Everything that can be refused is refused before the weights load: a layer no TopK coder (its kind's reason),
    for circuit-tracer a layer set that is not every layer at one width and one k, an unnamed base model, an output
    that exists or cannot be written. A selection bias is read from the weights, then refused the same way."""
    import json

    from expertize import __version__

    from ..progress import quiet_library_progress
    from ..surgery.families import family_info
    from ..surgery.splice import load_expertize_model
    from .circuit_tracer import check_transcoder_set, write_circuit_tracer
    from .sparsify import write_sparsify

    if target not in CODER_TARGETS:
        raise ExportError(f"unknown export target {target!r}; choose one of {', '.join(CODER_TARGETS)} or delphi")
    config = checked_source(model_dir)
    name = base_model_name(model_dir, base_model)
    planned = planned_coders(config["sparse_layers"], target)
    if target == "circuit-tracer":
        num_layers = family_info(config["model_type"]).config_class.from_pretrained(model_dir).num_hidden_layers
        check_transcoder_set({i: c.W_enc.shape[0] for i, c in planned.items()}, {i: c.k for i, c in planned.items()},
                             num_layers, str(model_dir))
    need = sum(4 * sum(t.numel() for t in c if hasattr(t, "numel")) for c in planned.values())  # float32 bound
    with quiet_library_progress():  # one line of outcome, no loading bar
        layers = coder_layers(load_expertize_model(model_dir), target)
    record = {
        "target": target,
        "source": Path(model_dir).resolve().name,
        "base_model": name,
        "expertize": __version__,
        "layers": {str(layer.index): layer.hookpoint for layer in layers},
    }
    with staged_output(output, need_bytes=need) as staging:
        if target == "sparsify":
            write_sparsify(layers, staging)
        else:
            write_circuit_tracer(layers, staging, model_name=name, scan=f"{Path(name).name}/{record['source']}")
            record["zero_latents_appended"] = layers[0].coder.k  # ids >= the layer's width never fire
        (staging / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return Path(output)
