"""The transcoders circuit tracing reads, at equal L0: TopK, JumpReLU and cross-layer (issue 37).

Each (model, seed) is ONE `expertize upcycle` over every decoder layer (circuit-tracer's set and CLT cover them all)
whose `variants:` are the three kinds, trained together on one activation stream (the same tokens in the same
order): `transcoder` (TopK, K = k), `jumprelu_transcoder` (JumpReLU, target L0 = k) and `clt` (JumpReLU CLT, target
L0 = k per layer), all with L = 16 x d_model latents per layer, lr auto, the recipe defaults otherwise. The CLT has
more parameters (its decoders write into every later layer: (n+1)/2 x a transcoder's decoder on average); the table
gives each variant's parameter count, so "at equal L0" is the comparison, not "at equal parameters".

Columns (mean over seeds ± the 95 % Student-t half-width, and the seeds): KL(base ‖ all layers spliced) and ΔCE, the
mean over layers of FVU, L0 (a JumpReLU's varies by token: the held-out mean), dead latents, and the code share
(evaluation/code_probe.py; 1 by construction where there is no dense path).

With --graph-scores, each run's JumpReLU set and CLT are exported to circuit-tracer and scored on held-out prompts by
circuit-tracer's own `compute_graph_scores` (replacement and completeness; benchmarks/circuit_scores.py), in the venv
scripts/circuit_tracer_env.sh makes (--circuit-tracer-python, default $EXPERTIZE_CIRCUIT_TRACER_PYTHON).

Run:
    export EXPERTIZE_DATA=/path/to/shared/data
    python benchmarks/circuit_kinds.py --runs-dir RUNS --out table.md                         (~10 min, 2 cores)
    python benchmarks/circuit_kinds.py --models stories260k --seeds 0 --tokens 16384           (~1 min)
    python benchmarks/circuit_kinds.py --tokens 200000 --seeds 0,1 --graph-scores --runs-dir RUNS --out table.md
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _runs import run_variants, text_data
from specialization_claims import format_value, seed_interval

KINDS = ("transcoder", "jumprelu_transcoder", "clt")
MODELS = {
    # base folder, corpus, document separator
    "tiny-gpt2-shakespeare": ("models/tiny-gpt2-shakespeare", "corpora/tinyshakespeare.txt", "blank_line"),
    "stories260k": ("models/stories260k", "corpora/stories260k_samples.txt", "line"),
}
TRAIN = {"lr": "auto", "warmup_steps": "auto", "schedule": "cosine", "min_lr_ratio": 0.1, "tokens_per_step": 1024,
         "loss": "nmse", "precision": "fp32", "checkpoint_every": 0, "log_every": 20, "device": "cpu"}
EVAL = {"batch_sequences": 16, "generation_prompts": 0, "histogram": False}


def variants(k: int, preact_coefs: list[float] | None, threshold_lr_scales: list[float] | None = None) -> list[dict]:
    """The kinds as variants; with `preact_coefs` and / or `threshold_lr_scales`, the threshold kinds (those
    train.preact_coef and train.threshold_lr_scale act on) once per setting (named kind-preactC, kind-thrS, or
    kind-preactC-thrS for both), so that the dead-latent handling is compared on the same stream."""
    from expertize.conversion.recipe.layer_config import has_preact_loss

    settings = [[]]
    for key, tag, values in (("preact_coef", "preact", preact_coefs), ("threshold_lr_scale", "thr", threshold_lr_scales)):
        if values:
            settings = [done + [(key, tag, v)] for done in settings for v in values]
    out = []
    for kind in KINDS:
        layer = {"kind": kind, "k": k, "match_transcoder": 16}
        if settings != [[]] and has_preact_loss(kind):
            out += [{"name": "-".join([kind] + [f"{tag}{v:g}" for _, tag, v in setting]), "layer": layer,
                     "train": {key: v for key, _, v in setting}} for setting in settings]
        else:
            out.append({"name": kind, "layer": layer})
    return out


def tree(model: str, data: Path, tokens: int, k: int, seed: int, out: Path,
         preact_coefs: list[float] | None = None, threshold_lr_scales: list[float] | None = None) -> dict:
    folder, corpus, separator = MODELS[model]
    return {
        "base_model": str(data / folder), "dtype": "float32", "layers": "all",
        "layer": {"kind": "transcoder", "k": k, "match_transcoder": 16},
        "data": text_data(data / corpus, separator, 128, tokens, 32_768, 0),
        "train": {**TRAIN, "seed": seed}, "eval": EVAL,
        "variants": variants(k, preact_coefs, threshold_lr_scales),
        "output_dir": str(out),
    }


def rows_of(model: str, seed: int, metrics: dict[str, dict], out: Path) -> list[dict]:
    rows = []
    for kind, m in metrics.items():
        layers = m["layers"]
        config = json.loads((out / kind / "config.json").read_text())

        def mean(key: str, layers=layers) -> float:
            return statistics.fmean(v[key] for v in layers.values() if v.get(key) is not None)

        rows.append({
            "model": model, "seed": seed, "kind": kind,
            "kl": m["ce"]["kl_base_spliced"], "delta_ce": m["ce"]["delta"],
            "fvu": mean("fvu"), "l0": mean("l0"), "dead": mean("dead_fraction"), "code_share": mean("code_share"),
            "parameters": sum(_parameters(s) for s in config["sparse_layers"].values()),
        })
    return rows


def _parameters(spec: dict) -> int:
    from expertize.modeling import spec_from_dict

    return spec_from_dict(spec).num_parameters()


def table(rows: list[dict], budget: str) -> str:
    lines = [f"Budget: {budget}.", "",
             "| model | kind | parameters | KL | KL / TopK's (paired) | ΔCE | FVU (mean of layers) | L0 | dead | "
             "code share |",
             "|---|---|---:|---|---|---|---|---:|---:|---:|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for kind in dict.fromkeys(r["kind"] for r in rows if r["model"] == model):
            mine = [r for r in rows if r["model"] == model and r["kind"] == kind]
            if not mine:
                continue

            def cell(key: str, fmt: str, mine=mine) -> str:
                values = [r[key] for r in mine]
                mean, low, high = seed_interval(values)
                if len(values) < 2:
                    return f"{format_value(mean, fmt)} (one seed)"
                return f"{format_value(mean, fmt)} ± {format_value((high - low) / 2, fmt)}"

            topk = {r["seed"]: r["kl"] for r in rows if r["model"] == model and r["kind"] == KINDS[0]}
            ratios = [r["kl"] / topk[r["seed"]] for r in mine if r["seed"] in topk]
            mean, low, high = seed_interval(ratios)
            paired = f"{format_value(mean, '.3f')} [{format_value(low, '.3f')}, {format_value(high, '.3f')}]"
            lines.append(f"| {model} | {kind} | {mine[0]['parameters']:,} | {cell('kl', '.4f')} | {paired} | "
                         f"{cell('delta_ce', '.4f')} | {cell('fvu', '.4f')} | {cell('l0', '.1f')} | "
                         f"{cell('dead', '.3f')} | {cell('code_share', '.2f')} |")
    return "\n".join(lines)


def report(saved: dict) -> str:
    """The kinds' table, then (when the run scored graphs) the graph scores' table."""
    text = table(saved["rows"], saved["budget"])
    if saved.get("graph_scores"):
        from circuit_scores import scores_table

        text += ("\n\nGraph scores (circuit-tracer's compute_graph_scores; [95 % t interval] over the prompts, and in "
                 "the seeds' \"all\" row over every seed's prompts pooled; CLT − set paired prompt by prompt):\n\n"
                 + scores_table(saved["graph_scores"]))
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.environ.get("EXPERTIZE_DATA"), help="shared/data (default: "
                        "$EXPERTIZE_DATA)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--tokens", type=int, default=163_840, help="training tokens per run")
    parser.add_argument("--k", type=int, default=16, help="TopK's K and the JumpReLU kinds' target L0")
    parser.add_argument("--preact-coefs", help="train the JumpReLU kinds once per train.preact_coef, e.g. 1,0 "
                        "(default: the recipe default only)")
    parser.add_argument("--threshold-lr-scales", help="train the JumpReLU kinds once per train.threshold_lr_scale, "
                        "e.g. 1,0.3 (default: the recipe default only)")
    parser.add_argument("--runs-dir", help="keep the run folders here (reused when finished)")
    parser.add_argument("--out", help="write the table (markdown) here too")
    parser.add_argument("--from-rows", help="print the table of a finished run's rows.json (no training)")
    parser.add_argument("--graph-scores", action="store_true", help="score the JumpReLU set and the CLT with "
                        "circuit-tracer's compute_graph_scores on held-out prompts (benchmarks/circuit_scores.py)")
    parser.add_argument("--circuit-tracer-python", default=os.environ.get("EXPERTIZE_CIRCUIT_TRACER_PYTHON"),
                        help="the python of scripts/circuit_tracer_env.sh's venv (default "
                        "$EXPERTIZE_CIRCUIT_TRACER_PYTHON)")
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts per run for --graph-scores")
    parser.add_argument("--prompt-chars", type=int, default=160, help="characters per prompt (cut at a word)")
    parser.add_argument("--max-feature-nodes", type=int, default=8192,
                        help="circuit-tracer's cap on the features a graph keeps (the scores leave the rest out)")
    args = parser.parse_args()
    if args.from_rows:
        saved = json.loads(Path(args.from_rows).read_text(encoding="utf-8"))
        print(report(saved))
        return 0
    if not args.data:
        parser.error("give --data or set EXPERTIZE_DATA (the shared data folder)")
    if args.graph_scores and not (args.circuit_tracer_python and Path(args.circuit_tracer_python).is_file()):
        parser.error(f"--graph-scores needs --circuit-tracer-python (got {args.circuit_tracer_python!r}): make the "
                     "venv with `scripts/circuit_tracer_env.sh DIR` and pass DIR/bin/python")
    root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="circuit-kinds-"))
    rows, graph_rows = [], []
    coefs = [float(c) for c in args.preact_coefs.split(",")] if args.preact_coefs else None
    scales = [float(c) for c in args.threshold_lr_scales.split(",")] if args.threshold_lr_scales else None
    for model in args.models.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            out = root / f"{model}-s{seed}"
            metrics, seconds = run_variants(tree(model, Path(args.data), args.tokens, args.k, seed, out, coefs, scales),
                                            str(out))
            rows += rows_of(model, seed, metrics, out)
            print(f"{model} seed {seed}: {'reused' if seconds is None else f'{seconds:.0f} s'}", file=sys.stderr)
            if args.graph_scores:
                from circuit_scores import score_model_seed

                graph_rows += [dict(r, model=model, seed=seed) for r in score_model_seed(
                    out, list(metrics), args.circuit_tracer_python, args.prompts, args.prompt_chars,
                    args.max_feature_nodes)]
    budget = (f"{args.tokens:,} training tokens per run (1,024 per step), every layer, k = {args.k}, "
              f"16 x d_model latents, lr auto, seeds {args.seeds}"
              + (f", the JumpReLU kinds at train.preact_coef {args.preact_coefs}" if args.preact_coefs else "")
              + (f", the JumpReLU kinds at train.threshold_lr_scale {args.threshold_lr_scales}"
                 if args.threshold_lr_scales else "")
              + "; ± = 95 % t half-width over seeds, [paired interval] of the per-seed ratio to the TopK transcoder "
              "on the same stream")
    if args.graph_scores:
        budget += (f"; graph scores: circuit-tracer 0.5.0's compute_graph_scores on {args.prompts} held-out prompts "
                   f"per run (<= {args.prompt_chars} characters), up to {args.max_feature_nodes:,} features a graph")
    saved = {"budget": budget, "rows": rows, "graph_scores": graph_rows}
    (root / "rows.json").write_text(json.dumps(saved, indent=1), encoding="utf-8")
    text = report(saved)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
