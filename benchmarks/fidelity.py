"""Fidelity of MxD vs TopK transcoder vs skip transcoder on real checkpoints, parameter-matched (MxD paper §3-5).

The MxD paper's claim (Fig. 3; shared/papers/digests/mxd.md §5): at matched parameters and the same K, the CE increase
when the MLP is replaced by MxD is far below that of a transcoder (TC) or skip transcoder (STC), e.g. at K=32 on GPT2
layer 8 ΔCE is +0.003 (MxD) vs +0.025 (TC) / +0.021 (STC). This script checks that claim, on a small budget, with
the real checkpoints in the shared data folder:

    stories260k            Llama, 5 layers, d_model 64, SwiGLU 172 -> MxD encoder glu/silu (auto)  layer 2
                           on corpora/stories260k_samples.txt (one story per line)
    tiny-gpt2-shakespeare  GPT-2, 4 layers, d_model 128, gelu_new 512 -> MxD encoder mlp/gelu_new   layer 2
                           on corpora/tinyshakespeare.txt (one speech per paragraph)

For each model, ONE run of `expertize upcycle` whose `variants:` are every (method, K), differing *only* in
`layer.kind` and `layer.k`; the base model runs over the corpus once and that activation stream feeds every
variant's trainer step by step, each variant getting the weights it would get alone (tests/test_variants.py):

    mxd              match_transcoder: 32 (convention "exact": the largest N within the 32x transcoder's parameters)
    transcoder       match_transcoder: 32 (32 x d_in latents)
    skip_transcoder  match_transcoder: 32 (32 x d_in latents, plus the dense d_in x d_out skip matrix)

Same K, same training tokens (same seed, same order), same held-out documents, same optimizer settings (AdamW, lr,
warm-up, cosine decay to 0.1 lr, NMSE loss, AuxK at the recipe default train.auxk_coef 1/32). Nothing is tuned per
method.

Each variant's model folder is <out>/<model>/<kind>-k<K>/ (the layout, and recipe, of the former one-run-per-method
folders, so those are reused); a finished variant is not run again (its recipe must equal the one this invocation
would use), and unfinished ones resume, so the script can be interrupted and restarted; a variant that diverges
stops alone and is reported FAILED (exit status 1). The table is printed and written as <out>/fidelity.md and
<out>/fidelity.json.

Columns: parameters of the sparse layer (from the saved spec); NMSE as the paper defines it; FVU; ΔCE = CE(spliced)
- CE(base); KL(base ‖ spliced) per token; CE recovered vs zero ablation; the fraction of greedy 32-token
continuations (4-token held-out prompts) identical to the base model's. The verdict is, per (model, K),
ΔCE(MxD)/ΔCE(TC) and ΔCE(MxD)/ΔCE(STC) against the target ratio ≤ 0.5.

Run:  EXPERTIZE_DATA=/path/to/shared/data python benchmarks/fidelity.py
      python benchmarks/fidelity.py --data /path/to/shared/data --ks 32,8 --train-tokens 163840 --out runs/fid-small

Default budget: 327,680 training tokens per run (320 steps of 1,024), the most a multiple of 1,024 allows below the
343,808 training tokens that tinyshakespeare yields (90% of its paragraphs, context 128). As 12 separate runs this
took 2m14s on 2 otherwise idle CPU cores; now 2 runs of 6 variants, which saves the per-run base-model loading and
capture (not re-measured at the default budget: the cores were shared with other jobs; a 4,096-token smoke run of all
12 variants took 260 s wall there, mostly the 12 evaluations).
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from _runs import run_variants_caught, text_data

MODELS = {
    # name: (model folder, corpus, document separator, layer)
    "stories260k": ("models/stories260k", "corpora/stories260k_samples.txt", "line", 2),
    "tiny-gpt2-shakespeare": ("models/tiny-gpt2-shakespeare", "corpora/tinyshakespeare.txt", "blank_line", 2),
}
METHODS = ("mxd", "transcoder", "skip_transcoder")
SHORT = {"mxd": "MxD", "transcoder": "TC", "skip_transcoder": "STC"}
TARGET_RATIO = 0.5


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", default=os.environ.get("EXPERTIZE_DATA"),
                   help="shared data folder holding models/ and corpora/ (default: $EXPERTIZE_DATA)")
    p.add_argument("--out", default="runs/fidelity", help="output folder (default runs/fidelity)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--ks", default="32,8", help="comma-separated K values (default 32,8)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--train-tokens", type=int, default=327_680,
                   help="training tokens per run, the same for every run (default 327,680 = 320 steps of 1,024: "
                        "just under the 343,808 training tokens tinyshakespeare gives at context 128; stories260k "
                        "gives 940,928)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate, shared by all runs (default 1e-3)")
    p.add_argument("--warmup-steps", type=int, default=50, help="linear warm-up steps (default 50)")
    p.add_argument("--tokens-per-step", type=int, default=1024, help="tokens per optimizer step (default 1024)")
    p.add_argument("--context-length", type=int, default=128, help="tokens per packed sequence (default 128)")
    p.add_argument("--eval-tokens", type=int, default=32_768, help="held-out evaluation tokens (default 32,768)")
    p.add_argument("--generation-prompts", type=int, default=32, help="greedy-continuation prompts (default 32)")
    p.add_argument("--match-transcoder", type=float, default=32, help="transcoder expansion factor (default 32)")
    p.add_argument("--seed", type=int, default=0, help="data, init and shuffle seed (default 0)")
    p.add_argument("--device", default="cpu", help="train.device: cpu (default), auto, cuda, ...")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    return p.parse_args()


def build_tree(args: argparse.Namespace, model: str, kind: str, k: int, out_dir: Path) -> dict:
    """The recipe of one run; only layer.kind and layer.k vary between runs of one model."""
    model_dir, corpus, separator, layer = MODELS[model]
    data = Path(args.data)
    layer_cfg = {"kind": kind, "k": k, "match_transcoder": args.match_transcoder}
    if kind == "mxd":
        layer_cfg.update(match_convention="exact", encoder="auto", activation="auto")
    return {
        "base_model": str(data / model_dir),
        "dtype": "float32",
        "layers": [layer],
        "layer": layer_cfg,
        "data": text_data(data / corpus, separator, args.context_length, args.train_tokens, args.eval_tokens, args.seed),
        "train": {
            "lr": args.lr,
            "warmup_steps": args.warmup_steps,
            "schedule": "cosine",
            "min_lr_ratio": 0.1,
            "tokens_per_step": args.tokens_per_step,
            "loss": "nmse",
            "precision": "fp32",
            "checkpoint_every": 100,
            "log_every": 50,
            "seed": args.seed,
            "device": args.device,
        },
        "eval": {
            "batch_sequences": 16,
            "generation_prompts": args.generation_prompts,
            "prompt_tokens": 4,
            "continuation_tokens": 32,
            "histogram": True,
        },
        "output_dir": str(out_dir),
    }


def layer_parameters(out_dir: Path, layer: int) -> tuple[int, dict]:
    """Parameter count of the saved sparse layer, from the spec in the saved model's config.json."""
    from expertize.modeling import spec_from_dict

    config = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
    spec = spec_from_dict(config["sparse_layers"][str(layer)])
    return spec.num_parameters(), spec.to_dict()


