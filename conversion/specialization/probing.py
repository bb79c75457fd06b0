"""Sparse probing (the MxD paper's SAEBench-style protocol, §6): which domain does a context come from?

Features: one vector per context (the sparse code, or the dense MLP's hidden neurons for the baseline, mean-pooled over
content tokens; passes.py). Each domain is a one-vs-rest binary task:

    selection    units ranked by the signed mean difference mean(x | domain) − mean(x | other) on the TRAIN contexts
    1-D probes   a logistic regression on each of the top `top` units alone; reported: the max test F1 over them
                 (the paper's protocol: an upper bound, the best single unit chosen with the test labels)
    k-sparse     one logistic regression on the top k units together (k = 1, 2, 4, 8, 16); test F1

Train and test contexts come from disjoint documents (splits.py). Features are standardized with the train
statistics; scikit-learn's LogisticRegression (lbfgs, C=1, balanced class weights). Reported numbers are means over
the domains, each with its bootstrap interval over the test contexts' documents (bootstrap.py: a context counts as
many times as its document is drawn; probes stay fitted on the train contexts), beside the same protocol on units
drawn at random among the live ones (the control: does the selection matter?).
"""

import dataclasses

import torch

from .bootstrap import Estimate

__all__ = ["ProbeResult", "binary_f1", "probe_domains", "select_units", "weighted_f1"]


def select_units(x: torch.Tensor, positive: torch.Tensor, n: int) -> torch.Tensor:
    """x (S, F), positive (S,) bool -> the (n,) feature ids with the largest mean(x | pos) − mean(x | neg), best
    first (ties: lower id first)."""
    diff = x[positive].double().mean(0) - x[~positive].double().mean(0)  # (F,)
    order = sorted(range(diff.numel()), key=lambda f: (-float(diff[f]), f))
    return torch.tensor(order[:n], dtype=torch.long)


def binary_f1(predicted: torch.Tensor, truth: torch.Tensor) -> float:
    """F1 of the positive class: 2 TP / (2 TP + FP + FN); 0 when there is no positive at all."""
    predicted, truth = predicted.bool(), truth.bool()
    tp = int((predicted & truth).sum())
    fp = int((predicted & ~truth).sum())
    fn = int((~predicted & truth).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def weighted_f1(predicted: torch.Tensor, truth: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """F1 of the positive class with weighted contexts: predicted (P, S) bool (P probes), truth (S,) bool, weights
    (R + 1, S) -> (R + 1, P); 0 where a replicate has no true positive (`binary_f1` with counts for weights)."""
    p, t = predicted.double(), truth.double()
    tp = weights @ (p * t).T  # (R + 1, P)
    fp = weights @ (p * (1 - t)).T
    fn = weights @ ((1 - p) * t).T
    return torch.where(tp > 0, 2 * tp / (2 * tp + fp + fn).clamp_min(1e-300), torch.zeros_like(tp))


def _fit_predict(x_train, y_train, x_test, seed: int) -> torch.Tensor:
    """A logistic probe fitted on the train contexts: its (S_test,) bool predictions."""
    from sklearn.linear_model import LogisticRegression

    mean, std = x_train.mean(0), x_train.std(0)
    std[std == 0] = 1.0  # a constant feature stays 0 after centring
    probe = LogisticRegression(C=1.0, class_weight="balanced", max_iter=1000, random_state=seed)
    probe.fit(((x_train - mean) / std).numpy(), y_train.numpy())
    return torch.from_numpy(probe.predict(((x_test - mean) / std).numpy())).bool()


@dataclasses.dataclass
class ProbeResult:
    """Test F1 per metric and domain as bootstrap replicate vectors (R + 1,) (bootstrap.py: entry 0 the figure).

    Metrics: "best_1d" (the max test F1 of the 1-D probes on the domain's top units), "k1", "k2", … (the probe on
    its top-k units), and the same with "random_" for units drawn at random among the candidates (the control)."""

    f1: dict[str, dict[str, torch.Tensor]]
    selected: dict[str, list[int]]
    """Per domain: the top units, best first."""
    ks: tuple[int, ...]
    random_selected: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Per domain: the control's units, in the order its probes take them."""

    def value(self, metric: str, domain: str) -> float:
        return float(self.f1[metric][domain][0])

    def estimate(self, metric: str, domain: str | None = None) -> Estimate:
        """The figure of one domain, or (None) the mean over the domains."""
        table = self.f1[metric]
        return Estimate.of(table[domain] if domain is not None else torch.stack(list(table.values())).mean(0))

    @property
    def mean_best_1d(self) -> Estimate:
        return self.estimate("best_1d")

    def mean_k(self, k: int) -> Estimate:
        return self.estimate(f"k{k}")

    def to_json(self) -> dict:
        return {"ks": list(self.ks), "selected": self.selected, "random_selected": self.random_selected,
                "f1": {m: {d: Estimate.of(v).to_json() for d, v in t.items()} for m, t in self.f1.items()},
                "mean": {m: self.estimate(m).to_json() for m in self.f1}}


def probe_domains(
    x_train: torch.Tensor, label_train: torch.Tensor, x_test: torch.Tensor, label_test: torch.Tensor,
    domains: list[str], ks: tuple[int, ...] = (1, 2, 4, 8, 16), top: int = 100, seed: int = 0,
    test_weights: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
) -> ProbeResult:
    """x_* (S, F) pooled features, label_* (S,) int64 domain index into `domains`. test_weights (R + 1, S_test): the
    bootstrap draw counts of each test context's document (None: no interval). candidates (F,) bool: the features
    the random control draws from (None: every feature that varies on the train contexts). Domains with no train or
    no test context of their own are skipped (they have no binary task)."""
    x_train, x_test = x_train.double(), x_test.double()
    weights = torch.ones(1, x_test.shape[0], dtype=torch.float64) if test_weights is None else test_weights
    if candidates is None:
        candidates = x_train.std(0) > 0
    pool = torch.nonzero(candidates).flatten()
    f1 = {m: {} for p in ("", "random_") for m in (p + "best_1d", *(f"{p}k{k}" for k in ks))}
    selected, random_selected = {}, {}
    for d, name in enumerate(domains):
        y_train, y_test = label_train == d, label_test == d
        if not (y_train.any() and (~y_train).any() and y_test.any()):
            continue
        units = select_units(x_train, y_train, max(top, max(ks)))
        selected[name] = units[:top].tolist()
        gen = torch.Generator().manual_seed(seed + d)
        control = pool[torch.randperm(pool.numel(), generator=gen)[: max(top, max(ks))]]
        random_selected[name] = control.tolist()
        for prefix, chosen in (("", units), ("random_", control)):
            singles = torch.stack([_fit_predict(x_train[:, [u]], y_train, x_test[:, [u]], seed)
                                   for u in chosen[:top].tolist()])  # (top, S_test)
            f1[prefix + "best_1d"][name] = weighted_f1(singles, y_test, weights).max(1).values
            for k in ks:
                cols = chosen[:k]
                predicted = _fit_predict(x_train[:, cols], y_train, x_test[:, cols], seed)
                f1[f"{prefix}k{k}"][name] = weighted_f1(predicted[None], y_test, weights)[:, 0]
    if not selected:
        raise ValueError("no domain has both train and test contexts; give more text per domain")
    return ProbeResult(f1, selected, tuple(ks), random_selected)
