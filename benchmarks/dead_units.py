"""Dead units with AuxK off and on, at equal tokens: MxD and the TopK transcoder at K = 8 and K = 32.

Each model is ONE `expertize upcycle` (`recipe_from_dict` + `upcycle`, via `_runs.run_variants`) of a recipe built
here whose `variants:` are every (kind, K, AuxK off / on): the base model runs over the corpus once and that
activation stream feeds every variant's trainer step by step, each variant getting the weights it would get alone
(tests/test_variants.py). The AuxK-off and AuxK-on variants of a (model, kind, K) differ only in `train.auxk_coef`
(0 vs --auxk-coef), so they see the same tokens in the same order from the same initialization. With --runs-dir
each variant's model folder is <runs-dir>/<model>/<kind>-k<K>-<off|auxk>/ (a finished one is reused).

    models   tiny-gpt2-shakespeare (layer 2, d 128, gelu_new MLP 512) and stories260k (layer 2, d 64, SwiGLU 172),
             each on its own text (tinyshakespeare / TinyStories samples), 10% of the documents held out
    size     layer.match_transcoder = 8: transcoder 8·d latents; MxD the expert count of that parameter budget
    training AdamW lr 1e-2 (benchmarks/all_kinds.py's best shared rate), 50 warm-up steps, cosine to 0.1 lr, 1,024
             tokens per step, NMSE, fp32, special-token positions left out (data.exclude_special_positions)
    AuxK     train.auxk_coef (default 1/32, the paper's), train.auxk_k auto (min(512, d/2)), train.dead_window_tokens
             auto (1/40 of the run's tokens)

Columns: dead = fraction of units that never fired on the held-out tokens (evaluation; special positions left out);
dead (train) = fraction dead by the training window at the last step (train_log.jsonl); FVU and L0 on held-out
tokens; ΔCE = CE(spliced) − CE(base) on the held-out sequences. "on/off" rows compare the AuxK run with the AuxK-off
run of the same setting: FVU and ΔCE ratios (< 1.10: within the issue's 10% target).

Run:  EXPERTIZE_DATA=/path/to/shared/data python benchmarks/dead_units.py [--out dead_units.md]
      python benchmarks/dead_units.py --models stories260k --kinds mxd --ks 8 --auxk-coef 0.1

Runtime: 16 variants at the default 327,680 training tokens each, in 2 runs (one per model). As 16 separate runs
this took 4.4 min on 2 CPU cores; the joint runs save the per-run base-model loading and capture (not re-measured at
the default budget: the cores were shared with other jobs; --models stories260k --train-tokens 8192 --eval-tokens
4096, 8 variants, took 1.0 min there). The budget and the wall time are printed at the start and the end.
"""