def row_for(model: str, kind: str, k: int, out_dir: Path, metrics: dict, seconds: float | None) -> dict:
    layer = MODELS[model][3]
    params, spec = layer_parameters(out_dir, layer)
    m, ce, gen = metrics["layers"][str(layer)], metrics["ce"], metrics.get("generation") or {}
    units = spec.get("num_experts", spec.get("num_latents"))
    return {
        "model": model,
        "layer": layer,
        "k": k,
        "method": SHORT[kind],
        "kind": kind,
        "units": units,
        "parameters": params,
        "nmse_paper": m["nmse_paper"],
        "fvu": m["fvu"],
        "l0": m["l0"],
        "dead_fraction": m["dead_fraction"],
        "ce_base": ce["base"],
        "ce_spliced": ce["spliced"],
        "delta_ce": ce["delta"],
        "kl": ce["kl_base_spliced"],
        "ce_zero_ablation": ce["zero_ablation"],
        "ce_recovered_zero": ce["ce_recovered_zero"],
        "greedy_match_at_end": gen.get("match_at_end"),
        "train_tokens": metrics["train"]["tokens"],
        "eval_tokens": metrics["eval_tokens"],
        "seconds": seconds,  # of the model's one run (every method and K together); None when reused
        "run_dir": str(out_dir),
    }


def ratio(num: float, den: float) -> float | None:
    """ΔCE(MxD)/ΔCE(baseline); None when the baseline's ΔCE is not positive (the ratio is then meaningless)."""
    return num / den if den > 0 else None


def verdicts(rows: list[dict]) -> list[dict]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for k in dict.fromkeys(r["k"] for r in rows if r["model"] == model):
            by = {r["kind"]: r for r in rows if r["model"] == model and r["k"] == k}
            if "mxd" not in by:
                continue
            for base in ("transcoder", "skip_transcoder"):
                if base not in by:
                    continue
                value = ratio(by["mxd"]["delta_ce"], by[base]["delta_ce"])
                if value is None:
                    verdict = "n/a"  # baseline ΔCE <= 0
                else:
                    verdict = "PASS" if value <= TARGET_RATIO else "FAIL"
                out.append({"model": model, "k": k, "baseline": SHORT[base], "ratio": value, "verdict": verdict,
                            "delta_ce_mxd": by["mxd"]["delta_ce"], "delta_ce_baseline": by[base]["delta_ce"]})
    return out


def _f(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, fmt)


