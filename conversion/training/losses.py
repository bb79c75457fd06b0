"""Metric definitions, each defined once: reconstruction losses, their streaming accumulator, and LM-level losses.

Reconstruction metrics compare a sparse layer's output ŷ with the frozen MLP's output y on the same inputs. Inputs
are (..., O); every leading dim counts as a token, so (B, T, O) and (B*T, O) give the same value.

    T tokens (leading dims flattened), O output dims, B batch, L sequence length, V vocabulary.
"""

import torch
from torch.nn import functional as F

__all__ = [
    "LOSSES",
    "ReconstructionStats",
    "fvu",
    "kl_base_to_other",
    "mse",
    "next_token_ce",
    "nmse_paper",
    "relative_mse",
]


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """(..., O) -> (T, O), upcast to at least float32 (bf16 losses lose too many digits)."""
    t = t.reshape(-1, t.shape[-1])  # (T, O)
    return t if t.dtype == torch.float64 else t.float()


def nmse_paper(y_hat: torch.Tensor, y: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The MxD paper's normalized MSE, also its training loss (MxD reference code `mse / y.norm(dim=-1)`):

        nmse_paper = 1/(T·O) · Σ_t Σ_o (ŷ_to − y_to)² / max(‖y_t‖₂, eps)

    i.e. the squared error of each token divided by the *unsquared* L2 norm of that token's target. Not scale-free:
    it scales linearly with the size of y. Differentiable.
    """
    y_hat, y = _tokens(y_hat), _tokens(y)
    norm = y.norm(dim=-1, keepdim=True).clamp_min(eps)  # (T, 1)
    return ((y_hat - y).pow(2) / norm).mean()


def relative_mse(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Scale-free relative squared error: Σ_t ‖ŷ_t − y_t‖² / Σ_t ‖y_t‖² (0: perfect; 1: as bad as predicting 0)."""
    y_hat, y = _tokens(y_hat), _tokens(y)
    return (y_hat - y).pow(2).sum() / y.pow(2).sum()


def fvu(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Fraction of variance unexplained (sparsify's definition), with ȳ the mean target over the tokens given:

        fvu = Σ_t ‖ŷ_t − y_t‖² / Σ_t ‖y_t − ȳ‖²

    (0: perfect; 1: as bad as predicting the mean output ȳ). Differentiable.
    """
    y_hat, y = _tokens(y_hat), _tokens(y)
    total_variance = (y - y.mean(dim=0)).pow(2).sum()
    return (y_hat - y).pow(2).sum() / total_variance


def mse(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Plain mean squared error over tokens and output dims: 1/(T·O) · Σ_t Σ_o (ŷ_to − y_to)²."""
    y_hat, y = _tokens(y_hat), _tokens(y)
    return (y_hat - y).pow(2).mean()


LOSSES = {"nmse": nmse_paper, "fvu": fvu, "mse": mse}
"""Recipe `train.loss` name -> loss function `(y_hat, y) -> scalar` (all differentiable)."""


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


def next_token_ce(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each next-token prediction, −log softmax(logits[:, t])[input_ids[:, t+1]], in float32.

    logits (B, L, V), input_ids (B, L) -> (B, L-1): position t predicts token t+1; the last position predicts nothing.
    """
    log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, L-1, V)
    return -log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, L-1)


def kl_base_to_other(base_logits: torch.Tensor, other_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_base ‖ p_other) = Σ_v p_base,v (log p_base,v − log p_other,v) of each next-token distribution, in float32.

    (B, L, V) each -> (B, L-1): the positions that predict a token, as in `next_token_ce`.
    """
    base = F.log_softmax(base_logits[:, :-1].float(), dim=-1)  # (B, L-1, V)
    other = F.log_softmax(other_logits[:, :-1].float(), dim=-1)  # (B, L-1, V)
    return (base.exp() * (base - other)).sum(dim=-1)  # (B, L-1)
