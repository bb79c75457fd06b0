"""`expertize inspect`: what every sparse unit responds to, from one streaming pass over named corpora.

    stats.py     the engine: per-unit frequency (overall / per corpus), mean and max activation, top-N contexts,
                 direct vocabulary effects, routing statistics -> `InspectionStats`
    topk.py      batched top-N context merging (bounded by units x N)
    effects.py   output directions through the final norm and unembedding
    routing.py   load per expert and router entropy of router kinds
    corpora.py   named corpora (.txt / .jsonl) -> packed token sequences
    from_folder.py  from a model folder: load, read the corpora, run the pass
    report.py    layer_<i>.json, its JSON schema and validator
    html.py      the offline explorer index.html (template: explorer.html)
    prompt.py    the per-prompt view
(delphi's latent cache, written from the same pass: conversion/export/delphi.py)
"""

from .corpora import InspectionError, corpus_sequences, parse_corpora
from .from_folder import inspect_folder, load_for_inspection, prompt_ids, report_bytes, token_texts
from .prompt import PromptView, format_prompt_view, prompt_view
from .report import LAYER_SCHEMA, SchemaError, layer_report, validate, write_reports
from .stats import InspectionSettings, InspectionStats, LayerStats, collect_stats

__all__ = [
    "LAYER_SCHEMA",
    "InspectionError",
    "InspectionSettings",
    "InspectionStats",
    "LayerStats",
    "PromptView",
    "SchemaError",
    "collect_stats",
    "corpus_sequences",
    "format_prompt_view",
    "inspect_folder",
    "layer_report",
    "load_for_inspection",
    "parse_corpora",
    "prompt_ids",
    "prompt_view",
    "report_bytes",
    "token_texts",
    "validate",
    "write_reports",
]
