"""`specialize`: masking, probing and steering of one sparse layer on named domain corpora, and their summary row.

Inputs are already split (splits.py): `fit` sequences assign units, choose steering units and train probes; `held`
sequences (other documents) give every reported ΔCE, F1 and steering effect. Unit statistics on the fit split come
from `expertize inspect`'s engine (`collect_stats`): per-domain firing rates, live units, mean activations.

Cost: one full forward over the fit text (statistics and pooled codes together), one over the eval text (base CE,
pooled codes and the prefix record of suffix.py), then every masking / steering condition on the blocks from the
sparse layer up only (conditions.py; bit for bit the full forward's CE). Every figure carries a bootstrap interval
over eval documents (bootstrap.py); one whose interval holds its random control's value prints "n.s.".
"""

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from ..inspection.stats import InspectionSettings, collect_stats, sparse_layers_of
from ..surgery.families import decoder_blocks
from .bootstrap import Estimate, domain_weights, significant
from .conditions import DomainCE, condition_ce
from .errors import SpecializationError
from .masking import MaskingRow, masking_rows, masking_summary, plan_masking
from .passes import CodePooler, pooled_dense
from .probing import ProbeResult, probe_domains
from .splits import content_mask
from .steering import SteeringRow, plan_steering, steering_rows, steering_summary
from .suffix import SuffixRunner

__all__ = ["STAGES", "SpecializationReport", "SpecializationSettings", "specialize"]


@dataclasses.dataclass
class SpecializationSettings:
    ratio: float = 2.0
    """Monet's assignment rule: rate on the domain >= ratio x rate on the second most frequent domain."""
    seed: int = 0
    """Random control units (masking, steering, probing), probe solver and bootstrap seed."""
    probe_ks: tuple[int, ...] = (1, 2, 4, 8, 16)
    probe_top: int = 100
    """1-D probes: the top units per domain by signed mean difference; the best test F1 among them is reported."""
    steer_scale: float = 4.0
    """λ = steer_scale x the steered unit's mean activation over its firing tokens (fit split)."""
    batch_size: int = 8
    bootstrap: int = 1000
    """Bootstrap replicates over eval documents for the intervals (0: no intervals)."""
    full_forward: bool = False
    """Measure every condition by a full forward (the reference) instead of the suffix replay."""
    stack_conditions: bool = False
    """Stack conditions along the batch up to batch_size rows (conditions.py: equal to float rounding only)."""


STAGES = ("unit statistics", "masking and steering", "probing", "dense probing")
"""The stages of `specialize`, in order (the last only with a base model)."""

FEW_DOCUMENTS = 10
"""Below this many eval documents in a domain, the report says its intervals are unreliable."""

SUMMARY_PAIRS = (("specificity", "random_specificity"), ("mask_delta_target", "random_mask_delta_target"),
                 ("steering_effect", "random_steering_effect"), ("probe_best_1d", "random_probe_best_1d"))
"""(figure, its random control) of the summary row; `summary()` adds "<figure>_significant" for each."""


