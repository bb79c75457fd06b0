"""The warm-up and the schedule a recipe gets by default, against the alternatives, on several real models (issue 40).

A recipe with no `train:` keys but its budget gets `train.lr: auto`, `train.warmup_steps: auto` (a tenth of the
steps), `schedule: cosine`, `min_lr_ratio: 0.1` (conversion/recipe/schedule_rule.py). Each (model, budget, seed) is
ONE `expertize upcycle` whose `variants:` are every (kind, schedule), trained together on one activation stream;
the shared recipe leaves the schedule keys out, so the `default` variant trains exactly as a minimal recipe would,
and every other variant writes its schedule out. Every variant uses lr auto (the rule's rate for the run's length).

Schedules (SCHEDULES): default; w0-constant (no warm-up, constant); w10-constant; w5-cosine, w20-cosine (cosine to
0.1 lr after a 5 % / 20 % warm-up); w10-linear0 (linear to 0); w2-cosine0 (2 %, cosine to 0).
Kinds: MxD and the TopK transcoder at K = 32, the 8x transcoder budget (the quickstart: its shipped 32x).
Models and budgets: benchmarks/code_share.py's (`--budgets` indices).

Columns: mean KL over seeds ± 95 % t half-width (the code share in brackets: a schedule can lower MxD's KL by letting
its dense path take over, docs/results/code_share.md), and "/ best" = the default's KL over the best schedule's mean KL of
its (model, budget, kind); the issue's bar: ≤ 1.3.

    python benchmarks/schedule.py --runs-dir RUNS --out table.md
    python benchmarks/schedule.py --from-rows RUNS/rows.json --out table.md
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _runs import load_rows, run_variants
from code_share import BUDGETS, EVAL_TOKENS, MODELS, _cell
from code_share import collect as collect_rows
from dead_units import TRAIN, ensure_cache, model_tree

from expertize.conversion.recipe.lr_rule import rule_lr

SCHEDULES = {
    "default": {},
    "w0-constant": {"warmup": 0.0, "schedule": "constant", "min_lr_ratio": 0.0},
    "w10-constant": {"warmup": 0.1, "schedule": "constant", "min_lr_ratio": 0.0},
    "w5-cosine": {"warmup": 0.05, "schedule": "cosine", "min_lr_ratio": 0.1},
    "w20-cosine": {"warmup": 0.2, "schedule": "cosine", "min_lr_ratio": 0.1},
    "w10-linear0": {"warmup": 0.1, "schedule": "linear", "min_lr_ratio": 0.0},
    "w2-cosine0": {"warmup": 0.02, "schedule": "cosine", "min_lr_ratio": 0.0},
}
BAR = 1.3
"""The default's KL may be at most this multiple of the best schedule's (issue 40)."""


def run_tree(name: str, args, budget: int, seed: int, root: Path) -> tuple[dict, list[dict]]:
    tokens = BUDGETS[name][budget]
    tree = model_tree(name, args, tokens, seed)
    for key in ("warmup_steps", "schedule", "min_lr_ratio", "lr"):  # the recipe defaults decide them
        tree["train"].pop(key, None)
    steps = tokens // tree["train"]["tokens_per_step"]
    if args.lr_factor != 1.0:  # the rule's rate scaled: is the best schedule the same at another rate?
        tree["train"]["lr"] = rule_lr(steps) * args.lr_factor
    tree["train"]["code_share_floor"] = 0.0  # the schedule alone: plain distillation (code_share.py measures floors)
    tree["data"]["eval_tokens"] = min(tree["data"]["eval_tokens"], EVAL_TOKENS)
    tree["eval"]["generation_prompts"] = 0
    tree["output_dir"] = str(root / f"{name}-b{budget}-s{seed}{_lr_tag(args.lr_factor)}")
    if name == "smollm2":
        tree["data"]["activation_cache"] = str(ensure_cache(args, tree, max(BUDGETS["smollm2"])))
    match = tree["layer"]["match_transcoder"]
    variants, settings = [], []
    for kind in args.kinds.split(","):
        for sname in args.schedules.split(","):
            s = SCHEDULES[sname]
            train = {} if not s else {"warmup_steps": int(round(s["warmup"] * steps)), "schedule": s["schedule"],
                                      "min_lr_ratio": s["min_lr_ratio"]}
            variants.append({"name": f"{kind}-{sname}", "layer": {"kind": kind, "k": 32, "match_transcoder": match},
                             **({"train": train} if train else {})})
            settings.append({"model": name, "budget": tokens, "kind": kind, "schedule": sname, "seed": seed,
                             "name": f"{kind}-{sname}", "lr_factor": args.lr_factor})
    tree["variants"] = variants
    return tree, settings


def _lr_tag(factor: float) -> str:
    return "" if factor == 1.0 else f"-lr{factor:g}"


def collect(metrics_of: dict, settings: list[dict]) -> list[dict]:
    """code_share.py's rows (KL, FVU, dead units, code share, lr) plus the warm-up and schedule each variant used."""
    rows = []
    for row in collect_rows(metrics_of, settings):
        train = metrics_of[row["name"]].get("train") or {}
        rows.append({**row, "warmup": train.get("warmup_steps"), "sched": train.get("schedule"),
                     "lr_factor": settings[0].get("lr_factor", 1.0)})
    return rows


