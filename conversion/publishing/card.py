"""Model cards: the README.md of a saved expertize model.

    layer specs + recipe summary + metrics (+ lm-eval results, base vs this model)
        ─► ModelCardData: base_model, library_name, pipeline_tag, tags, model-index (lm-eval results only)
        ─► template `expertize/model_cards/expertize_model.md` (Jinja), filled with pre-formatted strings and rows
        ─► model_dir/README.md, written atomically (a second call replaces the whole file)

Numbers are written as formats.py writes them (shared with the variants table and the end-of-run summary); a missing
value renders as "—"; `metrics=None` renders "not run". What a card is made of is one `CardInputs`.
"""

import importlib.metadata
import importlib.resources
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .formats import MISSING, cell, code_cell, format_count, format_number, format_percent, is_number
from .local_paths import ASSETS_VARIABLE
from .metrics_schema import (
    CeMetrics, GenerationMetrics, LayerMetrics, Metrics, ReconstructionPositions, StackingMetrics,
)
from .run_folder import MODEL_CARD, write_text

from expertize.modeling.sparse_layers import LAYER_KINDS

__all__ = ["CardInputs", "TEMPLATE_NAME", "UNKNOWN_LICENSE", "render_model_card", "write_model_card"]

TEMPLATE_NAME = "expertize_model.md"
LM_EVAL_URL = "https://github.com/EleutherAI/lm-evaluation-harness"
UNKNOWN_LICENSE = "unknown"
"""The `license:` metadata while the base model's license is not known: a placeholder the user must replace (the
card says so and `expertize push` warns)."""
FALLBACK_PROMPT = "The"
"""The generation example of a folder whose metrics.json records no held-out prompt (`example_prompt`)."""


@dataclass(frozen=True)
class KindInfo:
    """How a card names one sparse layer kind (read from the kind's spec class: title, unit_name, units_field,
    code_unit())."""

    title: str
    """Method name in prose, e.g. "Mixture of Decoders (MxD)"."""
    unit: str
    """What the router / top K chooses among, counted by `units_field`: "expert" or "latent"."""
    units_field: str
    """Spec field holding the number of units."""
    code_unit: str
    """What one id of the sparse code is, the unit that L0, dead units and the code's hooks count: the `unit` for
    most kinds, "hidden unit" (of an expert) for MoE-X."""


def _kind_info(kind: str) -> KindInfo:
    """The card's names for `kind`, read from its spec class (a generic "unit" for a kind this version lacks)."""
    if kind in LAYER_KINDS:
        spec_cls = LAYER_KINDS[kind][0]
        return KindInfo(spec_cls.title or kind, spec_cls.unit_name, spec_cls.units_field, spec_cls.code_unit())
    return KindInfo(kind, "unit", "num_units", "unit")


def _code_units(kinds) -> list[str]:
    """The code's unit names of `kinds` ("expert", "hidden unit", ...), sorted, each once."""
    return sorted({_kind_info(kind).code_unit for kind in kinds})


def _citation(kind: str) -> str:
    """BibTeX of the paper behind `kind`, read from its spec class now (a kind registered after import included)."""
    return LAYER_KINDS[kind][0].citation if kind in LAYER_KINDS else ""


# Spec fields shown in their own columns of the "Replaced layers" table; the rest go to "other settings".
_LAYER_COLUMNS = (
    "kind", "d_in", "d_out", "d_hidden", "num_experts", "num_latents", "num_units", "k", "num_parameters"
)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# ----------------------------------------------------------------------------------------------------------------
# Sections


def _num_units(spec: Mapping[str, Any]) -> Any:
    info = _kind_info(spec.get("kind", ""))
    for field in (info.units_field, "num_experts", "num_latents", "num_units"):
        if field in spec:
            return spec[field]
    return None