@dataclasses.dataclass
class SpecializationReport:
    layer: int
    kind: str
    domains: list[str]
    num_units: int
    live_units: int
    base_ce: dict[str, float]
    """CE of the model (sparse layer in place, no intervention) on each domain's held-out text."""
    documents: dict[str, int]
    """Eval documents per domain: what the intervals resample."""
    masking: list[MaskingRow]
    probing: ProbeResult
    steering: list[SteeringRow]
    figures: dict[str, Estimate]
    """Summary figures with intervals (masking_summary, steering_summary)."""
    dense_probing: ProbeResult | None = None

    def summary(self) -> dict:
        """The table row: plain numbers (the figures' values; "<name>_ci" their intervals, "<name>_significant"
        whether a figure's interval excludes its random control's value)."""
        probes = {"probe_best_1d": self.probing.mean_best_1d,
                  "random_probe_best_1d": self.probing.estimate("random_best_1d"),
                  **{f"probe_f1_k{k}": self.probing.mean_k(k) for k in self.probing.ks},
                  **{f"random_probe_f1_k{k}": self.probing.estimate(f"random_k{k}") for k in self.probing.ks}}
        if self.dense_probing is not None:
            probes["dense_probe_best_1d"] = self.dense_probing.mean_best_1d
            probes.update({f"dense_probe_f1_k{k}": self.dense_probing.mean_k(k) for k in self.dense_probing.ks})
        masking = ("mask_delta_target", "mask_delta_others", "specificity", "random_mask_delta_target",
                   "random_mask_delta_others", "random_specificity")  # undefined when no domain has units
        figures = {**dict.fromkeys(masking, Estimate(math.nan, math.nan, math.nan, 0)), **self.figures, **probes}
        row = {"kind": self.kind, "layer": self.layer, "dead_fraction": 1 - self.live_units / self.num_units,
               "masked_domains": len(self.masking), "masked_units": sum(r.units for r in self.masking),
               "eval_documents": sum(self.documents.values())}
        for key, estimate in figures.items():
            row[key], row[f"{key}_ci"] = estimate.value, [estimate.low, estimate.high]
        for key, control in SUMMARY_PAIRS:
            row[f"{key}_significant"] = significant(figures[key], figures[control])
        for k in self.probing.ks:
            row[f"probe_f1_k{k}_significant"] = significant(figures[f"probe_f1_k{k}"],
                                                            figures[f"random_probe_f1_k{k}"])
        return row

    def to_json(self) -> dict:
        """Strict JSON: non-finite numbers (an infinite specificity, an undefined ratio) become null."""

        def rows(items, extra):
            out = []
            for r in items:
                fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
                out.append({k: v.to_json() if isinstance(v, Estimate) else v for k, v in fields.items()}
                           | {name: getattr(r, name) for name in extra})
            return out

        return _finite({
            "summary": self.summary(), "domains": self.domains, "base_ce": self.base_ce, "documents": self.documents,
            "masking": rows(self.masking, ("significant",)), "steering": rows(self.steering, ("significant",)),
            "probing": self.probing.to_json(),
            "dense_probing": None if self.dense_probing is None else self.dense_probing.to_json(),
        })

    def format(self) -> str:
        f = self.figures
        ns = lambda ok: "" if ok else " n.s."  # noqa: E731
        lines = [f"layer {self.layer} ({self.kind}): {self.live_units:,} of {self.num_units:,} units live on the fit "
                 "split; eval documents " + ", ".join(f"{d} {n}" for d, n in self.documents.items()),
                 "figures: value [95% interval, bootstrap over eval documents]; n.s.: the interval holds the random "
                 "control's value"]
        if min(self.documents.values()) < FEW_DOCUMENTS:
            lines.append(f"note: a domain with fewer than {FEW_DOCUMENTS} eval documents gives unreliable intervals; "
                         "more eval tokens or --document-tokens (fewer tokens per document) spread the budget wider")
        lines += ["", "masking (Monet's rule): domain | units | ΔCE target | ΔCE others | specificity | random: ΔCE "
                  "target | ΔCE others | specificity"]
        for r in self.masking:
            lines.append(f"  {r.domain} | {r.units} | {r.delta_target.format('+.4f')} | "
                         f"{r.delta_others.format('+.4f')} | {r.specificity.format('.2f')}{ns(r.significant)} | "
                         f"{r.random_delta_target.format('+.4f')} | {r.random_delta_others.format('+.4f')} | "
                         f"{r.random_specificity.format('.2f')}")
        p = self.probing
        lines += ["", "probing (mean F1 over domains, held-out contexts; random units in parentheses): best 1-D "
                  + _vs(p.mean_best_1d, p.estimate("random_best_1d")) + "; "
                  + ", ".join(f"k={k} " + _vs(p.mean_k(k), p.estimate(f"random_k{k}")) for k in p.ks)]
        if self.dense_probing is not None:
            dp = self.dense_probing
            lines.append("  dense MLP neurons: best 1-D " + _vs(dp.mean_best_1d, dp.estimate("random_best_1d"))
                         + "; " + ", ".join(f"k={k} " + _vs(dp.mean_k(k), dp.estimate(f"random_k{k}"))
                                            for k in dp.ks))
        lines += ["", "steering (CE drop, nats): domain | unit | λ | drop target | drop others | effect | random unit "
                  "effect"]
        for r in self.steering:
            lines.append(f"  {r.domain} | {r.unit} | {r.lam:.3g} | {r.drop_target.format('+.4f')} | "
                         f"{r.drop_others.format('+.4f')} | {r.effect.format('+.4f')}{ns(r.significant)} | "
                         f"{r.random_effect.format('+.4f')}")
        summary = []
        if "specificity" in f:
            summary.append(_specificity_summary(f))
        summary.append("steering effect " + _vs(f["steering_effect"], f["random_steering_effect"], "+.4f"))
        lines += ["", "summary: " + ", ".join(summary)]
        return "\n".join(lines)


