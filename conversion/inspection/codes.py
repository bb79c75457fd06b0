"""The sparse codes of a text, and a layer's output from a code: the notebook habit of SAELens's `run_with_cache`.

    model, tokenizer = expertize.load_model("runs/quickstart")
    cache = expertize.text_codes(model, tokenizer, "To be, or not to be")
    cache.tokens                       # ['<|endoftext|>', 'To', ' be', ...] (BOS first, as training sequences start)
    index, weights = cache.codes[2]    # layer 2's code: (T, K) unit ids and their weights, one row per token
    out = expertize.decode(model, 2, cache.codes[2], cache.inputs[2])   # == cache.outputs[2]

A code here is what the layer decodes: the `SparseCode` at `mlp.code_hook` (after interventions). `inspect` counts a
unit as firing where the code at `mlp.activation_hook` lists it with a weight > 0; the two differ only where a kind's
code weight is not the unit's contribution (routed neurons: the router gate). Shapes: T tokens, K code entries,
I / O the layer's input / output width.
"""

import dataclasses
import os

import torch

from expertize.modeling import SparseCode, SparseLayer

__all__ = ["TextCodes", "decode", "load_model", "text_codes"]


def load_model(model_dir: str | os.PathLike, device: "str | torch.device" = "cpu", dtype: torch.dtype | None = None):
    """(model, tokenizer) of a saved expertize folder, in eval mode on `device` (and `dtype`, default the saved one),
    after the checks every command makes (a whole model folder with sparse layers and a tokenizer)."""
    from .from_folder import load_for_inspection

    model, tokenizer = load_for_inspection(model_dir, device)
    return (model if dtype is None else model.to(dtype)), tokenizer


@dataclasses.dataclass
class TextCodes:
    """What one forward of a text leaves at each sparse layer (tensors on the CPU, the batch dim dropped)."""

    input_ids: torch.Tensor
    """(T,) the tokens read (`prompt_ids`: BOS first when the tokenizer has one)."""
    tokens: list[str]
    """Each token's text."""
    codes: dict[int, SparseCode]
    """Per sparse layer, (T, K) index and weights: the code the layer decoded."""
    inputs: dict[int, torch.Tensor]
    """Per sparse layer, (T, I): what entered it (what `decode` needs beside a code)."""
    outputs: dict[int, torch.Tensor]
    """Per sparse layer, (T, O): what it returned."""
    logits: torch.Tensor
    """(T, V) the model's next-token logits."""


@torch.no_grad()
def text_codes(model, tokenizer, text: str, layers: list[int] | None = None) -> TextCodes:
    """Run `text` through `model` once and keep, for each sparse layer (or `layers`), its input, its code and its
    output per token."""
    from ..surgery.families import model_positions
    from .from_folder import prompt_ids, token_texts

    sparse = model.sparse_layers()
    chosen = sorted(sparse) if layers is None else list(layers)
    missing = sorted(set(chosen) - set(sparse))
    if missing:
        raise ValueError(f"layer(s) {missing} are not sparse layers of this model; choose from {sorted(sparse)}")
    device = next(model.parameters()).device
    ids = prompt_ids(tokenizer, text, max_positions=model_positions(model.config))  # (1, T)
    inputs, codes, outputs, handles = {}, {}, {}, []

    def keeper(store: dict, index: int, take):
        def hook(module, args, *out):
            store[index] = take(args, *out)
        return hook

    for i in chosen:
        mlp = sparse[i]
        handles += [
            mlp.register_forward_pre_hook(keeper(inputs, i, lambda args: args[0][0].detach().cpu())),
            mlp.code_hook.register_forward_hook(keeper(codes, i, lambda args, code: SparseCode(
                code.top_k_index[0].detach().cpu(), code.top_k_weights[0].detach().cpu()))),
            mlp.register_forward_hook(keeper(outputs, i, lambda args, out: out[0].detach().cpu())),
        ]
    try:
        logits = model(input_ids=ids.to(device), use_cache=False).logits[0].cpu()  # (T, V)
    finally:
        for handle in handles:
            handle.remove()
    text_of = token_texts(tokenizer)
    return TextCodes(ids[0], [text_of(int(t)) for t in ids[0]], codes, inputs, outputs, logits)


def _as_code(code) -> SparseCode:
    """`code` as a `SparseCode`: one already, or an (index, weights) pair as `index, weights = cache.codes[i]`
    unpacks it (tensors or nested lists of the same shape, index integral); anything else is refused up front, not
    from inside the layer's forward hook."""
    from .corpora import InspectionError

    if isinstance(code, SparseCode):
        return code
    fix = ("pass the code as decode's code argument: SparseCode(index, weights) (from expertize.modeling import "
           "SparseCode) or an (index, weights) pair of (..., K) tensors")
    if not isinstance(code, (tuple, list)) or len(code) != 2:
        raise InspectionError(f"decode: expected a code, got {type(code).__name__}; {fix}")
    try:
        index, weights = (v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in code)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InspectionError(f"decode: the code's (index, weights) are not tensors ({e}); {fix}") from None
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise InspectionError(f"decode: the code's index (its first entry) holds {index.dtype}, not unit ids; "
                              "give (index, weights) in that order, index an integer tensor")
    if index.shape != weights.shape or index.dim() == 0:
        raise InspectionError(f"decode: the code's index {tuple(index.shape)} and weights {tuple(weights.shape)} "
                              "must have one (..., K) shape; give (index, weights) as text_codes returns them")
    return SparseCode(index.long(), weights)


@torch.no_grad()
def decode(model_or_layer, layer: int | None, code: SparseCode, x: torch.Tensor) -> torch.Tensor:
    """A sparse layer's output (..., O) for its input `x` (..., I) with its code replaced by `code` (..., K'), e.g. a
    `TextCodes` code with entries edited: a `SparseCode` or the (index, weights) pair it unpacks into. The input is
    needed because in most kinds a unit's contribution depends on it (an MxD expert scales the hidden code of x; a
    MoE-X expert is an MLP of x); a transcoder reads only its code (and the skip connection x). `model_or_layer` is a
    model with `layer` its sparse layer index, or a sparse layer (then `layer` is None)."""
    mlp = model_or_layer if layer is None else model_or_layer.sparse_layers()[layer]
    if not isinstance(mlp, SparseLayer):
        raise TypeError(f"expected a sparse layer (or a model and a sparse layer index), got {type(mlp).__name__}")
    code = _as_code(code)
    if tuple(code.top_k_index.shape[:-1]) != tuple(x.shape[:-1]):
        raise ValueError(f"the code covers {tuple(code.top_k_index.shape[:-1])} tokens but x {tuple(x.shape[:-1])}")
    param = next(mlp.parameters())
    x = x.to(device=param.device, dtype=param.dtype)

    def replace(module, args, shown: SparseCode) -> SparseCode:
        return SparseCode(code.top_k_index.to(shown.top_k_index.device),
                          code.top_k_weights.to(device=shown.top_k_weights.device, dtype=shown.top_k_weights.dtype))

    handle = mlp.code_hook.register_forward_hook(replace)
    try:
        return mlp(x)
    finally:
        handle.remove()
