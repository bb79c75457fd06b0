"""Confidence intervals by bootstrap over evaluation *documents* (not tokens, not contexts).

Tokens of one document are not independent draws, and a packed context holds parts of several documents, so the unit
resampled is the document: each replicate draws, per domain and independently of the other domains, as many documents
as the domain's eval side has, with replacement (seeded). Every figure is then computed from the replicate's
per-document sums exactly as from the data — a ΔCE as Σ_doc w·(CE sum under the condition − CE sum at base) /
Σ_doc w·(predicted tokens), a probe F1 from contexts weighted by their document's draw count — and all figures of one
replicate share its draw (paired: a figure and its random control see the same documents).

A figure is carried as a `Replicates` vector (R + 1,): entry 0 the figure on the data (every weight 1), entries 1…R
its bootstrap replicates, so arithmetic on figures (means over domains, ratios, differences) carries the intervals
along. `Estimate` is the summary: the value and the 95 % percentile interval.

A figure whose interval contains its random control's value is reported as not significant ("n.s.", `significant`).
"""

import dataclasses
import math

import torch

__all__ = [
    "Estimate", "Replicates", "context_documents", "document_weights", "domain_weights", "local_documents",
    "mean_change", "ratio", "significant",
]

Replicates = torch.Tensor
"""(R + 1,) float64: [the figure on the data, its R bootstrap replicates]."""

LEVEL = 0.95


def document_weights(documents: int, replicates: int, seed: int) -> torch.Tensor:
    """(R + 1, n) float64 draw counts of n documents: row 0 all ones (the data), rows 1…R multinomial resamples of n
    documents with replacement (seeded)."""
    if documents < 1:
        raise ValueError("a bootstrap over documents needs at least one document")
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, documents, (replicates, documents), generator=gen)  # (R, n)
    counts = torch.zeros(replicates, documents, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(replicates, documents, dtype=torch.float64))
    return torch.cat([torch.ones(1, documents, dtype=torch.float64), counts])  # (R + 1, n)


def local_documents(documents: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(S, T) document index per token (-1: BOS, no document) -> (the same relabelled 0…n−1 in order of index, n)."""
    present = documents >= 0
    ids, local = torch.unique(documents[present], return_inverse=True)
    out = torch.full_like(documents, -1)
    out[present] = local
    return out, ids.numel()


def context_documents(local: torch.Tensor) -> torch.Tensor:
    """(S, T) local document index per token -> (S,) the document holding most of each context's tokens (ties: the
    lower index), the unit a context-level figure (a probe's F1) resamples."""
    n = int(local.max()) + 1
    counts = torch.zeros(local.shape[0], n + 1, dtype=torch.long)
    counts.scatter_add_(1, (local + 1).clamp_min(0), torch.ones_like(local))  # column 0: BOS
    return counts[:, 1:].argmax(1)


def domain_weights(documents: list[torch.Tensor], replicates: int, seed: int) -> tuple[list[torch.Tensor],
                                                                                       torch.Tensor]:
    """The draws of one bootstrap over several domains' eval text, documents[d] (S_d, T) the document index of each
    token: per domain its (R + 1, n_d) document draw counts (resampled independently, seed·7919 + d), and
    (R + 1, Σ S_d) the draw count of each context's (majority) document, contexts in domain order."""
    weights, contexts = [], []
    for d, docs in enumerate(documents):
        local, n = local_documents(docs)
        weights.append(document_weights(n, replicates, seed * 7919 + d))
        contexts.append(weights[-1][:, context_documents(local)])
    return weights, torch.cat(contexts, dim=1)


def mean_change(sums: torch.Tensor, base: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor) -> Replicates:
    """Mean CE change per predicted token, (Σ_doc w·(sums − base)) / (Σ_doc w·tokens): sums, base, tokens (n,)
    per-document, weights (R + 1, n) -> (R + 1,)."""
    return (weights @ (sums - base)) / (weights @ tokens)


def ratio(num: Replicates, den: Replicates) -> Replicates:
    """num / den elementwise, with the specificity convention where den <= 0: +inf when num > 0, else NaN."""
    out = torch.full_like(num, math.nan)
    out = torch.where((den <= 0) & (num > 0), torch.full_like(num, math.inf), out)
    return torch.where(den > 0, num / den.where(den > 0, torch.ones_like(den)), out)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A figure with its 95 % bootstrap interval over documents (NaN bounds: undefined, e.g. too few documents)."""

    value: float
    low: float
    high: float
    replicates: int
    """How many bootstrap replicates gave the interval (0: no interval)."""

    @classmethod
    def of(cls, vector: Replicates) -> "Estimate":
        """From a (R + 1,) vector. Percentiles by rank (no interpolation, so infinite values stay meaningful); a
        replicate whose figure is undefined (NaN) sorts above +inf, so undefined replicates widen the interval."""
        vector = vector.double().cpu()
        value, reps = float(vector[0]), vector[1:]
        R = reps.numel()
        if R == 0:
            return cls(value, math.nan, math.nan, 0)
        ordered = reps.sort().values  # NaN last
        lo = ordered[max(0, math.floor((1 - LEVEL) / 2 * R))]
        hi = ordered[min(R - 1, math.ceil((1 + LEVEL) / 2 * R) - 1)]
        return cls(value, float(lo), float(hi), R)

    def contains(self, x: float) -> bool:
        """Whether x lies in the interval (an undefined bound counts as open on that side)."""
        low_ok = math.isnan(self.low) or self.low <= x
        high_ok = math.isnan(self.high) or x <= self.high
        return low_ok and high_ok

    def format(self, spec: str) -> str:
        """"value [low, high]" with the format spec (e.g. "+.4f")."""
        def f(x):
            return "n/a" if math.isnan(x) else ("inf" if x == math.inf else "-inf" if x == -math.inf else
                                                format(x, spec))
        if not self.replicates:
            return f(self.value)
        return f"{f(self.value)} [{f(self.low)}, {f(self.high)}]"

    def to_json(self) -> dict:
        return {"value": self.value, "ci": [self.low, self.high], "level": LEVEL, "replicates": self.replicates}


def significant(figure: Estimate, control: Estimate) -> bool:
    """False when the figure's interval contains its random control's value ("n.s."), or either is undefined."""
    if math.isnan(figure.value) or math.isnan(control.value):
        return False
    return not figure.contains(control.value)