def _num_parameters(spec: Mapping[str, Any]) -> int | None:
    """`num_parameters` from the spec dict, else counted by the spec class when the dict is a valid spec."""
    if "num_parameters" in spec:
        return spec["num_parameters"]
    from expertize.modeling import spec_from_dict  # torch + transformers: only imported when needed

    try:
        return spec_from_dict(dict(spec)).num_parameters()
    except (ValueError, TypeError, NotImplementedError):
        return None


def _layer_list(indices: list[int]) -> str:
    words = [str(i) for i in indices]
    if len(words) == 1:
        return f"layer {words[0]}"
    return "layers " + ", ".join(words[:-1]) + " and " + words[-1]


def _replacements(layers: Mapping[int, Mapping[str, Any]]) -> str:
    """"the MLP of layer 2 replaced by a MoE-X layer (K = 4 of 16 experts active per token); ..." for `layers`."""
    groups: dict[tuple, list[int]] = {}
    for index, spec in layers.items():
        groups.setdefault((spec.get("kind"), spec.get("k"), _num_units(spec)), []).append(index)
    parts = []
    for (kind, k, n_units), indices in groups.items():
        info = _kind_info(kind)
        one = len(indices) == 1
        parts.append(
            f"the MLP{'' if one else 's'} of {_layer_list(indices)} replaced by {'a ' if one else ''}{info.title} "
            f"layer{'' if one else 's'} (K = {cell(k)} of {cell(n_units)} {info.unit}s active per token)"
        )
    return "; ".join(parts)


def _display_name(model: str) -> str:
    """A base model as a table header or a short mention: a Hub id as it is, a local or packaged folder by its name
    (never `${EXPERTIZE_ASSETS}/...` or a path)."""
    return Path(model).name if model.startswith(ASSETS_VARIABLE + "/") or model.count("/") > 1 else model


def _summary(
    base_model: str, layers: dict[int, dict], is_hub_id: bool, stacking: StackingMetrics | None = None
) -> str:
    if is_hub_id:
        base = f"[{base_model}](https://huggingface.co/{base_model})"
    elif base_model.startswith(ASSETS_VARIABLE + "/"):
        base = f"`{Path(base_model).name}` (the small model shipped with expertize, `{base_model}` in a recipe)"
    else:
        base = f"`{base_model}`"
    units = "/".join(f"{unit}s" for unit in _code_units(spec.get("kind", "") for spec in layers.values()))
    inherited = {int(i) for i in (stacking.base_sparse_layers if stacking is not None else {})} & set(layers)
    own = {i: spec for i, spec in layers.items() if i not in inherited}
    if inherited and own:
        # Stacking: this run replaced `own`; the base, an expertize model, already had the others.
        original = stacking.original_base_model
        made_from = f" from the dense `{_display_name(original)}`" if original else ""
        first = (
            f"{base} with {_replacements(own)} by this run. {base.split(' (')[0]} is itself an expertize model, "
            f"made in an earlier run{made_from}: {_replacements({i: layers[i] for i in sorted(inherited)})}. This "
            f"model has sparse layers at {_layer_list(sorted(layers))}"
        )
    else:
        first = f"{base} with {_replacements(layers)}"
    return (
        f"{first}. Each sparse layer is a drop-in replacement for the dense MLP, trained to reproduce its outputs; "
        "every other weight is the base model's, unchanged. The sparse code says which "
        f"{units} fired on which token, and it can be read, steered and ablated at run time."
    )


def _layer_table(layers: dict[int, dict]) -> tuple[list[str], list[list[str]]]:
    specs = list(layers.values())
    has_hidden = any("d_hidden" in s for s in specs)
    header = ["layer", "kind", "d_in → d_out"] + (["hidden"] if has_hidden else [])
    unit_words = sorted({_kind_info(s.get("kind", "")).unit + "s" for s in specs})
    header += [" / ".join(unit_words), "k", "parameters", "other settings"]
    rows = []
    for index, spec in layers.items():
        others = ", ".join(f"{name}={cell(value)}" for name, value in spec.items() if name not in _LAYER_COLUMNS)
        row = [str(index), code_cell(spec.get("kind")), f"{cell(spec.get('d_in'))} → {cell(spec.get('d_out'))}"]
        if has_hidden:
            row.append(cell(spec.get("d_hidden")))
        row += [cell(_num_units(spec)), cell(spec.get("k")), format_count(_num_parameters(spec)), others or MISSING]
        rows.append(row)
    return header, rows


