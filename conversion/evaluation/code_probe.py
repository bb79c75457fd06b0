"""Does a layer's fidelity come from its per-token code, and what does a saved selection bias change?

Two readings on held-out tokens that the plain reconstruction metrics hide (issue 28):

- **Code share.** A layer with a dense path (MxD's hidden code Dᵀz, μMoE's, a skip connection) can stay faithful while
  its code says little: a collapsed or dying gate still reconstructs through the dense path. The probe gives every
  token the layer's *average* code (each unit at its mean weight over the probed tokens, through `code_hook`, so it
  works for every kind) and measures the FVU again. `code_share` = (FVU_mean_code − FVU) / (1 − FVU): the share of
  the variance the layer explains that is lost without the per-token code — 1 for a transcoder (its average code
  is a constant), about 0.25–0.45 for a healthy MxD on tiny-gpt2-shakespeare, near 0 when the dense path does all
  the work.
- **Bias altered.** With a selection bias left in the saved model (`train.balance_anneal: null`), the share of the
  code's (token, slot) choices that differ from plain top-K: each is a unit chosen over a better-scoring one.
  0 when the bias was annealed away (the default). Also: which selectable units are ever chosen over the whole
  held-out set (to count the units the balancing raised that now fire on their own).

The code share and the altered share are measured on the first PROBE_TOKENS held-out positions (the layer is run
again on them; the base model is not), the chosen units over every held-out position.

    T probed tokens, I d_in, O d_out, N code units, S selectable units, K slots per token, C chunk.
"""

import torch

from expertize.modeling import SparseLayer
from expertize.modeling.sparse_code import SparseCode

PROBE_TOKENS = 8192
"""Held-out positions kept per layer for the code-share and bias readings."""
CHUNK_TOKENS = 1024
"""Tokens decoded at once with the dense average code ((C, N) index and weight tensors)."""


def _fvu(y: torch.Tensor, y_hat: torch.Tensor) -> float:
    """Σ‖y − ŷ‖² / Σ‖y − ȳ‖² over the tokens (float64)."""
    y, y_hat = y.double(), y_hat.double()
    return float(((y - y_hat) ** 2).sum() / ((y - y.mean(0)) ** 2).sum().clamp_min(1e-30))


class CodeProbe:
    """Collects one layer's held-out (x, y) (the first PROBE_TOKENS positions) and the units its selection chose;
    `summary()` runs the readings."""

    def __init__(self, layer: SparseLayer) -> None:
        self.layer = layer
        self.xs: list[torch.Tensor] = []
        self.ys: list[torch.Tensor] = []
        self.kept = 0
        bias = getattr(layer, "b_select", None)
        self.chosen = None if bias is None else torch.zeros(bias.shape[0], dtype=torch.float32)
        """(S,) tokens on which each selectable unit was chosen and fired (layers with a selection bias)."""

    def update(self, x: torch.Tensor, y: torch.Tensor, code: SparseCode) -> None:
        """One batch: x (T, I) as the layer sees it, y (T, O) the MLP's output, `code` the layer's code of x."""
        if self.kept < PROBE_TOKENS:
            take = min(PROBE_TOKENS - self.kept, x.shape[0])
            self.xs.append(x[:take].detach())
            self.ys.append(y[:take].detach())
            self.kept += take
        if self.chosen is not None:
            self.chosen += self.layer.selection_load(code.top_k_index, code.top_k_weights).cpu()

    @torch.no_grad()
    def summary(self, raised: torch.Tensor | None = None) -> dict:
        """{"fvu_mean_code", "code_share", "bias_altered", and with `raised` (S,) bool — the units whose bias the
        balancing raised during training — "raised_firing": how many of them fire on the held-out tokens}."""
        out = {"fvu_mean_code": None, "code_share": None, "bias_altered": None}
        if raised is not None and self.chosen is not None:
            out["raised_firing"] = int((raised.cpu() & (self.chosen > 0)).sum())
        if not self.xs:
            return out
        layer = self.layer
        if layer.reads_other_layers:
            # A placed CLT layer's output is its sources' codes through fixed decoders plus a bias: no dense path, so
            # the code carries everything it explains (share 1, as a transcoder's measures); it cannot run alone.
            out["code_share"] = 1.0
            return out
        x, y = torch.cat(self.xs), torch.cat(self.ys)  # (T, I), (T, O)
        y_hat = torch.cat([layer(c) for c in x.split(CHUNK_TOKENS)])  # (T, O)
        codes = [layer.encode(c).flat() for c in x.split(CHUNK_TOKENS)]
        mean = torch.zeros(layer.num_units, dtype=torch.float64, device=x.device)  # (N,) mean weight per unit
        for code in codes:
            mean.index_add_(0, code.top_k_index.reshape(-1), code.top_k_weights.reshape(-1).double())
        mean = (mean / x.shape[0]).to(codes[0].top_k_weights.dtype)
        y_mean_code = torch.cat([layer.average_code_output(c, mean) for c in x.split(CHUNK_TOKENS)])
        fvu, fvu_mean_code = _fvu(y, y_hat), _fvu(y, y_mean_code)
        out["fvu_mean_code"] = fvu_mean_code
        if fvu < 1.0:
            out["code_share"] = min(1.0, max(0.0, (fvu_mean_code - fvu) / (1.0 - fvu)))
        bias = getattr(layer, "b_select", None)
        if bias is not None:
            out["bias_altered"] = 0.0 if not bool((bias != 0).any()) else self._altered(x, codes)
        return out

    def _altered(self, x: torch.Tensor, codes: list[SparseCode]) -> float:
        """Share of the biased code's (token, slot) entries whose unit plain top-K would not have chosen."""
        bias = self.layer.b_select
        saved = bias.clone()
        try:
            bias.zero_()
            plain = [self.layer.encode(c).flat() for c in x.split(CHUNK_TOKENS)]
        finally:
            bias.copy_(saved)
        altered = entries = 0
        for biased, unbiased in zip(codes, plain):
            a, b = biased.top_k_index, unbiased.top_k_index  # (C, K) each
            altered += int((a[:, :, None] != b[:, None, :]).all(-1).sum())
            entries += a.numel()
        return altered / max(entries, 1)
