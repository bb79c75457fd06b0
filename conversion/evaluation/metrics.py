"""The evaluation's reconstruction metrics over many batches: `ReconstructionStats`, streaming float64 sums from
which the losses of training/losses.py (nmse_paper, relative_mse, fvu, mse) are exact over the whole held-out set.

    T tokens (leading dims flattened), O output dims.
"""

import torch

__all__ = ["ReconstructionStats"]


class ReconstructionStats:
    """Streaming float64 sums from which the reconstruction metrics of many batches are exact.

    `update(y_hat, y)` once per batch; `nmse_paper()`, `relative_mse()`, `fvu()` and `mse()` then equal the functions
    of the same name applied to the concatenation of all batches (up to float64 rounding). FVU needs the global mean
    ȳ: with a shift s (the first batch's mean, for numerical stability),
    Σ_t ‖y_t − ȳ‖² = Σ_t ‖y_t − s‖² − ‖Σ_t (y_t − s)‖² / T.
    """

    def __init__(self, eps: float = 1e-8) -> None:
        self.eps = eps
        self.count = 0
        """T: tokens seen."""
        self.sum_sq_err = 0.0  # Σ_t ‖ŷ_t − y_t‖²  (0-d tensors once updated)
        self.sum_sq_norm = 0.0  # Σ_t ‖y_t‖²
        self.sum_nmse_terms = 0.0  # Σ_t ‖ŷ_t − y_t‖² / max(‖y_t‖, eps)
        self.shift: torch.Tensor | None = None  # s: (O,)
        self.sum_shifted: torch.Tensor | None = None  # Σ_t (y_t − s): (O,)
        self.sum_sq_shifted = 0.0  # Σ_t ‖y_t − s‖²

    @torch.no_grad()
    def update(self, y_hat: torch.Tensor, y: torch.Tensor) -> None:
        y = y.reshape(-1, y.shape[-1]).double()  # (T, O)
        y_hat = y_hat.reshape(-1, y_hat.shape[-1]).to(device=y.device, dtype=torch.float64)  # (T, O)
        if y_hat.shape != y.shape:
            raise ValueError(f"y_hat has shape {tuple(y_hat.shape)} but y has {tuple(y.shape)} (as (tokens, dims))")
        if self.shift is None:
            self.shift = y.mean(dim=0)
            self.sum_shifted = torch.zeros_like(self.shift)
        sq_err = (y_hat - y).pow(2).sum(dim=-1)  # (T,)
        norm = y.norm(dim=-1)  # (T,)
        shifted = y - self.shift  # (T, O)
        self.count += y.shape[0]
        self.sum_sq_err = self.sum_sq_err + sq_err.sum()
        self.sum_sq_norm = self.sum_sq_norm + norm.pow(2).sum()
        self.sum_nmse_terms = self.sum_nmse_terms + (sq_err / norm.clamp_min(self.eps)).sum()
        self.sum_shifted = self.sum_shifted + shifted.sum(dim=0)
        self.sum_sq_shifted = self.sum_sq_shifted + shifted.pow(2).sum()

    def _check(self) -> None:
        if self.count == 0:
            raise ValueError("ReconstructionStats has seen no tokens; call update() first")

    @property
    def num_outputs(self) -> int:
        self._check()
        return self.shift.numel()

    def mean_output(self) -> torch.Tensor:
        """ȳ = Σ_t y_t / T, float64 (O,)."""
        self._check()
        return self.shift + self.sum_shifted / self.count

    def nmse_paper(self) -> float:
        self._check()
        return float(self.sum_nmse_terms / (self.count * self.num_outputs))

    def relative_mse(self) -> float:
        self._check()
        return float(self.sum_sq_err / self.sum_sq_norm)

    def fvu(self) -> float:
        self._check()
        total_variance = self.sum_sq_shifted - self.sum_shifted.pow(2).sum() / self.count
        return float(self.sum_sq_err / total_variance)

    def mse(self) -> float:
        self._check()
        return float(self.sum_sq_err / (self.count * self.num_outputs))

    def as_dict(self) -> dict[str, float]:
        return {
            "nmse_paper": self.nmse_paper(),
            "relative_mse": self.relative_mse(),
            "fvu": self.fvu(),
            "mse": self.mse(),
        }
