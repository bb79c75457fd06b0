"""Dead-unit handling compared at equal tokens: none, the selection-bias floor (the default), DeepSeek's symmetric
selection bias, resampling, AuxK.

Two suites; each model is ONE `expertize upcycle` whose `variants:` are every setting, trained together on one
activation stream (tests/test_variants.py: each variant gets the weights it would get alone), so the methods see the
same tokens in the same order from the same initialization:

    quickstart  the shipped quickstart recipe unchanged (tiny-gpt2-shakespeare layer 2, MxD parameter-matched to a
                32x transcoder: N = 3,584 experts, 200k tokens, lr 1e-3) except layer.k in {8, 16, 32}, x method
    tiny        tiny-gpt2-shakespeare (layer 2, d 128, gelu_new MLP 512) and stories260k (layer 2, d 64, SwiGLU 172),
                each on its own text; MxD and the TopK transcoder at the 8x transcoder budget, K in {8, 32}, lr in
                {1e-3, 1e-2, 3e-2} x {none, floor}, and the other methods at lr 1e-2; 327,680 tokens (320 steps of
                1,024), AdamW, 50 warm-up steps, cosine to 0.1 lr, NMSE, fp32, seed 0

Methods (recipe `train:` keys): none (auxk_coef 0); floor (balance: floor, balance_floor 0.3: the default); bias
(balance: bias, DeepSeek-V3's symmetric rule); resample
(resample_every_tokens: auto, auxk_coef 0); auxk (auxk_coef 1/32, dead_window_tokens auto: 1/40 of the run, the
previous default).

Columns: dead = fraction of units that never fired on the held-out tokens; FVU, L0 (and L0/K), effective units
(exp of the entropy of the firings) on held-out tokens; ΔCE = CE(spliced) − CE(base); "vs none" = FVU and ΔCE
ratios to the same setting without handling. Targets (issue 19): dead ≤ 10 % at K = 8 and ≤ 5 % at K ≥ 16, FVU and
ΔCE ≤ 1.02x none; MxD's L0 ≥ 0.9 K at every learning rate. The `target` column says pass / FAIL per row for the
default method.

Run:  EXPERTIZE_DATA=/path/to/shared/data python benchmarks/dead_units.py [--suites quickstart,tiny] [--out FILE]
      python benchmarks/dead_units.py --suites quickstart --methods none,floor    (about 3 min on 2 idle cores)
"""

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _runs import run_variants, text_data

