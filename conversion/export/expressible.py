"""What a sparse-coder format can express, decided once for every target (sparsify, circuit-tracer).

Both tools hold sparse coders (`expertize.modeling.sparse_base.Coder`), each with the activations it computes
(`TARGET_ACTIVATIONS`: sparsify TopK, circuit-tracer JumpReLU / ReLU, and TopK from its repository):

    y = W_decᵀ act(W_enc x + b_enc) + b_dec  (+ W_skip x)

A layer is written for them only when it is exactly that: the layer says so itself (`SparseLayer.sparse_coder`, None
for kinds whose decoder is token-dependent or non-linear, with the spec's `not_sparse_coder` as the reason), its
activation is one the target computes, and its
selection bias, if it has one, cannot change which K units are chosen (a constant `b_select` shifts every positive
score alike; any other value chooses other units than the tools would). Nothing here names a kind.

Hookpoints: the tools load the *base* model, whose module names the expertize model keeps, so a layer's hookpoint is
its MLP's module path below the base model (`layers.3.mlp` in Llama, `h.3.mlp` in GPT-2): what sparsify's trainer and
delphi resolve against `model.base_model`.
"""

import dataclasses
from collections.abc import Mapping

import torch

from expertize.modeling import LAYER_KINDS, Coder, SparseLayer, SparseSpec
from expertize.modeling.sparse_layers import build_sparse_layer, spec_from_dict

from ..errors import ExpertizeError
from ..surgery.families import family_info

__all__ = ["CoderLayer", "ExportError", "coder_layers", "exportable_kinds", "hookpoint", "kinds_computing",
           "planned_coders"]


class ExportError(ExpertizeError, ValueError):
    """An export the target format cannot hold exactly, or a folder / output it cannot be made from or to."""


@dataclasses.dataclass(frozen=True)
class CoderLayer:
    """One sparse layer as the target tools see it."""

    index: int
    """Decoder layer index."""
    hookpoint: str
    """The MLP's module path below the base model, e.g. "layers.3.mlp"."""
    coder: Coder


def hookpoint(model_type: str, index: int) -> str:
    """Decoder layer `index`'s MLP below the base model of a base or expertize `model_type`: "layers.3.mlp"."""
    family = family_info(model_type)
    prefix = family.causal_lm_class._base_attr + "."
    return f"{family.blocks_path.removeprefix(prefix)}.{index}.mlp"


def kinds_computing(activations: tuple[str, ...]) -> str:
    """The registered kinds whose layers are coders with one of `activations`, as "a or b" (what a refusal
    names)."""
    return " or ".join(kind for kind, (spec, _) in LAYER_KINDS.items() if spec.coder_activation in activations)


def exportable_kinds() -> list[str]:
    """The registered kinds whose layers can be sparse coders (their class implements `sparse_coder`)."""
    return sorted(kind for kind, (_, layer) in LAYER_KINDS.items() if layer.sparse_coder is not SparseLayer.sparse_coder)


TARGET_ACTIVATIONS = {"sparsify": ("topk",), "circuit-tracer": ("jumprelu", "relu", "topk"),
                      "saelens": ("jumprelu", "relu", "topk")}
"""The coder activations (`Coder.activation`) each target's loader computes: sparsify 1.3.3 encodes TopK only;
circuit-tracer 0.5.0 JumpReLU and ReLU (TopK only from its repository: export/circuit_tracer.py); SAELens 6.54
JumpReLU and ReLU (TopK passes here to be refused with SAELens's own reason: export/saelens.py)."""


def _held_coder(index: int, spec: SparseSpec, coder: Coder | None, target: str) -> Coder:
    """`coder` (the layer's `sparse_coder()`) when `target` can hold it; else the one-line refusal: a layer that is no
    coder (its kind's reason), or a coder whose activation `target` does not compute."""
    if coder is None:
        raise _refuse_kind(index, spec, target)
    if coder.activation not in TARGET_ACTIVATIONS[target]:
        raise ExportError(
            f"layer {index} ({spec.title}) is a {coder.activation} coder and {target} computes "
            f"{' / '.join(TARGET_ACTIVATIONS[target])} only, so it would read it as another layer; export it --to "
            + ("circuit-tracer or delphi" if target == "sparsify" else "delphi")
        )
    return coder


def _refuse_kind(index: int, spec: SparseSpec, target: str) -> ExportError:
    return ExportError(
        f"layer {index} ({spec.title}) cannot be written for {target}: {spec.not_sparse_coder}; {target} holds "
        f"sparse coders only (kinds: {', '.join(exportable_kinds())})"
    )


def planned_coders(sparse_layers: Mapping[str, dict], target: str) -> dict[int, Coder]:
    """The layers of a config's `sparse_layers` as coders of meta tensors (shapes, activation and k, no weights read):
    what can be refused before the model loads. Raises `ExportError` for a layer that is no coder, or one whose
    activation `target` does not compute."""
    coders = {}
    for key, fields in sorted(sparse_layers.items(), key=lambda kv: int(kv[0])):
        spec = spec_from_dict(fields)
        with torch.device("meta"):
            coders[int(key)] = _held_coder(int(key), spec, build_sparse_layer(spec).sparse_coder(), target)
    return coders


def coder_layers(model, target: str) -> list[CoderLayer]:
    """Every sparse layer of a loaded expertize model as a TopK coder at its hookpoint, in decoder order; refuses
    (`ExportError`, one line) a layer the target cannot hold exactly."""
    found = []
    for index, layer in sorted(model.sparse_layers().items()):
        coder = _held_coder(index, layer.spec, layer.sparse_coder(), target)
        if coder.b_select is not None and bool(coder.b_select.max() > coder.b_select.min()):
            spread = float(coder.b_select.max() - coder.b_select.min())
            raise ExportError(
                f"layer {index}: its selection bias b_select (spread {spread:.3g}) changes which units are chosen, "
                f"and {target} chooses by the pre-activations alone, so its outputs would differ; export a model "
                "trained without a selection bias (train.balance: none)"
            )
        found.append(CoderLayer(index, hookpoint(model.config.model_type, index), coder))
    return found