_FORMATS = {
    "number": format_number,
    "l0": lambda x: format_number(x, 2),
    "units": lambda x: format_number(x, 1),  # effective units: a count, one decimal is plenty
    "percent": format_percent,
    "count": format_count,
}


def _formatted(section: Any, f) -> str:
    return _FORMATS[f.metadata["format"]](getattr(section, f.name))


def _metric_table(
    layer_metrics: Mapping[str, LayerMetrics], layers: Mapping[int, Mapping[str, Any]]
) -> tuple[list[str], list[list[str]]]:
    columns = LayerMetrics.titled_fields()  # the schema's titled fields, in order
    header = ["layer", *(f.metadata["title"] for f in columns), "dead"]
    rows = []
    for index, m in sorted(layer_metrics.items(), key=lambda kv: int(kv[0])):
        dead = format_count(m.dead_units)
        if m.num_units is not None:
            spec = layers.get(int(index), {})
            dead += f" / {format_count(m.num_units)} {_code_units([spec.get('kind', '')])[0]}s"
        if m.dead_fraction is not None:
            dead += f" ({format_percent(m.dead_fraction)})"
        rows.append([str(int(index))] + [_formatted(m, f) for f in columns] + [dead])
    return header, rows


def _positions_note(positions: ReconstructionPositions | None) -> str:
    """Which held-out positions the reconstruction metrics cover, one sentence ("" when metrics.json does not say)."""
    if positions is None or positions.tokens is None:
        return ""
    if not positions.excluded_token_ids:
        return f"computed over every held-out position ({format_count(positions.tokens)}), special tokens included."
    ids = ", ".join(str(i) for i in positions.excluded_token_ids)
    return (
        f"computed over the {format_count(positions.tokens)} held-out positions that do not hold a special token; the "
        f"{format_count(positions.excluded_tokens)} positions holding one (token ids {ids}: BOS / EOS / padding, "
        "whose activation outliers would dominate the squared error) are left out. CE and KL cover every position."
    )


def _ce_rows(
    ce: CeMetrics | None, generation: GenerationMetrics | None, stacking: StackingMetrics | None = None
) -> list[list[str]]:
    rows = []
    if ce is not None:
        rows += [[f.metadata["title"], _formatted(ce, f)] for f in CeMetrics.titled_fields()]
    if stacking is not None:
        name = f" (`{_display_name(stacking.original_base_model)}`)" if stacking.original_base_model else ""
        rows += [[f.metadata["title"] + name, _formatted(stacking, f)] for f in StackingMetrics.titled_fields()]
    if generation is not None and generation.match_at_end is not None:
        size = [f"{format_count(generation.n_prompts)} prompts"] if generation.n_prompts else []
        size += [f"{len(generation.match_curve)} tokens"] if generation.match_curve else []
        label = "greedy continuations identical to base" + (f" ({' × '.join(size)})" if size else "")
        rows.append([label, format_percent(generation.match_at_end)])
    return rows


def _match_rows(curve: list[Any]) -> list[tuple[str, str]]:
    """The match curve at 1, 2, 4, 8, ... generated tokens and at its end."""
    if not curve:
        return []
    positions, t = [], 1
    while t < len(curve):
        positions.append(t)
        t *= 2
    positions.append(len(curve))
    return [(str(t), format_percent(curve[t - 1], 1)) for t in positions]


def _with_stderr(value: Any, stderr: Any) -> str:
    text = format_number(value)
    return text + f" ± {format_number(stderr)}" if is_number(value) and is_number(stderr) else text


