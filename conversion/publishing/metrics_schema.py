"""The typed schema of metrics.json: what `expertize upcycle` and `expertize eval` record, read back by the model card,
`expertize plot-sweep` and the CLI's end-of-run summary.

    Metrics
        layers: {"8": LayerMetrics}      reconstruction of each replaced MLP (evaluation/evaluate.py)
        ce: CeMetrics                    next-token CE: base, spliced, ablations, KL, CE recovered
        generation: GenerationMetrics    greedy continuations identical to the base (None when not run)
        eval_tokens                      held-out tokens evaluated
        reconstruction_positions         which of them the reconstruction metrics cover (special tokens left out)
        train: TrainSummary              distillation steps and tokens
        init: InitMetrics                CE of the dense initialisation (layer.init: split | copy)
        heal: HealSummary                end-to-end healing (heal: section)
        stacking: StackingMetrics        a run on an expertize base: the cost against the original dense model
        example_prompt                   the start of a held-out document (the card's generation example)
        recipe_summary: {setting: value} the card's Training rows
        lm_eval: LmEval                  lm-eval results, base vs this model (eval.lm_eval_tasks / `expertize eval`)

Adding a metric: a field on the section's dataclass (with a `title` for the card, when the card shows it) and the
code that computes it. Readers tolerate what they do not know: keys from a newer expertize are kept in each
section's `extra` and written back unchanged; a missing key reads as None. A value of the wrong type is an error
naming its key. Non-finite floats are written as null (run_folder.strict_json), so they read back as None.
"""

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ExpertizeError
from .formats import format_number, format_percent

__all__ = [
    "CeMetrics", "GenerationMetrics", "HealSummary", "InitMetrics", "LayerMetrics", "LmEval", "LmEvalMetric",
    "LmEvalTask", "Metrics", "MetricsError", "ReconstructionPositions", "StackingMetrics", "TrainSummary",
    "load_metrics",
    "scalar_metric_paths",
]


class MetricsError(ExpertizeError, ValueError):
    """metrics.json does not match the schema (a value of the wrong type); the message names the key."""


def _title(title: str, fmt: str = "number") -> dict:
    """Field metadata: the card's label and how it formats the value (number, percent, count, l0, units)."""
    return {"title": title, "format": fmt}


@dataclass
class _Section:
    extra: dict[str, Any] = field(default_factory=dict, kw_only=True, repr=False, compare=True)
    """Keys this version of expertize does not know (written by a newer one): kept and written back."""

    @classmethod
    def from_dict(cls, data: Any, path: str = ""):
        if not isinstance(data, dict):
            raise MetricsError(f"metrics.json{_where(path)}: expected an object, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        known, names = {}, set()
        for f in dataclasses.fields(cls):
            if f.name == "extra":
                continue
            names.add(f.name)
            if f.name in data:
                known[f.name] = _coerce(hints[f.name], data[f.name], f"{path}.{f.name}" if path else f.name)
        return cls(**known, extra={k: v for k, v in data.items() if k not in names})

    def to_dict(self) -> dict[str, Any]:
        """Every known key (None where missing), then the unknown ones."""
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**out, **self.extra}

    @classmethod
    def titled_fields(cls) -> list[dataclasses.Field]:
        """The fields the card shows, in order (those with a `title`)."""
        return [f for f in dataclasses.fields(cls) if "title" in f.metadata]


def _where(path: str) -> str:
    return f" at {path!r}" if path else ""


