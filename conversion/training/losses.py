"""The losses, each defined once: reconstruction losses (distillation's `train.loss`, and the evaluation's metrics of
the same names) and LM-level losses (healing's objectives, the evaluation's CE and KL).

Reconstruction losses compare a sparse layer's output ŷ with the frozen MLP's output y on the same inputs. Inputs
are (..., O); every leading dim counts as a token, so (B, T, O) and (B*T, O) give the same value.

    T tokens (leading dims flattened), O output dims, B batch, L sequence length, V vocabulary.
"""

import torch
from torch.nn import functional as F

__all__ = [
    "LOSSES",
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
