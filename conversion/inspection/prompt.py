"""Per-prompt view: which units fire on each token of one prompt (the top few per sparse layer, with values).

Reads each layer's unit activations at `mlp.activation_hook` (the code hook unless the kind declares another view)
during one forward (what a model card's hook snippet does by hand).
"""

from dataclasses import dataclass

import torch
from torch import nn

from .stats import sparse_layers_of

__all__ = ["PromptView", "format_prompt_view", "prompt_view"]


@dataclass
class PromptView:
    tokens: list[str]
    """Display text of each token."""
    layers: dict[int, str]
    """Sparse layer index -> kind."""
    units: dict[int, list[list[tuple[int, float]]]]
    """Layer -> per token, the firing units (id, activation) by activation, at most `top`."""


@torch.no_grad()
def prompt_view(model: nn.Module, input_ids: torch.Tensor, token_text, top: int = 5) -> PromptView:
    """input_ids (1, T) -> the top `top` firing units per token and sparse layer."""
    layers = sparse_layers_of(model)
    codes: dict[int, object] = {}
    handles = [
        layer.activation_hook.register_forward_hook(lambda m, a, out, i=i: codes.__setitem__(i, out))
        for i, layer in layers.items()
    ]
    try:
        model.eval()(input_ids=input_ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    units = {}
    for i, code in codes.items():
        K = code.top_k_index.shape[-1]
        index, weights = code.top_k_index.reshape(-1, K).cpu(), code.top_k_weights.reshape(-1, K).float().cpu()
        n = min(top, K)
        values, slots = weights.topk(n, dim=-1)  # (T, n) largest weights first
        ids = index.gather(-1, slots)
        active = layers[i].active_entries(values)  # (T, n) bool: the layer's rule, as inspection's statistics
        units[i] = [
            [(u, v) for u, v, on in zip(row_ids, row_values, row_active) if on]
            for row_ids, row_values, row_active in zip(ids.tolist(), values.tolist(), active.tolist())
        ]
    return PromptView(
        tokens=[token_text(t) for t in input_ids[0].tolist()],
        layers={i: layer.spec.kind for i, layer in sorted(layers.items())},
        units=units,
    )


def format_prompt_view(view: PromptView) -> str:
    """A plain-text table: one row per token, one column per sparse layer ("unit:value" pairs)."""
    cells = {i: [" ".join(f"{u}:{v:.3g}" for u, v in row) or "-" for row in view.units[i]] for i in view.layers}
    shown = [repr(t)[1:-1] if t.strip() == t and t else repr(t) for t in view.tokens]
    tok_w = max([5] + [len(s) for s in shown])
    widths = {i: max([len(f"layer {i} ({kind})")] + [len(c) for c in cells[i]]) for i, kind in view.layers.items()}
    header = f"{'pos':>4}  {'token':<{tok_w}}  " + "  ".join(
        f"{f'layer {i} ({kind})':<{widths[i]}}" for i, kind in view.layers.items()
    )
    lines = [header.rstrip(), "-" * len(header.rstrip())]
    for p, tok in enumerate(shown):
        row = f"{p:>4}  {tok:<{tok_w}}  " + "  ".join(f"{cells[i][p]:<{widths[i]}}" for i in view.layers)
        lines.append(row.rstrip())
    return "\n".join(lines)
