"""`specialize`: masking, probing and steering of one sparse layer on named domain corpora, and their summary row.

Inputs are already split (splits.py): `fit` sequences assign units, choose steering units and train probes; `held`
sequences (other documents) give every reported ΔCE, F1 and steering effect. Unit statistics on the fit split come
from `expertize inspect`'s engine (`collect_stats`): per-domain firing rates, live units, mean activations.
"""

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from ..inspection.stats import InspectionSettings, collect_stats, sparse_layers_of
from ..surgery.families import decoder_blocks
from .errors import SpecializationError
from .masking import MaskingRow, domain_masking
from .passes import mean_ce, pooled_codes, pooled_dense
from .probing import ProbeResult, probe_domains
from .splits import content_mask
from .steering import SteeringRow, steer_domains

__all__ = ["SpecializationReport", "SpecializationSettings", "specialize"]


@dataclasses.dataclass
class SpecializationSettings:
    ratio: float = 2.0
    """Monet's assignment rule: rate on the domain >= ratio x rate on the second most frequent domain."""
    seed: int = 0
    """Random control units (masking, steering) and probe solver seed."""
    probe_ks: tuple[int, ...] = (1, 2, 4, 8, 16)
    probe_top: int = 100
    """1-D probes: the top units per domain by signed mean difference; the best test F1 among them is reported."""
    steer_scale: float = 4.0
    """λ = steer_scale x the steered unit's mean activation over its firing tokens (fit split)."""
    batch_size: int = 8