def _lm_eval(
    lm_eval: Mapping[str, Mapping[str, Mapping[str, Any]]], details: Mapping[str, Mapping[str, Any]]
) -> tuple[list[list[str]], list[EvalResult]]:
    """The lm-eval table's rows and the `model-index` entries. Only a task whose Hub dataset was recorded is a
    `model-index` entry (its dataset id as the dataset type); a task made from local text is marked "(local)" in the
    table and never listed as if it were a public benchmark."""
    rows, results = [], []
    for task, task_metrics in lm_eval.items():
        dataset, local = details.get(task, {}).get("dataset"), details.get(task, {}).get("local")
        for metric, entry in task_metrics.items():
            value, base = entry.get("value"), entry.get("base_value")
            ours, theirs = _with_stderr(value, entry.get("stderr")), _with_stderr(base, entry.get("base_stderr"))
            delta = f"{value - base:+.4f}" if is_number(value) and is_number(base) else MISSING
            rows.append([code_cell(task) + (" (local)" if local else ""), code_cell(metric), theirs, ours, delta])
            if is_number(value) and dataset:
                metric_type, _, metric_filter = str(metric).partition(",")  # lm-eval keys: "acc,none"
                results.append(
                    EvalResult(
                        task_type="text-generation",
                        dataset_type=str(dataset),
                        dataset_name=task,
                        metric_type=metric_type,
                        metric_value=float(value),
                        metric_name=str(metric) if metric_filter and metric_filter != "none" else None,
                        source_name="lm-evaluation-harness",
                        source_url=LM_EVAL_URL,
                    )
                )
    return rows, results


