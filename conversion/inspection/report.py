"""The per-layer JSON report (`layer_<i>.json`), its JSON schema, a small validator, and the writer of the folder.

The schema below is the documented format (docs/inspect.md); `validate(document, LAYER_SCHEMA)` checks a
document against it with the subset of JSON Schema it uses (type, properties, required, additionalProperties, items,
minimum, maximum, enum), so no third-party validator is needed (tests also check it with `jsonschema`).
"""

import json
import math
import os
from pathlib import Path
from typing import Any

from ..publishing.run_folder import write_text

__all__ = ["LAYER_SCHEMA", "SchemaError", "layer_report", "validate", "write_reports"]

SCHEMA_VERSION = 1

GENERIC_ACTIVATION_MEANING = "the unit's weight in the sparse code"
"""The report's `activation` when the statistics do not say what the kind's activation means."""

_NUM = {"type": "number"}
_TOKENS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["token", "id", "logit"],
        "additionalProperties": False,
        "properties": {"token": {"type": "string"}, "id": {"type": "integer", "minimum": 0}, "logit": _NUM},
    },
}
_CONTEXT = {
    "type": "object",
    "required": ["tokens", "activations", "max", "peak", "domain", "sequence", "position"],
    "additionalProperties": False,
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "activations": {"type": "array", "items": _NUM},
        "max": _NUM,
        "peak": {"type": "integer", "minimum": 0},
        "domain": {"type": "string"},
        "sequence": {"type": "integer", "minimum": 0},
        "position": {"type": "integer", "minimum": 0},
    },
}
_UNIT = {
    "type": "object",
    "required": ["id", "frequency", "mean_activation", "max_activation", "domains", "top_domain", "selectivity",
                 "top_contexts", "promoted_tokens", "suppressed_tokens"],
    "additionalProperties": False,
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "frequency": {"type": "number", "minimum": 0, "maximum": 1},
        "mean_activation": _NUM,
        "max_activation": _NUM,
        "domains": {"type": "object", "additionalProperties": {"type": "number", "minimum": 0, "maximum": 1}},
        "top_domain": {"type": ["string", "null"]},
        "selectivity": {"type": "number", "minimum": 0, "maximum": 1},
        "top_contexts": {"type": "array", "items": _CONTEXT},
        "promoted_tokens": _TOKENS,
        "suppressed_tokens": _TOKENS,
    },
}
LAYER_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "expertize inspect: one sparse layer",
    "type": "object",
    "required": ["schema_version", "model", "layer", "kind", "unit_name", "activation", "num_units", "tokens",
                 "domains", "top_n", "context_window", "dead_units", "routing", "units"],
    "additionalProperties": False,
    "properties": {
        "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
        "model": {"type": "string"},
        "layer": {"type": "integer", "minimum": 0},
        "kind": {"type": "string"},
        "unit_name": {"type": "string"},
        "activation": {"type": "string"},
        "num_units": {"type": "integer", "minimum": 1},
        "tokens": {"type": "integer", "minimum": 0},
        "domains": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
        "top_n": {"type": "integer", "minimum": 1},
        "context_window": {
            "type": "object", "required": ["left", "right"], "additionalProperties": False,
            "properties": {"left": {"type": "integer", "minimum": 0}, "right": {"type": "integer", "minimum": 0}},
        },
        "dead_units": {"type": "integer", "minimum": 0},
        "routing": {
            "type": ["object", "null"],
            "required": ["experts", "load", "router_entropy", "max_entropy", "entropy_of"],
            "additionalProperties": False,
            "properties": {
                "experts": {"type": "integer", "minimum": 1},
                "load": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}},
                "router_entropy": {"type": "number", "minimum": 0},
                "max_entropy": {"type": "number", "minimum": 0},
                "entropy_of": {"type": "string"},
            },
        },
        "units": {"type": "array", "items": _UNIT},
    },
}


class SchemaError(ValueError):
    """A document does not match the schema; the message gives the JSON path."""


_TYPES = {
    "object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
    "integer": int, "number": (int, float),
}