def _vs(figure: Estimate, control: Estimate, spec: str = ".3f") -> str:
    """"figure [lo, hi] (control)", with " n.s." when the figure's interval holds the control's value."""
    flag = "" if significant(figure, control) else " n.s."
    return f"{figure.format(spec)}{flag} (random {format(control.value, spec)})"


def _ratio_text(ratio: Estimate, target: Estimate, others: Estimate) -> str:
    """A specificity for reading: its value and interval when it has a value, else why it has none (ΔCE(others) <=
    0 makes ΔCE(target) / ΔCE(others) infinite or undefined), with the two ΔCEs it would divide."""
    if math.isfinite(ratio.value):
        return ratio.format(".2f")
    deltas = f"ΔCE target {target.value:+.4f}, others {others.value:+.4f}"
    if ratio.value > 0:
        return f"unbounded ({deltas}: only the domains' own text got worse)"
    return f"undefined ({deltas}: masking made no text worse)"


def _specificity_summary(f: dict[str, Estimate]) -> str:
    """The summary's specificity beside its random control's; "n.s." only where both have a value."""
    spec, control = f["specificity"], f["random_specificity"]
    text = _ratio_text(spec, f["mask_delta_target"], f["mask_delta_others"])
    random = (format(control.value, ".2f") if math.isfinite(control.value)
              else _ratio_text(control, f["random_mask_delta_target"], f["random_mask_delta_others"]))
    flag = " n.s." if math.isfinite(spec.value) and math.isfinite(control.value) and not significant(
        spec, control) else ""
    return f"specificity {text}{flag} (random {random})"


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {(str(k) if not isinstance(k, str) else k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _labelled(sequences: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    names = list(sequences)
    labels = torch.cat([torch.full((s.shape[0],), d, dtype=torch.long) for d, s in enumerate(sequences.values())])
    return torch.cat([sequences[n] for n in names]), labels  # (S, T), (S,)


def _documents(held: dict[str, torch.Tensor], documents: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The eval contexts' document index per token (S, T); without them every context is its own document."""
    if documents is None:
        return {n: torch.arange(s.shape[0])[:, None].expand_as(s) for n, s in held.items()}
    if list(documents) != list(held) or any(documents[n].shape != held[n].shape for n in held):
        raise SpecializationError("held_documents must give a (S, T) document index for every held-out domain, "
                                  "shaped like its sequences")
    return documents


def specialize(
    model: nn.Module, fit: dict[str, torch.Tensor], held: dict[str, torch.Tensor], special_ids: list[int],
    settings: SpecializationSettings | None = None, layer: int | None = None, base_model: nn.Module | None = None,
    stage: Callable[[str], None] | None = None, held_documents: dict[str, torch.Tensor] | None = None,
) -> SpecializationReport:
    """Masking, probing and steering of `model`'s sparse layer `layer` (default: its only one).

    fit / held: {domain: (S, T) int64} token sequences from disjoint documents, same domains in the same order.
    held_documents: {domain: (S, T)} the document each held-out token comes from (splits.pack_with_documents); the
    intervals resample documents (None: every context counts as its own document). special_ids: token ids excluded
    from pooling (BOS, EOS, padding). base_model: the dense model, for the probing baseline on its MLP's hidden
    neurons at the same layer (None: no baseline). stage: called with the name of each of the `STAGES` as it starts
    (a progress bar)."""
    settings = settings or SpecializationSettings()
    stage = stage or (lambda name: None)
    if list(fit) != list(held):
        raise SpecializationError(f"fit and held-out corpora must name the same domains in order: {list(fit)} vs "
                                  f"{list(held)}")
    if len(fit) < 2:
        raise SpecializationError(f"give at least two domain corpora, got {len(fit)} ({', '.join(fit) or 'none'})")
    documents = _documents(held, held_documents)
    layers = sparse_layers_of(model)
    if layer is None:
        if len(layers) != 1:
            raise SpecializationError(f"the model has sparse layers {sorted(layers)}; choose one with --layer")
        layer = next(iter(layers))
    if layer not in layers:
        raise SpecializationError(f"layer {layer} is not a sparse layer of the model; choose from {sorted(layers)}")
    sparse, names = layers[layer], list(fit)
    T = next(iter(fit.values())).shape[1]
    (x_fit, y_fit), (x_held, y_held) = _labelled(fit), _labelled(held)
    m_fit, m_held = content_mask(x_fit, special_ids), content_mask(x_held, special_ids)

    stage(STAGES[0])
    fit_codes = CodePooler(sparse, m_fit)  # pooled in the statistics pass: one forward over the fit text
    with fit_codes.recording():
        stats = collect_stats(model, fit, InspectionSettings(tokens=0, context_length=T,
                                                             batch_size=settings.batch_size, top_n=1, vocab_top=1,
                                                             layers=(layer,)), token_text=str)
    ls = stats.layers[layer]
    rates, live = stats.domain_rates(layer), ls.counts > 0  # (D, U), (U,)
    if not live.any():
        raise SpecializationError(f"no unit of layer {layer} fired on the fit text; check the model and the corpora")

    stage(STAGES[1])
    masking_plan = plan_masking(rates, live, settings.ratio, settings.seed)
    steering_plan = plan_steering(rates, live, ls.mean_activation, settings.steer_scale, settings.seed)
    conditions = masking_plan.conditions() + steering_plan.conditions()
    first_steering = len(masking_plan.conditions())
    runner = SuffixRunner(model, layer)
    held_codes = CodePooler(sparse, m_held)  # pooled in each eval batch's full forward
    # The replay of blocks L… alone cannot serve a layer that reads earlier layers' codes of the same pass (a CLT's):
    # every condition is then a full forward.
    full_forward = settings.full_forward or any(m.reads_other_layers for m in model.sparse_layers().values())
    ce: list[DomainCE] = [
        condition_ce(runner, sparse, held[n], documents[n], conditions, settings.batch_size,
                     full_forward=full_forward, stack=settings.stack_conditions,
                     during_base=lambda lo, batch: held_codes.recording(), check=d == 0)
        for d, n in enumerate(names)
    ]
    weights, context_weights = domain_weights([documents[n] for n in names], settings.bootstrap, settings.seed)
    masking = masking_rows(names, masking_plan, ce, weights)
    steering = steering_rows(names, steering_plan, ce, weights, first_steering)
    figures = {**masking_summary(masking_plan, ce, weights),
               **steering_summary(steering_plan, ce, weights, first_steering)}

    # Probe test contexts are weighted by their (majority) document's draw count in each replicate.
    probe = dict(ks=settings.probe_ks, top=settings.probe_top, seed=settings.seed, test_weights=context_weights)
    stage(STAGES[2])
    probing = probe_domains(fit_codes.pooled, y_fit, held_codes.pooled, y_held, names, candidates=live, **probe)
    dense = None
    if base_model is not None:
        stage(STAGES[3])
        mlp = decoder_blocks(base_model)[layer].mlp
        dense = probe_domains(pooled_dense(base_model, mlp, x_fit, m_fit, settings.batch_size), y_fit,
                              pooled_dense(base_model, mlp, x_held, m_held, settings.batch_size), y_held, names,
                              **probe)
    return SpecializationReport(
        layer=layer, kind=sparse.spec.kind, domains=names, num_units=sparse.num_units,
        live_units=int(live.sum()),
        base_ce={n: float(c.base.sum() / c.tokens.sum()) for n, c in zip(names, ce)},
        documents={n: c.documents for n, c in zip(names, ce)}, masking=masking, probing=probing,
        steering=steering, figures=figures, dense_probing=dense,
    )
