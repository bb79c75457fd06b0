"""circuit-tracer's own graph scores of a run's threshold kinds on held-out prompts (issue 48: circuits beyond 32 steps).

For each JumpReLU set and CLT folder of a `circuit_kinds.py` run: `expertize export --to circuit-tracer`, then the
export's own attribute.py in the circuit-tracer venv (scripts/circuit_tracer_env.sh; no expertize there) attributes
every prompt and scores its graph with circuit-tracer's `compute_graph_scores`: the **replacement score** (the share
of the input tokens' influence on the logits that reaches them through features, not error nodes) and the
**completeness score** (the influence-weighted share of every node's inputs that are not errors). The prompts are the
beginnings of the run's held-out documents (the recipe's document hash: no training step read them), the same for
every kind and seed, so that the kinds are compared prompt by prompt.

Used by `python benchmarks/circuit_kinds.py --graph-scores ...`; TopK is not scored (circuit-tracer has no TopK
activation: the export refuses it).
"""

import json
import os
import statistics
import subprocess
from pathlib import Path

from specialization_claims import format_value, seed_interval

SCORED_PREFIXES = ("jumprelu_transcoder", "clt")  # the kinds circuit-tracer reads (variant names start with them)


def held_out_prompts(run_folder: Path, count: int, chars: int) -> list[str]:
    """The first `count` held-out documents of the run (its recipe's split), each cut to <= `chars` characters at a
    word boundary, on one line (newlines become spaces: the prompts file holds one prompt per line)."""
    from expertize.conversion.data.text import split_documents
    from expertize.conversion.recipe import load_recipe

    recipe = load_recipe(run_folder / "recipe.resolved.yaml")
    prompts = []
    for doc in split_documents(recipe.data).eval():
        text = " ".join(doc.split())
        if len(text) < chars // 2:  # too short to leave the model something to predict from context
            continue
        cut = text[:chars]
        prompts.append(cut[: cut.rfind(" ")] if len(text) > chars and " " in cut else cut)
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"error: {run_folder} holds {len(prompts)} held-out documents of >= {chars // 2} characters, "
                     f"fewer than --prompts {count}; lower --prompts or --prompt-chars")


def score_run(folder: Path, prompts_file: Path, python: str, max_feature_nodes: int) -> dict:
    """Export one variant folder to circuit-tracer and score every prompt with the export's attribute.py in
    `python`'s venv; reuses a finished scores.json of the same prompts and cap."""
    from expertize.conversion.cli import main as cli_main

    out = folder.parent / f"{folder.name}-graph-scores"
    scores = out / "scores.json"
    prompts = prompts_file.read_text(encoding="utf-8").splitlines()
    if scores.exists():
        saved = json.loads(scores.read_text(encoding="utf-8"))
        if [p["prompt"] for p in saved["prompts"]] == prompts and saved["max_feature_nodes"] == max_feature_nodes:
            return saved
    export = out / "export"
    if not (export / "attribute.py").exists():
        if cli_main(["export", str(folder), "--to", "circuit-tracer", str(export)]) != 0:
            raise SystemExit(f"error: exporting {folder} to circuit-tracer failed (see above)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run([python, str(export / "attribute.py"), "--prompts", str(prompts_file), "--scores",
                          str(scores), "--out", str(out / "graphs"), "--max-feature-nodes", str(max_feature_nodes)],
                         env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"error: attribute.py on {folder} exited {run.returncode}:\n{run.stdout[-2000:]}"
                         f"\n{run.stderr[-3000:]}")
    return json.loads(scores.read_text(encoding="utf-8"))


def score_model_seed(out: Path, variants: list[str], python: str, count: int, chars: int,
                     max_feature_nodes: int) -> list[dict]:
    """Every threshold-kind variant of one (model, seed) run, on the run's held-out prompts: rows of per-prompt
    scores."""
    scored = [v for v in variants if v.startswith(SCORED_PREFIXES)]
    if not scored:
        return []
    prompts_file = out / "graph-score-prompts.txt"
    prompts_file.write_text("\n".join(held_out_prompts(out / scored[0], count, chars)) + "\n", encoding="utf-8")
    rows = []
    for variant in scored:
        saved = score_run(out / variant, prompts_file, python, max_feature_nodes)
        rows.append({"kind": variant, "max_feature_nodes": max_feature_nodes,
                     "prompts": [{k: p[k] for k in ("prompt", "tokens", "replacement", "completeness",
                                                      "active_features", "selected_features", "seconds")}
                                 for p in saved["prompts"]]})
    return rows


def _interval(values: list[float], fmt: str = ".3f") -> str:
    mean, low, high = seed_interval(values)
    return f"{format_value(mean, fmt)} [{format_value(low, fmt)}, {format_value(high, fmt)}]"


def scores_table(rows: list[dict]) -> str:
    """Per (model, seed): each scored kind's mean replacement and completeness over the prompts (95 % t interval over
    prompts), and the CLT's minus the JumpReLU set's, paired prompt by prompt; then each model's seeds together."""
    lines = ["| model | seed | kind | prompts | selected / active features | replacement [95 %] | "
             "completeness [95 %] | CLT − set: replacement [95 %] | CLT − set: completeness [95 %] |",
             "|---|---|---|---:|---:|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        seeds = list(dict.fromkeys(r["seed"] for r in rows if r["model"] == model))
        for seed in seeds + (["all"] if len(seeds) > 1 else []):
            mine = [r for r in rows if r["model"] == model and (seed == "all" or r["seed"] == seed)]
            for kind in dict.fromkeys(r["kind"] for r in mine):
                prompts = [p for r in mine if r["kind"] == kind for p in r["prompts"]]
                base = "jumprelu_transcoder" + kind[len("clt"):] if kind.startswith("clt") else None
                diffs = {"replacement": [], "completeness": []}
                for r in (r for r in mine if r["kind"] == kind and base):
                    other = next((o for o in mine if o["kind"] == base and o["seed"] == r["seed"]), None)
                    for key in diffs:
                        if other is not None:  # the same prompts in the same order (one prompts file per run)
                            diffs[key] += [p[key] - q[key] for p, q in zip(r["prompts"], other["prompts"], strict=True)]
                selected = statistics.fmean(p["selected_features"] for p in prompts)
                active = statistics.fmean(p["active_features"] for p in prompts)
                lines.append(
                    f"| {model} | {seed} | {kind} | {len(prompts)} | {selected:,.0f} / {active:,.0f} | "
                    f"{_interval([p['replacement'] for p in prompts])} | "
                    f"{_interval([p['completeness'] for p in prompts])} | "
                    + " | ".join(_interval(diffs[k], "+.3f") if diffs[k] else "" for k in diffs) + " |")
    return "\n".join(lines)