def _plain(value: Any) -> Any:
    if isinstance(value, _Section):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _coerce(hint: Any, value: Any, path: str) -> Any:
    """`value` read as type `hint` (Optional, dataclass sections, dict[str, X], list[X], int, float, str, bool)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, path)
            except MetricsError as e:
                errors.append(e)
        raise errors[0]
    if isinstance(hint, type) and issubclass(hint, _Section):
        return hint.from_dict(value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise MetricsError(f"metrics.json{_where(path)}: expected an object, got {type(value).__name__}")
        return {str(k): _coerce(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise MetricsError(f"metrics.json{_where(path)}: expected a list, got {type(value).__name__}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if isinstance(value, int) else value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if hint in (str, bool) and isinstance(value, hint):
        return value
    raise MetricsError(
        f"metrics.json{_where(path)}: expected {getattr(hint, '__name__', hint)}, got {value!r}; the file was "
        "edited by hand or written by an incompatible tool: rerun `expertize eval` or the recipe to rewrite it"
    )


@dataclass
class BalanceSummary(_Section):
    """The selection-bias balancing of one layer during training (training/balance.py)."""

    rule: str | None = None
    """"floor" or "bias" (train.balance)."""
    floor: float | None = None
    anneal: list[float] | None = None
    """[start, end] fractions of the run over which the bias decayed to 0; None: held to the end."""
    units_raised: int | None = None
    """Units whose bias the rule raised above 0 at some step (the units it helped)."""
    bias_at_end: bool | None = None
    """Whether a nonzero bias is saved with the layer (routing at inference uses it)."""


@dataclass
class LayerMetrics(_Section):
    """Reconstruction of one replaced MLP on held-out tokens, and its sparse code."""

    nmse_paper: float | None = field(default=None, metadata=_title("NMSE (MxD paper)"))
    relative_mse: float | None = field(default=None, metadata=_title("relative MSE"))
    fvu: float | None = field(default=None, metadata=_title("FVU"))
    mse: float | None = field(default=None, metadata=_title("MSE"))
    l0: float | None = field(default=None, metadata=_title("L0", "l0"))
    dead_units: int | None = None
    dead_fraction: float | None = None
    num_units: int | None = None
    usage_entropy: float | None = None
    """Entropy (nats) of the firings' distribution over the units (log N when all fire equally often)."""
    effective_units: float | None = field(default=None, metadata=_title("effective units (exp entropy)", "units"))
    fvu_mean_code: float | None = None
    """FVU with every token given the layer's average code (evaluation/code_probe.py)."""
    code_share: float | None = field(default=None, metadata=_title("share of fidelity from the code", "percent"))
    """(fvu_mean_code − FVU) / (1 − FVU): the share of the explained variance the per-token code carries (1 for a
    transcoder; near 0 when a dense path does the work)."""
    bias_altered: float | None = None
    """Share of the code's choices a selection bias saved with the layer changes on held-out tokens (0 when the
    bias was annealed away; None for layers without one)."""
    raised_firing: int | None = None
    """Of the units whose selection bias the balancing raised during training, how many fire on the held-out tokens."""
    balance: BalanceSummary | None = None
    """What the training's selection-bias balancing did (None when the layer trained without it)."""
    health: list[str] = field(default_factory=list)
    """Warnings about the code (dead, collapsed, concentrated, dense path, selection bias: evaluation/health.py);
    empty when healthy."""
    firing_frequency_histogram: str | None = None
    """Path of the PNG, relative to the model folder."""


@dataclass
class CeMetrics(_Section):
    """Next-token cross-entropy (nats per token) on held-out text."""

    base: float | None = field(default=None, metadata=_title("CE, base model"))
    spliced: float | None = field(default=None, metadata=_title("CE, sparse layers spliced in"))
    delta: float | None = field(default=None, metadata=_title("ΔCE (spliced − base)"))
    kl_base_spliced: float | None = field(default=None, metadata=_title("KL(base ‖ spliced)"))
    zero_ablation: float | None = field(default=None, metadata=_title("CE, MLPs zero-ablated"))
    mean_ablation: float | None = field(default=None, metadata=_title("CE, MLPs mean-ablated"))
    ce_recovered_zero: float | None = field(default=None, metadata=_title("CE recovered vs zero ablation", "percent"))
    ce_recovered_mean: float | None = field(default=None, metadata=_title("CE recovered vs mean ablation", "percent"))
    predicted_tokens: int | None = None


@dataclass
class GenerationMetrics(_Section):
    """Greedy continuations of held-out prompts: fraction identical to the base's after 1..C tokens."""

    match_curve: list[float | None] = field(default_factory=list)
    match_at_end: float | None = None
    n_prompts: int | None = None
    match_curve_plot: str | None = None
    """Path of the PNG, relative to the model folder."""