def format_tables(rows: list[dict], checks: list[dict], header: str) -> str:
    cols = ["model", "layer", "K", "method", "units", "params", "NMSE(paper)", "FVU", "ΔCE", "KL", "CE rec.(zero)",
            "greedy@32", "dead%", "base CE"]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        cells = [r["model"], str(r["layer"]), str(r["k"]), r["method"], f"{r['units']:,}", f"{r['parameters']:,}",
                 _f(r["nmse_paper"], ".4f"), _f(r["fvu"], ".4f"), _f(r["delta_ce"], "+.4f"), _f(r["kl"], ".4f"),
                 _f(r["ce_recovered_zero"], ".4f"), _f(r["greedy_match_at_end"], ".3f"),
                 _f(100 * r["dead_fraction"], ".1f"), _f(r["ce_base"], ".4f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"ΔCE ratio, target ΔCE(MxD)/ΔCE(baseline) <= {TARGET_RATIO}:", "",
              "| model | K | ratio | ΔCE MxD | ΔCE baseline | value | verdict |", "|---|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['model']} | {c['k']} | ΔCE(MxD)/ΔCE({c['baseline']}) | {c['delta_ce_mxd']:+.4f} | "
                     f"{c['delta_ce_baseline']:+.4f} | {_f(c['ratio'], '.3f')} | {c['verdict']} |")
    n_pass = sum(c["verdict"] == "PASS" for c in checks)
    lines += ["", f"{n_pass}/{len(checks)} comparisons PASS"]
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    if not args.data:
        print("error: give --data or set EXPERTIZE_DATA to the shared data folder (models/, corpora/)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars of every run
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    for m in models:
        if m not in MODELS:
            print(f"error: unknown model {m!r}; choose from {', '.join(MODELS)}", file=sys.stderr)
            return 2
    for m in methods:
        if m not in METHODS:
            print(f"error: unknown method {m!r}; choose from {', '.join(METHODS)}", file=sys.stderr)
            return 2
    out_root = Path(args.out)
    steps = args.train_tokens // args.tokens_per_step
    header = (
        f"Fidelity: MxD vs TC vs STC, parameter-matched to a {args.match_transcoder:g}x transcoder (MxD convention "
        f"'exact'); {steps * args.tokens_per_step:,} training tokens per run ({steps} steps x {args.tokens_per_step} "
        f"tokens, context {args.context_length}); AdamW lr {args.lr:g}, warm-up {args.warmup_steps}, cosine to 0.1 lr, "
        f"NMSE loss, seed {args.seed}; eval on {args.eval_tokens:,} held-out tokens (10% of documents), greedy match "
        f"over {args.generation_prompts} prompts x 32 tokens; torch threads {torch.get_num_threads()}"
    )
    print(header, flush=True)
    rows, all_warnings, failures = [], {}, []
    start = time.perf_counter()
    for model in models:
        # One run per model: every (method, K) is a variant of one recipe, trained on one activation stream (one
        # capture), each into its own model folder <out>/<model>/<kind>-k<K>/ with the weights it would get alone.
        names = {f"{kind}-k{k}": (kind, k) for k in ks for kind in methods}
        first_kind, first_k = next(iter(names.values()))
        tree = build_tree(args, model, first_kind, first_k, out_root / model)
        tree["variants"] = [{"name": name, "layer": build_tree(args, model, kind, k, out_root / model)["layer"]}
                            for name, (kind, k) in names.items()]
        print(f"  {model}: one run, {len(names)} variants on one activation stream: {', '.join(names)}", flush=True)
        metrics_of, seconds, caught, error = run_variants_caught(tree, "benchmarks/fidelity.py")
        when = "all reused" if seconds is None else f"{seconds:.0f}s"
        print(f"  {model}: trained [{when}]", flush=True)
        if caught:
            all_warnings[str(out_root / model)] = caught
        for message in caught:
            print(f"    warning: {message}", flush=True)
        for name, (kind, k) in names.items():
            if name not in metrics_of:
                failures.append({"model": model, "variant": name, "error": f"{type(error).__name__}: {error}"})
                print(f"  {model} {name}: FAILED: {failures[-1]['error']}", flush=True)
                continue
            row = row_for(model, kind, k, out_root / model / name, metrics_of[name], seconds)
            rows.append(row)
            print(f"  {model} L{row['layer']} K={k} {row['method']:<3} ({row['units']:,} units, "
                  f"{row['parameters']:,} params): ΔCE {row['delta_ce']:+.4f}, NMSE {row['nmse_paper']:.4f}, "
                  f"FVU {row['fvu']:.4f}", flush=True)
    wall = time.perf_counter() - start
    checks = verdicts(rows)
    text = format_tables(rows, checks, header)
    print()
    print(text)
    for f in failures:
        print(f"\nFAILED {f['model']} {f['variant']}: {f['error']}")
    print(f"\nwall time {wall:.0f}s (one run per model; runs reused from earlier invocations count 0)")
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / "fidelity.md").write_text(text + "\n", encoding="utf-8")
    (out_root / "fidelity.json").write_text(
        json.dumps({"header": header, "args": vars(args), "rows": rows, "checks": checks, "warnings": all_warnings,
                    "failures": failures, "wall_seconds": wall}, indent=2),
        encoding="utf-8",
    )
    print(f"wrote {out_root / 'fidelity.md'} and {out_root / 'fidelity.json'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
