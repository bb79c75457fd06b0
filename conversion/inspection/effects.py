"""Each unit's direct effect on the output vocabulary: its output direction through the final norm and unembedding.

A unit's output direction d_n (O,) is what it adds to the residual stream per unit of activation. The layer says
what it is (modeling/sparse_base.py's contract), never its kind:

    layer.output_directions()      a fixed (U, O) direction per unit (a decoder row, e.g. a transcoder's W_dec[n])
    layer.token_directions         the direction depends on the token through the layer's hidden code z
                                   (`layer.hidden`): the mean of `direction_terms(z)` over the tokens where unit n
                                   fires, mapped to (U, O) by `directions_from_means` (e.g. MxD's c_n ⊙ mean Dᵀz)
    neither                        no direction (e.g. a product expert whose output is a non-linear function of x):
                                   the promoted / suppressed lists are empty

Its vocabulary effect is W_U · N(d_n) with N the final norm's linear part (LayerNorm: centre, then scale by γ;
RMSNorm: scale by γ; Gemma's RMSNorm: scale by 1 + γ; the family's `FinalNorm` row in surgery/families.py says
which), i.e. direct logit attribution up to the norm's per-token 1/σ: the top entries are the tokens the unit
promotes, the bottom ones those it suppresses (a logit soft cap, Gemma 2's, is monotone and keeps that order).
Token-dependent directions read the layer's own hidden code z during the inspection pass (its `hidden` output), never
recomputing it.
"""

import torch
from torch import nn

from ..surgery.families import final_norm, final_norm_scale

__all__ = ["EffectAccumulator", "final_norm", "vocab_effects"]

UNIT_CHUNK = 1024
"""Units whose (chunk, vocab) logit rows are formed at once."""


class EffectAccumulator:
    """Collects what a layer's output directions need during the inspection pass; `directions()` -> (U, O)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.sums: torch.Tensor | None = None  # (U, F) Σ direction_terms(z) over each unit's firing tokens
        self.counts = torch.zeros(layer.num_units, dtype=torch.float64)
        self._z: torch.Tensor | None = None
        self._wrapped = False

    @property
    def needs_hidden(self) -> bool:
        return bool(self.layer.token_directions)

    # -- during the pass ------------------------------------------------------------------------------------------

    def attach(self) -> None:
        """Read the hidden code z of each forward from the layer's own `hidden` (an instance attribute shadowing the
        method for the pass; removed by `detach`)."""
        if not self.needs_hidden:
            return
        original = self.layer.hidden

        def hidden(*args, **kwargs):
            z = original(*args, **kwargs)
            self._z = z.detach()
            return z

        self.layer.hidden = hidden
        self._wrapped = True

    def detach(self) -> None:
        if self._wrapped:
            del self.layer.hidden
            self._wrapped = False
        self._z = None

    @torch.no_grad()
    def update(self, unit: torch.Tensor, token: torch.Tensor, counts: torch.Tensor) -> None:
        """unit, token (P,): the batch's firing pairs (unit id, flat token index); counts (U,) firings per unit."""
        if not self.needs_hidden:
            return
        z = self._z.reshape(-1, self._z.shape[-1]).float()  # (B·T, H)
        rows = self.layer.direction_terms(z)  # (B·T, F)
        if self.sums is None:
            self.sums = torch.zeros(self.layer.num_units, rows.shape[-1], dtype=torch.float64, device=rows.device)
        # float32 within a batch, float64 across batches
        self.sums += torch.zeros(self.sums.shape, device=rows.device).index_add_(0, unit, rows[token]).double()
        self.counts = self.counts.to(unit.device) + counts

    # -- after the pass -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def directions(self) -> torch.Tensor | None:
        """(U, O) output direction per unit; NaN rows for units with no firing token where it depends on them;
        None for layers without one."""
        layer = self.layer
        fixed = layer.output_directions()
        if fixed is not None:
            return fixed.detach().float()
        if not self.needs_hidden:
            return None
        U = layer.num_units
        if self.sums is None:  # nothing fired at all
            return torch.full((U, layer.spec.d_out), float("nan"))
        mean = (self.sums / self.counts.clamp_min(1)[:, None]).float()  # (U, F)
        out = layer.directions_from_means(mean).detach().float()  # (U, O)
        return out.masked_fill((self.counts == 0)[:, None].to(out.device), float("nan"))


@torch.no_grad()
def vocab_effects(model: nn.Module, directions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k promoted and suppressed tokens per unit: directions (U, O) -> (ids, values), each (U, 2, k):
    [:, 0] promoted (largest logit first), [:, 1] suppressed (most negative first). NaN rows give NaN values."""
    centres, gamma = final_norm_scale(model)  # the family's final norm: LayerNorm centres; Gemma scales by 1 + w
    unembed = model.get_output_embeddings().weight.detach().float()  # (V, O)
    k = min(k, unembed.shape[0])
    ids, values = [], []
    for lo in range(0, directions.shape[0], UNIT_CHUNK):
        d = directions[lo : lo + UNIT_CHUNK].float().to(unembed.device)  # (c, O)
        if centres:
            d = d - d.mean(-1, keepdim=True)  # LayerNorm centres before scaling; RMSNorm does not
        if gamma is not None:
            d = d * gamma.to(d.device)  # (O,) per-channel scale
        logits = d @ unembed.T  # (c, V)
        top = logits.topk(k, dim=-1)
        bottom = (-logits).topk(k, dim=-1)
        ids.append(torch.stack([top.indices, bottom.indices], dim=1))  # (c, 2, k)
        values.append(torch.stack([top.values, -bottom.values], dim=1))
    return torch.cat(ids).cpu(), torch.cat(values).cpu()