@dataclass
class ReconstructionPositions(_Section):
    """The held-out positions the reconstruction metrics (NMSE, FVU, MSE, L0, dead units) cover: every position but
    those holding a token of `excluded_token_ids` (data.exclude_special_positions). CE and KL cover every position."""

    exclude_special_positions: bool | None = None
    excluded_token_ids: list[int] = field(default_factory=list)
    tokens: int | None = None
    """Positions covered."""
    excluded_tokens: int | None = None
    """Positions left out."""


@dataclass
class TrainSummary(_Section):
    steps: int | None = None
    tokens: int | None = None
    lr: float | None = None
    """The peak learning rate the distillation used (train.lr, or what `auto` resolved to)."""
    lr_rule: float | None = None
    """The `train.lr: auto` rule's rate for this many steps (recipe/lr_rule.py)."""
    warmup_steps: int | None = None
    """The warm-up the distillation used (train.warmup_steps, or what `auto` resolved to)."""
    warmup_rule: int | None = None
    """The `train.warmup_steps: auto` rule's warm-up for this many steps (recipe/schedule_rule.py)."""
    schedule: str | None = None
    """The decay after the warm-up: constant, cosine or linear."""
    min_lr_ratio: float | None = None
    """The cosine / linear decay's floor, as a fraction of `lr`."""
    loss_drop_last_fifth: float | None = None
    """How much the training loss still fell over the run's last fifth (training/log.py)."""
    code_share_floor: float | None = None
    """The share of what the layer explains its code was trained to carry (train.code_share_floor; 0: none;
    training/code_floor.py)."""


@dataclass
class InitMetrics(_Section):
    """CE of the dense initialisation before training (layer.init: split | copy)."""

    method: str | None = None
    base: float | None = None
    spliced: float | None = None
    delta: float | None = None


@dataclass
class HealSummary(_Section):
    steps: int | None = None
    tokens: int | None = None
    objective: str | None = None
    rest: str | None = None
    final: dict[str, Any] | None = None
    """The last heal_log.jsonl record."""


@dataclass
class StackingMetrics(_Section):
    """A run whose base model is itself an expertize model (evaluation/stacking.py): `ce` is measured against that
    base; the whole model's cost is measured against the dense model the chain of runs started from."""

    base_sparse_layers: dict[str, str] = field(default_factory=dict)
    """Layers the base model already had as sparse layers (index -> kind), from earlier runs."""
    original_base_model: str | None = None
    """The dense model the chain started from (as recorded; None when a folder of the chain records no base)."""
    original_ce: float | None = field(default=None, metadata=_title("CE, original dense model"))
    delta_original: float | None = field(default=None, metadata=_title("ΔCE against the original dense model"))


@dataclass
class LmEvalMetric(_Section):
    value: float | None = None
    stderr: float | None = None
    base_value: float | None = None
    base_stderr: float | None = None
    delta: float | None = None
    higher_is_better: bool | None = None


@dataclass
class LmEvalTask(_Section):
    """One lm-eval task: settings, files and metrics ("acc,none" -> LmEvalMetric)."""

    n_shot: int | None = None
    n_samples: int | None = None
    n_documents: int | None = None
    version: Any = None
    limit: int | float | None = None
    batch_size: int | None = None
    seed: int | None = None
    lm_eval_version: str | None = None
    base: str | None = None
    dataset: str | None = None
    """The Hub dataset the task reads (its dataset_path), None for local data or when not recorded."""
    local: bool | None = None
    """True: the task reads local data (made by `expertize tasks`, shipped with expertize, or a local file), so it is
    not a public benchmark; False: a Hub dataset; None: not recorded."""
    results_files: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, LmEvalMetric] = field(default_factory=dict)

    def details(self) -> dict[str, Any]:
        """Everything but the metrics (the card's notes under the lm-eval table)."""
        out = self.to_dict()
        out.pop("metrics")
        return out


@dataclass
class LmEval(_Section):
    tasks: dict[str, LmEvalTask] = field(default_factory=dict)