def _lm_eval_notes(details: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per task: shots and documents evaluated (a `limit` marks a smoke test, not a benchmark)."""
    notes = []
    for task, d in details.items():
        parts = []
        if d.get("n_shot") is not None:
            parts.append(f"{d['n_shot']}-shot")
        if d.get("n_samples") is not None:
            total = d.get("n_documents")
            docs = format_count(d["n_samples"]) + (f" of {format_count(total)}" if total not in (None, d["n_samples"])
                                                   else "")
            parts.append(f"{docs} documents")
        if d.get("limit") is not None:
            parts.append(f"limit {cell(d['limit'])}: a smoke test, not a benchmark")
        if parts:
            notes.append(f"{code_cell(task)}: {', '.join(parts)}")
    if any(d.get("local") for d in details.values()):
        notes.append("(local): a task made from local text (`expertize tasks`, or shipped with expertize), not a "
                     "public benchmark; it is left out of this card's metadata")
    return notes


def _blocks_expr(model_dir: Path) -> str:
    """`model.<path to the decoder blocks>` from the saved config's model_type, else the family-agnostic method."""
    config_path = model_dir / "config.json"
    if config_path.is_file():
        model_type = json.loads(config_path.read_text(encoding="utf-8")).get("model_type", "")
        from expertize.modeling import FAMILIES  # torch + transformers: only imported when needed

        family = FAMILIES.get(str(model_type).removeprefix("expertize_"))
        if family is not None:
            return f"model.{family.blocks_path}"
    return "model.transformer_blocks()"


def _recipe_files(model_dir: Path) -> list[str]:
    return [f"`{p.name}`" for p in sorted(model_dir.glob("recipe*.y*ml")) if p.is_file()]


def _default_model_name(base_model: str, layers: dict[int, dict]) -> str:
    kinds = "-".join(dict.fromkeys(str(s.get("kind")) for s in layers.values())).replace("_", "-")
    return f"{Path(base_model).name}-{kinds}-l{'-'.join(str(i) for i in layers)}"


def _expertize_version() -> str:
    try:
        return importlib.metadata.version("expertize")
    except importlib.metadata.PackageNotFoundError:
        return ""


# ----------------------------------------------------------------------------------------------------------------
# Public API


@dataclass(frozen=True, kw_only=True)
class CardInputs:
    """What a model card is made of: the layers, the training rows, the evaluation and the Hub metadata."""

    base_model: str
    """Hub id (or local name) of the dense model the layers were taken from; a Hub id goes into the `base_model`
    metadata and is linked. Never give a local absolute path for a card to be published:
    `model_folder.refresh_model_card` names a local base by its folder name (local_paths.public_base_model)."""
    layers: Mapping[int, Mapping[str, Any]]
    """Decoder layer index -> spec dict (`{"kind": "mxd", "d_in": ..., "k": ..., ...}`, as in the config's
    `sparse_layers`), optionally with "num_parameters" (counted from the spec when absent and valid)."""
    recipe_summary: Mapping[str, Any] | None
    """Setting -> value rows of the "Training" table (tokens, lr, steps, data source, seed, ...)."""
    metrics: Mapping[str, Any] | Metrics | None
    """A `Metrics` (metrics_schema.py) or the evaluation dict (`{"layers": {"8": {"nmse_paper", "relative_mse", "fvu",
    "mse", "l0", "dead_units", "dead_fraction", "num_units"}}, "ce": {"base", "spliced", "delta", "kl_base_spliced",
    "zero_ablation", "mean_ablation", "ce_recovered_zero", "ce_recovered_mean"}, "generation": {"match_curve",
    "match_at_end", "n_prompts"}, "eval_tokens"}`; fractions in [0, 1]); any key may be missing. None: the card says
    evaluation was not run."""
    lm_eval: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None
    """Task -> metric -> {"value", "stderr", "base_value", "base_stderr"} (base keys optional), as `expertize eval`
    records them; also written as the card's `model-index` (this model's values only)."""
    model_name: str | None = None
    """The card's title and model-index name; default `<base>-<kinds>-l<layers>` (or repo_id's name)."""
    repo_id: str | None = None
    """The Hub repository used in the loading snippet; default `<user>/<model_name>`."""
    lm_eval_details: Mapping[str, Mapping[str, Any]] | None = None
    """Task -> {"n_shot", "n_samples", "n_documents", "limit"} (any may be missing), listed under the lm-eval table."""
    base_model_is_hub_id: bool | None = None
    """Whether `base_model` is a Hub repository id (False: no `base_model` metadata, no link); None: recorded as
    given, linked when it has the form of a Hub id."""
    license: str | None = None
    """The `license:` metadata (a Hub license id, the base model's); None: "unknown", a placeholder the card asks the
    user to replace."""
    datasets: list[str] | None = None
    """Hub dataset ids the layers were trained on (the `datasets:` metadata); local text is never listed."""


def render_model_card(model_dir: str | os.PathLike, inputs: CardInputs) -> ModelCard:
    """The model card (metadata + body) of the model in `model_dir`, without writing it."""
    base_model, repo_id, license = inputs.base_model, inputs.repo_id, inputs.license
    metrics, base_model_is_hub_id = inputs.metrics, inputs.base_model_is_hub_id
    model_dir = Path(model_dir)
    if not inputs.layers:
        raise ValueError("layers is empty: a model card needs at least one replaced layer (layer index -> spec dict)")
    layers = {int(i): dict(spec) for i, spec in sorted(inputs.layers.items(), key=lambda kv: int(kv[0]))}
    for index, spec in layers.items():
        if not spec.get("kind"):
            raise ValueError(
                f"layers[{index}] has no 'kind': every spec dict names its method, one of {sorted(LAYER_KINDS)}"
            )
    kinds = list(dict.fromkeys(spec["kind"] for spec in layers.values()))
    model_name = inputs.model_name or (repo_id.split("/")[-1] if repo_id else _default_model_name(base_model, layers))

    lm_eval_rows, eval_results = _lm_eval(inputs.lm_eval or {}, inputs.lm_eval_details or {})
    # True: a Hub id (metadata + link); False: a name that is not one (no metadata: the Hub accepts only repository
    # ids there); None: unknown, recorded as given and linked when it has the form of a Hub id.
    in_metadata = base_model_is_hub_id is not False
    if base_model_is_hub_id is None:
        base_model_is_hub_id = bool(_REPO_ID.match(base_model))
    card_data = ModelCardData(
        base_model=base_model if in_metadata else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["expertize", *kinds, "sparse-experts", "interpretability"],
        model_name=model_name,
        eval_results=eval_results or None,
        license=license or UNKNOWN_LICENSE,
        datasets=list(inputs.datasets) if inputs.datasets else None,
    )

    evaluated = metrics.evaluated if isinstance(metrics, Metrics) else bool(metrics)
    if not isinstance(metrics, Metrics):
        metrics = Metrics.from_dict(dict(metrics or {}))
    layer_header, layer_rows = _layer_table(layers)
    metric_header, metric_rows = _metric_table(metrics.layers, layers)
    generation = metrics.generation
    units = _code_units(kinds)  # the code's units: what L0, dead units and the hooks count
    template = importlib.resources.files("expertize.model_cards").joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")
    return ModelCard.from_template(
        card_data,
        template_str=template,
        model_name=model_name,
        repo_id=repo_id or f"<user>/{model_name}",
        base_label=_display_name(base_model),  # the lm-eval table's column: a name, never a path or ${...}
        summary=_summary(base_model, layers, base_model_is_hub_id, metrics.stacking),
        license_unknown=not license,
        example_prompt=json.dumps(metrics.example_prompt or FALLBACK_PROMPT, ensure_ascii=False),
        # metrics.json's verdict as upcycle recorded it (evaluation/reading.py): grade, fidelity, code, reasons
        verdict=metrics.verdict if evaluated else None,
        blocks_expr=_blocks_expr(model_dir),
        example_layer=next(iter(layers)),
        unit=units[0] if len(units) == 1 else "unit",
        unit_plural=f"{units[0]}s" if len(units) == 1 else "units",
        unit_plural_any=" / ".join(f"{u}s" for u in units),
        layer_header=layer_header,
        layer_rows=layer_rows,
        recipe_rows=[[code_cell(key), cell(value)] for key, value in (inputs.recipe_summary or {}).items()],
        recipe_files=_recipe_files(model_dir),
        evaluated=evaluated or bool(lm_eval_rows),
        eval_tokens=format_count(metrics.eval_tokens) if metrics.eval_tokens is not None else "",
        metric_header=metric_header,
        metric_rows=metric_rows,
        health_warnings=[f"layer {i}: {w}" for i, m in sorted(metrics.layers.items(), key=lambda kv: int(kv[0]))
                         for w in m.health],
        positions_note=_positions_note(metrics.reconstruction_positions),
        ce_rows=_ce_rows(metrics.ce, generation, metrics.stacking),
        stacked=metrics.stacking is not None,
        match_rows=_match_rows(list(generation.match_curve) if generation is not None else []),
        n_prompts=format_count(generation.n_prompts if generation is not None else None),
        lm_eval_rows=lm_eval_rows,
        lm_eval_notes=_lm_eval_notes(inputs.lm_eval_details or {}),
        # dict.fromkeys: kinds from one paper (mumoe_cp, mumoe_tr) cite it once
        citations=list(dict.fromkeys(c for c in map(_citation, kinds) if c)),
        expertize_version=_expertize_version(),
    )


def write_model_card(model_dir: str | os.PathLike, inputs: CardInputs) -> Path:
    """Write `model_dir/README.md` (Hub metadata + card body) and return its path; a second call replaces it."""
    model_dir = Path(model_dir)
    card = render_model_card(model_dir, inputs)
    # Atomic: readers see the old card or the new one, never half of one.
    return write_text(model_dir / MODEL_CARD, str(card))