MODELS = {
    # name: (model folder, corpus, document separator, layer)
    "tiny-gpt2-shakespeare": ("models/tiny-gpt2-shakespeare", "corpora/tinyshakespeare.txt", "blank_line", 2),
    "stories260k": ("models/stories260k", "corpora/stories260k_samples.txt", "line", 2),
}
METHODS = {  # every method sets every key, so that none of them inherits the recipe's default handling
    "none": {"auxk_coef": 0.0, "balance": "none", "resample_every_tokens": 0},
    "floor": {"auxk_coef": 0.0, "balance": "floor", "resample_every_tokens": 0},
    "bias": {"auxk_coef": 0.0, "balance": "bias", "resample_every_tokens": 0},
    "resample": {"auxk_coef": 0.0, "balance": "none", "resample_every_tokens": "auto"},
    "auxk": {"auxk_coef": 1 / 32, "balance": "none", "resample_every_tokens": 0, "dead_window_tokens": "auto"},
}
DEFAULT = "floor"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("EXPERTIZE_DATA"),
                   help="shared data folder holding models/ and corpora/ (default: $EXPERTIZE_DATA)")
    p.add_argument("--suites", default="quickstart,tiny", help="comma-separated subset of quickstart, tiny")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--models", default=",".join(MODELS), help="the tiny suite's models")
    p.add_argument("--lrs", default="1e-3,1e-2,3e-2", help="the tiny suite's learning rates (none vs the default)")
    p.add_argument("--train-tokens", type=int, default=327_680, help="the tiny suite's training tokens per variant")
    p.add_argument("--eval-tokens", type=int, default=32_768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs-dir", default=None, help="keep the runs here (a finished identical run is reused)")
    p.add_argument("--out", default=None, help="also write the Markdown table to this file")
    return p.parse_args()


def quickstart_tree(args, methods: list[str], root: Path) -> tuple[dict, list[dict]]:
    from expertize.conversion.recipe import load_recipe, recipe_to_dict

    tree = recipe_to_dict(load_recipe("quickstart"))  # the shipped recipe, its ${EXPERTIZE_ASSETS} resolved
    tree["output_dir"] = str(root / "quickstart")
    tree["eval"].update({"generation_prompts": 0, "histogram": False})
    settings, variants = [], []
    for k in (8, 16, 32):
        for method in methods:
            name = f"mxd-k{k}-{method}"
            variants.append({"name": name, "layer": {"k": k}, "train": METHODS[method]})
            settings.append({"suite": "quickstart", "model": "quickstart", "kind": "mxd", "k": k,
                             "lr": tree["train"]["lr"], "method": method, "name": name})
    tree["variants"] = variants
    return tree, settings


def tiny_tree(args, model: str, methods: list[str], lrs: list[float], root: Path) -> tuple[dict, list[dict]]:
    model_dir, corpus, separator, layer = MODELS[model]
    data = Path(args.data)
    tree = {
        "base_model": str(data / model_dir), "dtype": "float32", "layers": [layer],
        "layer": {"kind": "mxd", "k": 32, "match_transcoder": 8},
        "data": text_data(data / corpus, separator, 128, args.train_tokens, args.eval_tokens, args.seed),
        "train": {"lr": 1e-2, "warmup_steps": 50, "schedule": "cosine", "min_lr_ratio": 0.1, "tokens_per_step": 1024,
                  "loss": "nmse", "precision": "fp32", "grad_clip": 1.0, "checkpoint_every": 0, "log_every": 20,
                  "seed": args.seed, "device": "cpu"},
        "eval": {"batch_sequences": 16, "generation_prompts": 0, "histogram": False},
        "output_dir": str(root / model),
    }
    settings, variants = [], []
    for kind in ("mxd", "transcoder"):
        for k in (8, 32):
            runs = [(lr, m) for lr in lrs for m in methods if m in ("none", DEFAULT)]
            runs += [(1e-2, m) for m in methods if m not in ("none", DEFAULT)]
            for lr, method in runs:
                name = f"{kind}-k{k}-lr{lr:g}-{method}"
                variants.append({"name": name, "layer": {"kind": kind, "k": k, "match_transcoder": 8},
                                 "train": {"lr": lr, **METHODS[method]}})
                settings.append({"suite": "tiny", "model": model, "kind": kind, "k": k, "lr": lr, "method": method,
                                 "name": name})
    tree["variants"] = variants
    return tree, settings


def collect(metrics_of: dict, settings: list[dict]) -> list[dict]:
    rows = []
    for s in settings:
        metrics = metrics_of[s["name"]]
        (m,) = metrics["layers"].values()
        rows.append({**s, "units": m["num_units"], "dead": m["dead_fraction"], "fvu": m["fvu"], "l0": m["l0"],
                     "effective": m.get("effective_units"), "delta_ce": metrics["ce"]["delta"]})
    return rows


def _f(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, fmt)


def target(row: dict, none: dict | None) -> str:
    """pass / FAIL against the issue's targets (default method only)."""
    if row["method"] != DEFAULT:
        return ""
    ok = row["dead"] <= (0.10 if row["k"] <= 8 else 0.05)
    if row["kind"] == "mxd":
        ok = ok and row["l0"] >= 0.9 * row["k"]
    if none is not None:
        ok = ok and row["fvu"] <= 1.02 * none["fvu"] and row["delta_ce"] <= 1.02 * max(none["delta_ce"], 0)
    return "pass" if ok else "FAIL"


def table(rows: list[dict]) -> str:
    lines = ["| model | kind | K | units | lr | method | dead | FVU | ΔCE | L0 (/K) | effective units | FVU vs none "
             "| ΔCE vs none | target |", "|" + "---|" * 14]
    none = {(r["model"], r["kind"], r["k"], r["lr"]): r for r in rows if r["method"] == "none"}
    for r in rows:
        base = none.get((r["model"], r["kind"], r["k"], r["lr"]))
        fvu_ratio = ce_ratio = ""
        if base is not None and r["method"] != "none":
            fvu_ratio = _f(r["fvu"] / base["fvu"], ".3f")
            ce_ratio = _f(r["delta_ce"] / base["delta_ce"], ".3f") if base["delta_ce"] > 1e-4 else "n/a"
        lines.append(
            f"| {r['model']} | {r['kind']} | {r['k']} | {r['units']} | {r['lr']:g} | {r['method']} | "
            f"{_f(r['dead'], '.1%')} | {_f(r['fvu'], '.4f')} | {_f(r['delta_ce'], '+.4f')} | "
            f"{_f(r['l0'], '.1f')} ({_f(r['l0'] / r['k'], '.2f')}) | {_f(r['effective'], '.0f')} | {fvu_ratio} | "
            f"{ce_ratio} | {target(r, base)} |"
        )
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    suites = [s for s in args.suites.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS] + [s for s in suites if s not in ("quickstart", "tiny")]
    if bad:
        print(f"error: unknown suite / method {bad}", file=sys.stderr)
        return 2
    if "tiny" in suites and (not args.data or not (Path(args.data) / "models").is_dir()):
        print("error: give --data or set EXPERTIZE_DATA to the shared data folder (models/, corpora/)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    lrs = [float(x) for x in args.lrs.split(",") if x]
    root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="expertize-dead-units-"))
    jobs = []
    if "quickstart" in suites:
        jobs.append(quickstart_tree(args, methods, root))
    if "tiny" in suites:
        jobs += [tiny_tree(args, model, methods, lrs, root) for model in args.models.split(",") if model]
    budget = (f"{sum(len(s) for _, s in jobs)} variants in {len(jobs)} runs (one activation stream each); quickstart "
              f"200,000 training tokens per variant, tiny {args.train_tokens:,}; {args.eval_tokens:,} eval tokens; "
              f"seed {args.seed}; CPU")
    print(f"budget: {budget}", flush=True)
    started, rows = time.perf_counter(), []
    try:
        for tree, settings in jobs:
            metrics_of, seconds = run_variants(tree, "benchmarks/dead_units.py")
            print(f"  {settings[0]['model']}: {len(settings)} variants "
                  f"[{'reused' if seconds is None else f'{seconds:.0f}s'}]", flush=True)
            rows += collect(metrics_of, settings)
    finally:
        if not args.runs_dir:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - started
    text = f"{table(rows)}\n\nbudget: {budget}; wall time {elapsed / 60:.1f} min\n"
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