@dataclass
class Metrics(_Section):
    """The whole of metrics.json."""

    layers: dict[str, LayerMetrics] = field(default_factory=dict)
    ce: CeMetrics | None = None
    generation: GenerationMetrics | None = None
    eval_tokens: int | None = None
    reconstruction_positions: ReconstructionPositions | None = None
    train: TrainSummary | None = None
    init: InitMetrics | None = None
    heal: HealSummary | None = None
    stacking: StackingMetrics | None = None
    recipe_summary: dict[str, Any] = field(default_factory=dict)
    lm_eval: LmEval | None = None
    verdict: dict[str, Any] | None = None
    """Whether the replacement behaves like the MLP: {"grade": good | fair | poor | cannot judge, "reasons": [...]}
    (evaluation/reading.py's quality_verdict, from FVU, KL and CE recovered)."""
    example_prompt: str | None = None
    """The start of a held-out document, the card's generation example (text the model was made for)."""

    @property
    def evaluated(self) -> bool:
        """True when the intrinsic evaluation ran (layers, CE or generation recorded)."""
        return bool(self.layers) or self.ce is not None or self.generation is not None

    def summary_lines(self) -> list[str]:
        """The key results in a few lines, for the end of a run (CLI)."""
        lines = []
        ce = self.ce
        if ce is not None and ce.base is not None:
            lines.append(
                f"CE {format_number(ce.base)} (base) -> {format_number(ce.spliced)} (spliced), "
                f"ΔCE {format_number(ce.delta)}, CE recovered vs mean ablation {format_percent(ce.ce_recovered_mean)}"
            )
        for index, layer in sorted(self.layers.items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"layer {index}: FVU {format_number(layer.fvu)}, NMSE {format_number(layer.nmse_paper)}, "
                f"L0 {format_number(layer.l0, 2)}, dead {format_percent(layer.dead_fraction)}"
            )
            lines.extend(f"WARNING layer {index} code {warning}" for warning in layer.health)
        stacking = self.stacking
        if stacking is not None and stacking.delta_original is not None:
            lines.append(
                f"stacked on an expertize model: ΔCE {format_number(stacking.delta_original)} against the original "
                f"dense model {stacking.original_base_model} (CE {format_number(stacking.original_ce)})"
            )
        if self.generation is not None and self.generation.match_at_end is not None:
            lines.append(f"greedy continuations identical to base: {format_percent(self.generation.match_at_end)}")
        for task, entry in (self.lm_eval.tasks if self.lm_eval else {}).items():
            for name, m in entry.metrics.items():
                lines.append(f"{task} {name}: {format_number(m.value)} (base {format_number(m.base_value)})")
        return lines


def scalar_metric_paths() -> list[str]:
    """The dotted paths of metrics.json's numeric scalars outside `layers` (ce.spliced, generation.match_at_end,
    ...), from the schema: the metric names `expertize plot-sweep` accepts besides per-layer and lm_eval ones."""
    out = []

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            target = inner[0]
            if isinstance(target, type) and issubclass(target, _Section) and target is not LmEval:
                walk(target, f"{prefix}{f.name}.")
            elif target in (int, float) and f.name != "extra":
                out.append(f"{prefix}{f.name}")

    walk(Metrics, "")
    return out


def layer_metric_names() -> list[str]:
    """Per-layer numeric metrics (averaged over the replaced layers by plot-sweep)."""
    hints = typing.get_type_hints(LayerMetrics)
    return [f.name for f in dataclasses.fields(LayerMetrics)
            if any(a in (int, float) for a in typing.get_args(hints[f.name])) and f.name not in ("dead_units",
                                                                                                   "num_units")]


def load_metrics(model_dir: str | os.PathLike) -> Metrics:
    """MODEL_DIR/metrics.json as `Metrics` (empty when the folder has none)."""
    from .run_folder import METRICS

    path = Path(model_dir) / METRICS
    if not path.is_file():
        return Metrics()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise MetricsError(f"{path} is not valid JSON ({e}); rerun `expertize eval` or the recipe to rewrite it") \
            from None
    return Metrics.from_dict(data)


def metric_help() -> str:
    """The metric names `plot-sweep` accepts (CLI help, error messages)."""
    return (
        f"a number in metrics.json by dotted path ({', '.join(scalar_metric_paths())}), a per-layer metric averaged "
        f"over the replaced layers ({', '.join(layer_metric_names())}), or lm_eval:TASK:METRIC (e.g. "
        "lm_eval:expertize_stories_cloze:acc)"
    )