def validate(instance: Any, schema: dict, path: str = "$") -> None:
    """Raise SchemaError at the first place `instance` violates `schema` (the JSON Schema subset used here)."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        ok = any(
            isinstance(instance, _TYPES[t]) and not (t in ("integer", "number") and isinstance(instance, bool))
            for t in types
        )
        if not ok:
            raise SchemaError(f"{path}: expected {' or '.join(types)}, got {type(instance).__name__}")
        if isinstance(instance, float) and not math.isfinite(instance):
            raise SchemaError(f"{path}: {instance} is not a finite number (strict JSON)")
    if instance is None:
        return
    if "enum" in schema and instance not in schema["enum"]:
        raise SchemaError(f"{path}: {instance!r} is not one of {schema['enum']}")
    if "minimum" in schema and instance < schema["minimum"]:
        raise SchemaError(f"{path}: {instance} < minimum {schema['minimum']}")
    if "maximum" in schema and instance > schema["maximum"]:
        raise SchemaError(f"{path}: {instance} > maximum {schema['maximum']}")
    if isinstance(instance, dict):
        for key in schema.get("required", []):
            if key not in instance:
                raise SchemaError(f"{path}: missing required key {key!r}")
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, value in instance.items():
            if key in properties:
                validate(value, properties[key], f"{path}.{key}")
            elif extra is False:
                raise SchemaError(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                validate(value, extra, f"{path}.{key}")
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            validate(item, schema["items"], f"{path}[{i}]")


def _sig(x: float, digits: int = 6) -> float:
    """x to `digits` significant digits (keeps the reports small without losing small activations)."""
    return float(f"{x:.{digits}g}")


def _token_list(stats, ids: list[int], values: list[float]) -> list[dict]:
    if any(not math.isfinite(v) for v in values):
        return []  # no direction for this unit (it never fired, and its direction depends on its firing tokens)
    return [{"token": stats.token_text(i), "id": i, "logit": _sig(v)} for i, v in zip(ids, values)]


def layer_report(stats, layer: int) -> dict:
    """The layer_<i>.json document of one layer of an `InspectionStats` (see LAYER_SCHEMA)."""
    ls = stats.layers[layer]
    ctx = ls.contexts
    domains = stats.domains
    frequency = stats.frequency(layer).tolist()
    rates = stats.domain_rates(layer).T.tolist()  # (U, D)
    mean, peak = ls.mean_activation.tolist(), ls.max_activation.tolist()
    values, where, dom = ctx.values.tolist(), ctx.where.tolist(), ctx.domain.tolist()
    win_tokens, win_acts = ctx.tokens.tolist(), ctx.acts.tolist()
    promoted = None if ls.promoted is None else (ls.promoted[0].tolist(), ls.promoted[1].tolist())
    units = []
    for n in range(ls.num_units):
        contexts = []
        for slot, value in enumerate(values[n]):
            if value == float("-inf"):
                break
            toks, acts = win_tokens[n][slot], win_acts[n][slot]
            inside = [i for i, t in enumerate(toks) if t >= 0]
            contexts.append({
                "tokens": [stats.token_text(toks[i]) for i in inside],
                "activations": [_sig(acts[i], 5) for i in inside],
                "max": _sig(value),
                "peak": ctx.left - inside[0],
                "domain": domains[dom[n][slot]],
                "sequence": where[n][slot][0],
                "position": where[n][slot][1],
            })
        unit_rates = rates[n]
        total = sum(unit_rates)
        top = max(range(len(domains)), key=unit_rates.__getitem__) if total > 0 else None
        units.append({
            "id": n,
            "frequency": frequency[n],
            "mean_activation": _sig(mean[n]),
            "max_activation": _sig(peak[n]),
            "domains": dict(zip(domains, unit_rates)),
            "top_domain": None if top is None else domains[top],
            "selectivity": unit_rates[top] / total if top is not None else 0.0,
            "top_contexts": contexts,
            "promoted_tokens": [] if promoted is None else _token_list(stats, promoted[0][n][0], promoted[1][n][0]),
            "suppressed_tokens": [] if promoted is None else _token_list(stats, promoted[0][n][1], promoted[1][n][1]),
        })
    return {
        "schema_version": SCHEMA_VERSION,
        "model": stats.model_name,
        "layer": layer,
        "kind": ls.kind,
        "unit_name": ls.unit_name,
        "activation": ls.activation_meaning or GENERIC_ACTIVATION_MEANING,
        "num_units": ls.num_units,
        "tokens": stats.tokens,
        "domains": dict(zip(domains, stats.domain_tokens.tolist())),
        "top_n": stats.settings.top_n,
        "context_window": {"left": ctx.left, "right": ctx.right},
        "dead_units": int((ls.counts == 0).sum()),
        "routing": ls.routing,
        "units": units,
    }


def write_reports(stats, output_dir: str | os.PathLike) -> list[Path]:
    """Write layer_<i>.json for every inspected layer and the self-contained explorer index.html."""
    from .html import write_explorer

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written, reports = [], []
    for layer in sorted(stats.layers):
        report = layer_report(stats, layer)
        reports.append(report)
        path = out / f"layer_{layer}.json"
        # Compact strict JSON: a layer of thousands of units x N contexts would triple in size indented.
        write_text(path, json.dumps(report, ensure_ascii=False, allow_nan=False, separators=(",", ":")))
        written.append(path)
    written.append(write_explorer(reports, out / "index.html"))
    return written
