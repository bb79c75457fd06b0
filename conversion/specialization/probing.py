"""Sparse probing (the MxD paper's SAEBench-style protocol, §6): which domain does a context come from?

Features: one vector per context (the sparse code, or the dense MLP's hidden neurons for the baseline, mean-pooled over
content tokens; passes.py). Each domain is a one-vs-rest binary task:

    selection    units ranked by the signed mean difference mean(x | domain) − mean(x | other) on the TRAIN contexts
    1-D probes   a logistic regression on each of the top `top` units alone; reported: the max test F1 over them
                 (the paper's protocol: an upper bound, the best single unit chosen with the test labels)
    k-sparse     one logistic regression on the top k units together (k = 1, 2, 4, 8, 16); test F1

Train and test contexts come from disjoint documents (splits.py). Features are standardized with the train
statistics; scikit-learn's LogisticRegression (lbfgs, C=1, balanced class weights). Reported numbers are means over
the domains.
"""

import dataclasses

import torch

__all__ = ["ProbeResult", "binary_f1", "probe_domains", "select_units"]


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


def _fit_f1(x_train, y_train, x_test, y_test, seed: int) -> float:
    from sklearn.linear_model import LogisticRegression

    mean, std = x_train.mean(0), x_train.std(0)
    std[std == 0] = 1.0  # a constant feature stays 0 after centring
    probe = LogisticRegression(C=1.0, class_weight="balanced", max_iter=1000, random_state=seed)
    probe.fit(((x_train - mean) / std).numpy(), y_train.numpy())
    predicted = torch.from_numpy(probe.predict(((x_test - mean) / std).numpy()))
    return binary_f1(predicted, y_test)


@dataclasses.dataclass
class ProbeResult:
    best_1d: dict[str, float]
    """Per domain: the max test F1 of the 1-D probes on its top units."""
    k_sparse: dict[int, dict[str, float]]
    """k -> per domain: test F1 of the probe on its top-k units."""
    selected: dict[str, list[int]]
    """Per domain: the top units, best first."""

    @property
    def mean_best_1d(self) -> float:
        return sum(self.best_1d.values()) / len(self.best_1d)

    def mean_k(self, k: int) -> float:
        return sum(self.k_sparse[k].values()) / len(self.k_sparse[k])


def probe_domains(
    x_train: torch.Tensor, label_train: torch.Tensor, x_test: torch.Tensor, label_test: torch.Tensor,
    domains: list[str], ks: tuple[int, ...] = (1, 2, 4, 8, 16), top: int = 100, seed: int = 0,
) -> ProbeResult:
    """x_* (S, F) pooled features, label_* (S,) int64 domain index into `domains`. Domains with no train or no test
    context of their own are skipped (they have no binary task)."""
    x_train, x_test = x_train.double(), x_test.double()
    best_1d, k_sparse, selected = {}, {k: {} for k in ks}, {}
    for d, name in enumerate(domains):
        y_train, y_test = label_train == d, label_test == d
        if not (y_train.any() and (~y_train).any() and y_test.any()):
            continue
        units = select_units(x_train, y_train, max(top, max(ks)))
        selected[name] = units[:top].tolist()
        best_1d[name] = max(
            _fit_f1(x_train[:, [u]], y_train, x_test[:, [u]], y_test, seed) for u in units[:top].tolist()
        )
        for k in ks:
            chosen = units[:k]
            k_sparse[k][name] = _fit_f1(x_train[:, chosen], y_train, x_test[:, chosen], y_test, seed)
    if not best_1d:
        raise ValueError("no domain has both train and test contexts; give more text per domain")
    return ProbeResult(best_1d, k_sparse, selected)