def table(rows: list[dict]) -> str:
    """Mean KL (and code share) per schedule; the default's KL over the best schedule's, and whether the default is
    on the frontier of both axes: no schedule has a lower KL *and* a code that carries at least as much of the layer
    (issue 35: a lower KL bought by moving the work to MxD's dense path is another trade, not a better schedule)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["budget"], r.get("lr_factor", 1.0), r["kind"], r["schedule"]), []).append(r)
    lines = ["| model | tokens | lr | kind | " + " | ".join(SCHEDULES) + " | default / best | default on the frontier |",
             "|" + "---|" * (6 + len(SCHEDULES))]
    verdicts = []
    for model, budget, factor, kind in sorted({k[:4] for k in groups},
                                              key=lambda t: (MODELS.index(t[0]), t[1], t[2], t[3])):
        group = {s: groups[(model, budget, factor, kind, s)] for s in SCHEDULES
                 if (model, budget, factor, kind, s) in groups}
        present = list(group)
        means = {s: statistics.fmean(r["kl"] for r in group[s]) for s in present}
        shares = {s: round(statistics.fmean(r.get("share") or 0.0 for r in group[s]), 2) for s in present}
        cells = [f"{_cell([r['kl'] for r in group[s]], '.4f')} ({_cell([r.get('share') for r in group[s]], '.2f')})"
                 if s in means else "" for s in SCHEDULES]
        if "default" not in means:
            continue
        best = min(means, key=means.get)
        ratio = means["default"] / means[best]
        # Shares compared at the table's two decimals: a transcoder's 1.00 ties with every schedule.
        dominating = [s for s in present if means[s] < means["default"] and shares[s] >= shares["default"]]
        frontier = "yes" if not dominating else "no: " + ", ".join(dominating)
        rate = "rule" if factor == 1.0 else f"rule x{factor:g}"
        verdicts.append(f"{model} {budget:,} {rate} {kind}: default/best {ratio:.2f} (best: {best}) "
                        f"{'pass' if ratio <= BAR else 'FAIL'}; on the frontier: {frontier}")
        lines.append(f"| {model} | {budget:,} | {rate} | {kind} | " + " | ".join(cells) + f" | {ratio:.2f} ({best}) | {frontier} |")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {v}" for v in verdicts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.environ.get("EXPERTIZE_DATA"))
    p.add_argument("--models", default="tiny-gpt2-shakespeare,stories260k")
    p.add_argument("--budgets", default="1,2")
    p.add_argument("--kinds", default="mxd,transcoder")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--tokens-per-step", type=int, default=TRAIN["tokens_per_step"])
    p.add_argument("--runs-dir", default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--from-rows", default=None)
    p.add_argument("--lr-factor", type=float, default=1.0,
                   help="train at the lr rule's rate times this (every variant; 1 = lr auto)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.from_rows:
        rows, budget_line = load_rows(args.from_rows, lambda r: (r["model"], r["budget"], r.get("lr_factor", 1.0),
                                                                  r["kind"], r["schedule"], r["seed"]))
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="expertize-schedule-"))
        root.mkdir(parents=True, exist_ok=True)
        rows, started = [], time.perf_counter()
        for name in args.models.split(","):
            for budget in [int(b) for b in args.budgets.split(",") if int(b) < len(BUDGETS[name])]:
                for seed in [int(s) for s in args.seeds.split(",")]:
                    tree, settings = run_tree(name, args, budget, seed, root)
                    metrics_of, seconds = run_variants(tree, "benchmarks/schedule.py")
                    print(f"  {name} {BUDGETS[name][budget]:,} seed {seed}: {len(settings)} variants "
                          f"[{'reused' if seconds is None else f'{seconds:.0f}s'}]", flush=True)
                    rows += collect(metrics_of, settings)
        budget_line = (f"models {args.models}; budgets {args.budgets} ({', '.join(f'{m} {BUDGETS[m]}' for m in args.models.split(','))}); "
                       f"kinds {args.kinds} K=32; seeds {args.seeds}; "
                       f"lr {'auto' if args.lr_factor == 1.0 else f'rule x{args.lr_factor:g}'}; {len(rows)} variants; wall "
                       f"{(time.perf_counter() - started) / 60:.1f} min on CPU")
        (root / "rows.json").write_text(json.dumps({"rows": rows, "budget": budget_line}), encoding="utf-8")
    text = f"{table(rows)}\n\nbudget: {budget_line}\n"
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