import argparse
import json
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
KINDS = ("mxd", "transcoder")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("EXPERTIZE_DATA"),
                   help="shared data folder holding models/ and corpora/ (default: $EXPERTIZE_DATA)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of mxd, transcoder")
    p.add_argument("--ks", default="8,32", help="comma-separated K values (default 8,32)")
    p.add_argument("--match-transcoder", type=float, default=8, help="parameter budget (default 8·d latents)")
    p.add_argument("--train-tokens", type=int, default=327_680,
                   help="training tokens per run (default 327,680 = 320 steps of 1,024)")
    p.add_argument("--tokens-per-step", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--context-length", type=int, default=128)
    p.add_argument("--eval-tokens", type=int, default=32_768)
    p.add_argument("--auxk-coef", type=float, default=1 / 32, help="train.auxk_coef of the AuxK runs (1/32)")
    p.add_argument("--auxk-k", default="auto", help='train.auxk_k of the AuxK runs ("auto" or a number)')
    p.add_argument("--dead-window", default="auto", help='train.dead_window_tokens ("auto" or a number)')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs-dir", default=None, help="keep the runs here (a finished identical run is reused)")
    p.add_argument("--out", default=None, help="also write the Markdown table to this file")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    return p.parse_args()


def _auto_or_int(value: str):
    return value if value == "auto" else int(value)


def build_tree(args, model: str, kind: str, k: int, auxk_coef: float, out_dir: Path) -> dict:
    model_dir, corpus, separator, layer = MODELS[model]
    data = Path(args.data)
    return {
        "base_model": str(data / model_dir),
        "dtype": "float32",
        "layers": [layer],
        "layer": {"kind": kind, "k": k, "match_transcoder": args.match_transcoder},
        "data": text_data(data / corpus, separator, args.context_length, args.train_tokens, args.eval_tokens,
                          args.seed),
        "train": {
            "lr": args.lr, "warmup_steps": args.warmup_steps, "schedule": "cosine", "min_lr_ratio": 0.1,
            "tokens_per_step": args.tokens_per_step, "loss": "nmse", "precision": "fp32", "grad_clip": 1.0,
            "checkpoint_every": 0, "log_every": 20, "seed": args.seed, "device": "cpu",
            "auxk_coef": auxk_coef, "auxk_k": _auto_or_int(args.auxk_k),
            "dead_window_tokens": _auto_or_int(args.dead_window),
        },
        "eval": {"batch_sequences": 16, "generation_prompts": 0, "histogram": False},
        "output_dir": str(out_dir),
    }


def _f(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, fmt)


def model_runs(args, model: str, kinds: list[str], ks: list[int], root: Path) -> list[dict]:
    """Every (kind, K, AuxK off / on) of `model` as a variant of ONE recipe, trained on one activation stream (one
    capture) into root/<model>/<kind>-k<K>-<off|auxk>/; each variant's weights are those it would get alone. The
    off / on variants of a setting differ only in train.auxk_coef."""
    settings = [(kind, k, auxk) for kind in kinds for k in ks for auxk in (False, True)]
    name = {s: f"{s[0]}-k{s[1]}-{'auxk' if s[2] else 'off'}" for s in settings}
    tree = build_tree(args, model, kinds[0], ks[0], args.auxk_coef, root / model)
    tree["variants"] = [
        {"name": name[(kind, k, auxk)], "layer": {"kind": kind, "k": k, "match_transcoder": args.match_transcoder},
         "train": {"auxk_coef": args.auxk_coef if auxk else 0.0}}
        for kind, k, auxk in settings
    ]
    print(f"  {model}: one run, {len(settings)} variants on one activation stream", flush=True)
    metrics_of, seconds = run_variants(tree, "benchmarks/dead_units.py")
    print(f"  {model}: [{'reused' if seconds is None else f'{seconds:.0f}s'}]", flush=True)
    layer = str(MODELS[model][3])
    rows = []
    for kind, k, auxk in settings:
        out_dir = root / model / name[(kind, k, auxk)]
        metrics = metrics_of[name[(kind, k, auxk)]]
        m, ce = metrics["layers"][layer], metrics["ce"]
        log = [json.loads(line) for line in (out_dir / "train_log.jsonl").read_text(encoding="utf-8").splitlines()]
        last = log[-1]
        row = {
            "model": model, "kind": kind, "k": k, "auxk": auxk, "num_units": m["num_units"],
            "dead": m["dead_fraction"], "dead_train": last["dead_fraction"], "fvu": m["fvu"], "delta_ce": ce["delta"],
            "l0": m["l0"], "seconds": seconds,
        }
        print(f"  {model} {kind} K={k} AuxK {'on ' if auxk else 'off'}: dead {row['dead']:.1%} (train "
              f"{row['dead_train']:.1%}) of {row['num_units']}, FVU {row['fvu']:.4f}, ΔCE {row['delta_ce']:+.4f}, "
              f"L0 {row['l0']:.1f}", flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | kind | K | units | AuxK | dead (eval) | dead (train window) | FVU | ΔCE | L0 | FVU on/off "
             "| ΔCE on/off |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    off = {(r["model"], r["kind"], r["k"]): r for r in rows if not r["auxk"]}
    for r in rows:
        ratio_fvu = ratio_ce = ""
        base = off.get((r["model"], r["kind"], r["k"]))
        if r["auxk"] and base is not None:
            ratio_fvu = _f(r["fvu"] / base["fvu"], ".3f")
            # ΔCE can be ~0 or negative: the ratio is only meaningful for a positive AuxK-off ΔCE.
            ratio_ce = _f(r["delta_ce"] / base["delta_ce"], ".3f") if base["delta_ce"] > 1e-4 else "n/a"
        lines.append(
            f"| {r['model']} | {r['kind']} | {r['k']} | {r['num_units']} | {'on' if r['auxk'] else 'off'} | "
            f"{_f(r['dead'], '.1%')} | {_f(r['dead_train'], '.1%')} | {_f(r['fvu'], '.4f')} | "
            f"{_f(r['delta_ce'], '+.4f')} | {_f(r['l0'], '.1f')} | {ratio_fvu} | {ratio_ce} |"
        )
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    if not args.data or not (Path(args.data) / "models").is_dir():
        print("error: give --data or set EXPERTIZE_DATA to the shared data folder (models/, corpora/)",
              file=sys.stderr)
        return 2
    models = [m for m in args.models.split(",") if m]
    kinds = [k for k in args.kinds.split(",") if k]
    ks = [int(k) for k in args.ks.split(",") if k]
    for name, allowed, given in (("model", MODELS, models), ("kind", KINDS, kinds)):
        bad = [g for g in given if g not in allowed]
        if bad:
            print(f"error: unknown {name} {bad}; choose from {', '.join(allowed)}", file=sys.stderr)
            return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    n_runs = len(models) * len(kinds) * len(ks) * 2
    budget = (f"{n_runs} variants ({len(models)} runs, one per model) x {args.train_tokens:,} training tokens "
              f"({args.train_tokens // args.tokens_per_step} steps of {args.tokens_per_step:,}), {args.eval_tokens:,} "
              f"eval tokens, lr {args.lr:g}, AuxK coef {args.auxk_coef:g}, k_aux {args.auxk_k}, dead window "
              f"{args.dead_window}")
    print(f"budget: {budget}", flush=True)
    root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="expertize-dead-units-"))
    started = time.perf_counter()
    rows = []
    try:
        for model in models:
            rows += model_runs(args, model, kinds, ks, root)
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