@dataclasses.dataclass
class SpecializationReport:
    layer: int
    kind: str
    domains: list[str]
    num_units: int
    live_units: int
    base_ce: dict[str, float]
    """CE of the model (sparse layer in place, no intervention) on each domain's held-out text."""
    masking: list[MaskingRow]
    probing: ProbeResult
    steering: list[SteeringRow]
    dense_probing: ProbeResult | None = None

    def summary(self) -> dict:
        """The table row. Specificity here is the ratio of the means over domains with assigned units,
        mean ΔCE(target) / mean ΔCE(others) (per-domain ratios explode where ΔCE(others) is ~0)."""
        from .masking import specificity

        def ratio(rows, target, others):
            if not rows:
                return math.nan
            return specificity(sum(getattr(r, target) for r in rows) / len(rows),
                               sum(getattr(r, others) for r in rows) / len(rows))

        row = {
            "kind": self.kind,
            "layer": self.layer,
            "dead_fraction": 1 - self.live_units / self.num_units,
            "masked_domains": len(self.masking),
            "masked_units": sum(r.units for r in self.masking),
            "mask_delta_target": _mean([r.delta_target for r in self.masking]),
            "mask_delta_others": _mean([r.delta_others for r in self.masking]),
            "specificity": ratio(self.masking, "delta_target", "delta_others"),
            "random_specificity": ratio(self.masking, "random_delta_target", "random_delta_others"),
            "probe_best_1d": self.probing.mean_best_1d,
            **{f"probe_f1_k{k}": self.probing.mean_k(k) for k in self.probing.k_sparse},
            "steering_effect": sum(r.effect for r in self.steering) / len(self.steering),
            "random_steering_effect": sum(r.random_effect for r in self.steering) / len(self.steering),
        }
        if self.dense_probing is not None:
            row["dense_probe_best_1d"] = self.dense_probing.mean_best_1d
            row.update({f"dense_probe_f1_k{k}": self.dense_probing.mean_k(k) for k in self.dense_probing.k_sparse})
        return row

    def to_json(self) -> dict:
        """Strict JSON: non-finite numbers (an infinite specificity, an undefined ratio) become null."""

        def rows(items, extra):
            return [{**dataclasses.asdict(r), **{name: getattr(r, name) for name in extra}} for r in items]

        return _finite({
            "summary": self.summary(), "domains": self.domains, "base_ce": self.base_ce,
            "masking": rows(self.masking, ("specificity", "random_specificity")),
            "steering": rows(self.steering, ("effect", "random_effect")),
            "probing": dataclasses.asdict(self.probing),
            "dense_probing": None if self.dense_probing is None else dataclasses.asdict(self.dense_probing),
        })

    def format(self) -> str:
        s = self.summary()
        lines = [f"layer {self.layer} ({self.kind}): {self.live_units:,} of {self.num_units:,} units live on the fit "
                 "split", "", "masking (Monet's rule): domain | units | ΔCE target | ΔCE others | specificity | "
                 "random: ΔCE target | ΔCE others | specificity"]
        for r in self.masking:
            lines.append(f"  {r.domain} | {r.units} | {r.delta_target:+.4f} | {r.delta_others:+.4f} | "
                         f"{r.specificity:.2f} | {r.random_delta_target:+.4f} | {r.random_delta_others:+.4f} | "
                         f"{r.random_specificity:.2f}")
        lines += ["", "probing (mean F1 over domains, held-out contexts): best 1-D "
                  f"{s['probe_best_1d']:.3f}; " + ", ".join(f"k={k} {self.probing.mean_k(k):.3f}"
                                                             for k in self.probing.k_sparse)]
        if self.dense_probing is not None:
            lines.append(f"  dense MLP neurons: best 1-D {self.dense_probing.mean_best_1d:.3f}; " + ", ".join(
                f"k={k} {self.dense_probing.mean_k(k):.3f}" for k in self.dense_probing.k_sparse))
        lines += ["", "steering (CE drop, nats): domain | unit | λ | drop target | drop others | effect | random unit "
                  "effect"]
        for r in self.steering:
            lines.append(f"  {r.domain} | {r.unit} | {r.lam:.3g} | {r.drop_target:+.4f} | {r.drop_others:+.4f} | "
                         f"{r.effect:+.4f} | {r.random_effect:+.4f}")
        lines += ["", f"summary: specificity {s['specificity']:.2f} (random {s['random_specificity']:.2f}), "
                  f"steering effect {s['steering_effect']:+.4f} (random {s['random_steering_effect']:+.4f})"]
        return "\n".join(lines)


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {(str(k) if not isinstance(k, str) else k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _labelled(sequences: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    names = list(sequences)
    labels = torch.cat([torch.full((s.shape[0],), d, dtype=torch.long) for d, s in enumerate(sequences.values())])
    return torch.cat([sequences[n] for n in names]), labels  # (S, T), (S,)


STAGES = ("unit statistics", "domain masking", "steering", "probing", "dense probing")
"""The stages of `specialize`, in order (the last only with a base model)."""


def specialize(
    model: nn.Module, fit: dict[str, torch.Tensor], held: dict[str, torch.Tensor], special_ids: list[int],
    settings: SpecializationSettings | None = None, layer: int | None = None, base_model: nn.Module | None = None,
    stage: Callable[[str], None] | None = None,
) -> SpecializationReport:
    """Masking, probing and steering of `model`'s sparse layer `layer` (default: its only one).

    fit / held: {domain: (S, T) int64} token sequences from disjoint documents, same domains in the same order.
    special_ids: token ids excluded from pooling (BOS, EOS, padding). base_model: the dense model, for the probing
    baseline on its MLP's hidden neurons at the same layer (None: no baseline). stage: called with the name of each
    of the `STAGES` as it starts (a progress bar)."""
    settings = settings or SpecializationSettings()
    stage = stage or (lambda name: None)
    if list(fit) != list(held):
        raise SpecializationError(f"fit and held-out corpora must name the same domains in order: {list(fit)} vs "
                                  f"{list(held)}")
    if len(fit) < 2:
        raise SpecializationError(f"give at least two domain corpora, got {len(fit)} ({', '.join(fit) or 'none'})")
    layers = sparse_layers_of(model)
    if layer is None:
        if len(layers) != 1:
            raise SpecializationError(f"the model has sparse layers {sorted(layers)}; choose one with --layer")
        layer = next(iter(layers))
    if layer not in layers:
        raise SpecializationError(f"layer {layer} is not a sparse layer of the model; choose from {sorted(layers)}")
    sparse = layers[layer]
    T = next(iter(fit.values())).shape[1]
    stage(STAGES[0])
    stats = collect_stats(model, fit, InspectionSettings(tokens=0, context_length=T, batch_size=settings.batch_size,
                                                         top_n=1, vocab_top=1, layers=(layer,)), token_text=str)
    ls = stats.layers[layer]
    rates, live = stats.domain_rates(layer), ls.counts > 0  # (D, U), (U,)
    if not live.any():
        raise SpecializationError(f"no unit of layer {layer} fired on the fit text; check the model and the corpora")
    stage(STAGES[1])
    base_ce = {n: mean_ce(model, s, settings.batch_size) for n, s in held.items()}
    masking = domain_masking(model, sparse, rates, live, held, settings.ratio, settings.seed, settings.batch_size,
                             base_ce)
    stage(STAGES[2])
    steering = steer_domains(model, sparse, rates, live, ls.mean_activation, held, settings.steer_scale,
                             settings.seed, settings.batch_size, base_ce)
    (x_fit, y_fit), (x_held, y_held) = _labelled(fit), _labelled(held)
    m_fit, m_held = content_mask(x_fit, special_ids), content_mask(x_held, special_ids)
    probe = dict(ks=settings.probe_ks, top=settings.probe_top, seed=settings.seed)
    stage(STAGES[3])
    probing = probe_domains(pooled_codes(model, sparse, x_fit, m_fit, settings.batch_size), y_fit,
                            pooled_codes(model, sparse, x_held, m_held, settings.batch_size), y_held, list(fit),
                            **probe)
    dense = None
    if base_model is not None:
        stage(STAGES[4])
        mlp = decoder_blocks(base_model)[layer].mlp
        dense = probe_domains(pooled_dense(base_model, mlp, x_fit, m_fit, settings.batch_size), y_fit,
                              pooled_dense(base_model, mlp, x_held, m_held, settings.batch_size), y_held, list(fit),
                              **probe)
    return SpecializationReport(
        layer=layer, kind=sparse.spec.kind, domains=list(fit), num_units=sparse.num_units,
        live_units=int(live.sum()), base_ce=base_ce, masking=masking, probing=probing, steering=steering,
        dense_probing=dense,
    )
