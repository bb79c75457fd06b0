"""Dead-unit handling on several real models, budgets and learning rates, with seeds and intervals (issue 28).

Each (model, budget, seed) is ONE `expertize upcycle` whose `variants:` are every (kind, K, lr, method) setting, trained
together on one activation stream (tests/test_variants.py: each variant gets the weights it would get alone), so the
methods of a row see the same tokens in the same order from the same initialization; the seed (`train.seed`) changes
the initialization and the stream's order, the held-out split stays the same.

Models (real trained networks only; `--models`):
    quickstart             the shipped quickstart recipe (tiny-gpt2-shakespeare layer 2, MxD parameter-matched to a 32x
                           transcoder: N = 3,584) at its own budget (200,000 tokens) and context; the transcoder at 32x
    tiny-gpt2-shakespeare  layer 2 of 4 (d 128, gelu_new MLP 512), on Tiny Shakespeare; 8x transcoder budget
    stories260k            layer 2 of 5 (d 64, SwiGLU 172), on text sampled from the model; 8x transcoder budget
    smollm2                SmolLM2-135M-Instruct layer 15 of 30 (d 576, SwiGLU 1,536), on five domains of real text
                           ($SMOLLM2, $DOMAINS: ../shared/tools/get_smollm2.py, domain_corpora.py), trained from one
                           activation cache (--cache-dir; captured once, ~10 min); 8x transcoder budget
Budgets: `--budgets small,large`, 4x apart (BUDGETS: quickstart 50,000 / 200,000 tokens (its shipped budget), tiny
models 81,920 / 327,680, SmolLM2 131,072 / 262,144); 1,024 tokens per step, warm-up a tenth of the steps (the
quickstart: its own 50 of 195, scaled), cosine to 0.1 lr, NMSE, fp32.
Learning rates: `--lrs rule,rule/3`: the default rule's rate (`train.lr: auto`, conversion/recipe/lr_rule.py) and a
3x lower one, or numbers.

Methods (recipe `train:` keys; every method sets every key, so that none inherits a default by accident):
    none    plain top-K (balance: none)
    floor   the selection-bias floor held to the end (balance: floor, balance_anneal: null): the default before issue 28
    anneal  the floor during the first half of the run, its bias then decays linearly to 0 at 80 % and the last 20 %
            train plain top-K (balance: floor, balance_anneal: [0.5, 0.8]): the default since issue 28
    bias    DeepSeek-V3's symmetric rule held to the end; resample: Anthropic's resampling (auto); auxk: AuxK 1/32
    preactC the pre-activation loss on dead latents at weight C (0.001 to 1; train.preact_coef, the threshold kinds'
            default since issue 47); every other method sets preact_coef 0
    preact0.001-wN  the same loss at 0.001 with dead meaning N tokens silent (4096, 8192) instead of the auto window
            (1/40 of the run: 8,192 tokens at the 327,680-token budget, where w8192 is the auto window itself)

Columns, each the mean over seeds with its 95 % Student-t half-width (n - 1 degrees of freedom): dead = share of units
that never fired on the held-out tokens; effective units = exp(entropy of the firings); L0 (and L0 / K); FVU; KL =
KL(base ‖ spliced) per token in nats; ΔCE = CE(spliced) - CE(base). "vs none" = the per-seed ratio of a method's FVU /
KL to none's in the same run (paired), mean and interval over seeds. A row of a method passes when dead ≤ 5 % (K ≥ 16)
or ≤ 10 % (K = 8) and neither its FVU nor its KL ratio interval lies wholly above 1 (no worse than none beyond the
seeds' noise).

Run (all four models, ~4 h on 2 CPU cores; rows.json in --runs-dir re-tabulates with --from-rows):
    export EXPERTIZE_DATA=/path/to/shared/data SMOLLM2=/data/smollm2 DOMAINS=/data/domains
    python benchmarks/dead_units.py --runs-dir RUNS --cache-dir CACHE --out table.md
    python benchmarks/dead_units.py --models quickstart --budgets 1 --methods none,anneal --seeds 0   (~2 min)
    python benchmarks/dead_units.py --from-rows RUNS/rows.json --out table.md
"""

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _runs import load_rows, run_variants, text_data
from specialization_claims import format_value, seed_interval

METHODS = {
    "none": {"auxk_coef": 0.0, "balance": "none", "balance_anneal": None, "resample_every_tokens": 0},
    "floor": {"auxk_coef": 0.0, "balance": "floor", "balance_anneal": None, "resample_every_tokens": 0},
    "anneal": {"auxk_coef": 0.0, "balance": "floor", "balance_anneal": [0.5, 0.8], "resample_every_tokens": 0},
    "bias": {"auxk_coef": 0.0, "balance": "bias", "balance_anneal": None, "resample_every_tokens": 0},
    "resample": {"auxk_coef": 0.0, "balance": "none", "balance_anneal": None, "resample_every_tokens": "auto"},
    "auxk": {"auxk_coef": 1 / 32, "balance": "none", "balance_anneal": None, "resample_every_tokens": 0,
             "dead_window_tokens": "auto"},
}
for _method in METHODS.values():
    _method["preact_coef"] = 0.0
for _coef in (0.001, 0.003, 0.01, 0.1, 1.0):  # the pre-activation loss on dead latents (threshold kinds)
    METHODS[f"preact{_coef:g}"] = {**METHODS["none"], "preact_coef": _coef, "dead_window_tokens": "auto"}
for _window in (4096, 8192):  # the same loss with a fixed dead window (auto: 1/40 of the run, 8,192 tokens at 327,680)
    METHODS[f"preact0.001-w{_window}"] = {**METHODS["none"], "preact_coef": 0.001, "dead_window_tokens": _window}
TRAIN = {"warmup_steps": 50, "schedule": "cosine", "min_lr_ratio": 0.1, "tokens_per_step": 1024, "loss": "nmse",
         "precision": "fp32", "grad_clip": 1.0, "checkpoint_every": 0, "log_every": 20, "device": "cpu"}
EVAL = {"batch_sequences": 16, "generation_prompts": 0, "histogram": False}


BUDGETS = {
    # training tokens (small, large) per model: 4x apart; Tiny Shakespeare's train split holds 343,808 tokens
    "quickstart": (50_000, 200_000),
    "tiny-gpt2-shakespeare": (81_920, 327_680),
    "stories260k": (81_920, 327_680),
    "smollm2": (131_072, 262_144),  # 64 steps left 65-98 % of its units dead whatever the method: no reading
}


def model_tree(name: str, args, tokens: int, seed: int) -> dict:
    """The recipe of one (model, training tokens, seed) run, without its variants (benchmarks/code_share.py too)."""
    data = Path(args.data) if args.data else None
    per_step = args.tokens_per_step
    train = {**TRAIN, "seed": seed, "tokens_per_step": per_step, "warmup_steps": max(1, tokens // per_step // 10)}
    if name == "quickstart":
        from expertize.conversion.recipe import load_recipe, recipe_to_dict

        tree = recipe_to_dict(load_recipe("quickstart"))  # the shipped recipe, its ${EXPERTIZE_ASSETS} resolved
        tree["data"]["train_tokens"] = tokens
        # its own warm-up is "auto" (a tenth of the steps, as `train` sets it for every model)
        tree["train"].update(train)
        tree["eval"].update(EVAL)
        tree["layer"].update({"match_transcoder": 32})
        return tree
    if name == "smollm2":
        domains = Path(os.environ["DOMAINS"])
        paths = [str(domains / f"{d}.jsonl") for d in ("code", "docs", "wiki", "literature", "stories")]
        return {
            "base_model": os.environ["SMOLLM2"], "dtype": "float32", "layers": [15],
            "layer": {"kind": "mxd", "k": 32, "match_transcoder": 8},
            "data": {"source": "jsonl", "paths": paths, "context_length": 128, "train_tokens": tokens,
                     "eval_tokens": 8_192, "eval_fraction": 0.05},
            "train": {**train, "shuffle_buffer_tokens": max(65_536, per_step), "capture_batch_sequences": 16},
            "eval": {**EVAL, "batch_sequences": 8},
        }
    folder, corpus, separator, layer = {
        "tiny-gpt2-shakespeare": ("models/tiny-gpt2-shakespeare", "corpora/tinyshakespeare.txt", "blank_line", 2),
        "stories260k": ("models/stories260k", "corpora/stories260k_samples.txt", "line", 2),
    }[name]
    return {
        "base_model": str(data / folder), "dtype": "float32", "layers": [layer],
        "layer": {"kind": "mxd", "k": 32, "match_transcoder": 8},
        "data": text_data(data / corpus, separator, 128, tokens, 32_768, 0),
        "train": train, "eval": EVAL,
    }


MODELS = ("quickstart", "tiny-gpt2-shakespeare", "stories260k", "smollm2")


def resolve_lr(spec: str, tree: dict, kind: str) -> float:
    """`rule`, `rule/3` or a number -> the learning rate of `kind` on the run `tree`."""
    if spec.startswith("rule"):
        from expertize.conversion.recipe.lr_rule import rule_lr
        from expertize.modeling import LAYER_KINDS

        divisor = float(spec.split("/", 1)[1]) if "/" in spec else 1.0
        steps = tree["data"]["train_tokens"] // tree["train"]["tokens_per_step"]
        factor = LAYER_KINDS[kind][0].auto_lr_factor
        return rule_lr(steps, factor) / divisor
    return float(spec)


def run_tree(name: str, args, budget: int, seed: int, root: Path) -> tuple[dict, list[dict]]:
    tree = model_tree(name, args, BUDGETS[name][("small", "large").index(budget)], seed)
    suffix = "" if args.tokens_per_step == TRAIN["tokens_per_step"] else f"-t{args.tokens_per_step}"
    tree["output_dir"] = str(root / f"{name}-{budget}{suffix}-s{seed}")
    if name == "smollm2":
        tree["data"]["activation_cache"] = str(ensure_cache(args, tree))
    ks = [int(k) for k in args.ks.split(",")] if args.ks else {"quickstart": (8, 16, 32)}.get(name, (8, 32))
    match = tree["layer"]["match_transcoder"]
    variants, settings = [], []
    for kind in args.kinds.split(","):
        for k in ks if name == "quickstart" and kind == "mxd" else tuple(k for k in ks if k != 16):
            for lr_spec in args.lrs.split(","):
                lr = resolve_lr(lr_spec, tree, kind)
                for method in args.methods.split(","):
                    vname = f"{kind}-k{k}-lr{lr:.3g}-{method}"
                    variants.append({"name": vname, "layer": {"kind": kind, "k": k, "match_transcoder": match},
                                     "train": {"lr": lr, **METHODS[method]}})
                    settings.append({"model": name, "budget": tree["data"]["train_tokens"],
                                     "tokens_per_step": tree["train"]["tokens_per_step"], "kind": kind, "k": k,
                                     "lr": lr, "lr_spec": lr_spec, "method": method, "seed": seed, "name": vname})
    tree["variants"] = variants
    return tree, settings


def ensure_cache(args, tree: dict, tokens: int = BUDGETS["smollm2"][1]) -> Path:
    """SmolLM2's activation cache of `tokens` training tokens, the largest budget asked for (every run reads a prefix
    of its stream)."""
    from expertize.conversion.capture import capture_activations
    from expertize.conversion.recipe import recipe_from_dict

    if not args.cache_dir:
        raise SystemExit("smollm2 needs --cache-dir (its activations are captured once and shared by every run)")
    folder = Path(args.cache_dir) / ("smollm2-l15" if tokens == BUDGETS["smollm2"][1] else f"smollm2-l15-{tokens}")
    if not folder.exists():
        biggest = dict(tree, data={**tree["data"], "train_tokens": tokens})
        biggest["output_dir"] = str(Path(args.cache_dir) / "unused")
        print(f"  capturing SmolLM2 layer 15 into {folder} ...", flush=True)
        capture_activations(recipe_from_dict(biggest, source="benchmarks/dead_units.py"), folder)
    return folder


def collect(metrics_of: dict, settings: list[dict]) -> list[dict]:
    rows = []
    for s in settings:
        metrics = metrics_of[s["name"]]
        (m,) = metrics["layers"].values()
        rows.append({**s, "units": m["num_units"], "dead": m["dead_fraction"], "fvu": m["fvu"], "l0": m["l0"],
                     "effective": m.get("effective_units"), "kl": metrics["ce"]["kl_base_spliced"],
                     "delta_ce": metrics["ce"]["delta"], "health": m.get("health", [])})
    return rows


def _cell(values: list[float], fmt: str, scale: float = 1.0) -> str:
    mean, low, high = seed_interval([v * scale for v in values])
    if len(values) < 2 or not math.isfinite(low):
        return format_value(mean, fmt)
    return f"{format_value(mean, fmt)} ± {format_value((high - low) / 2, fmt)}"


def dead_bound(k: int) -> float:
    return 0.10 if k <= 8 else 0.05


def row_verdict(dead: float, k: int, fvu_ratio: tuple | None, kl_ratio: tuple | None) -> str:
    """pass / FAIL: dead under its bound and neither ratio's interval wholly above 1 (none's row: dead only)."""
    problems = []
    if dead > dead_bound(k):
        problems.append("dead")
    for label, ratio in (("FVU", fvu_ratio), ("KL", kl_ratio)):
        if ratio is not None and ratio[1] > 1.0:
            problems.append(label)
    return "pass" if not problems else "FAIL (" + ", ".join(problems) + ")"


KEY = ("model", "budget", "tokens_per_step", "kind", "k", "lr", "method")
"""A row of the table: the rows of every seed that share these."""


def _key(r: dict) -> tuple:
    return tuple(r.get(f, 1024) if f == "tokens_per_step" else r[f] for f in KEY)


def table(rows: list[dict]) -> tuple[str, list[dict]]:
    """The Markdown table (one line per KEY) and every line's verdict."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_key(r), []).append(r)
    none = {key[:-1]: {r["seed"]: r for r in rs} for key, rs in groups.items() if key[-1] == "none"}
    lines = ["| model | tokens (steps) | kind | K | lr | method | seeds | dead % | effective units | L0 (/K) | FVU | KL "
             "| ΔCE | FVU vs none | KL vs none | verdict |", "|" + "---|" * 16]
    verdicts = []
    for key in sorted(groups, key=lambda k: (MODELS.index(k[0]), k[1], k[2], k[3], k[4], -k[5], k[6])):
        rs = sorted(groups[key], key=lambda r: r["seed"])
        model, budget, per_step, kind, k, lr, method = key
        dead = statistics.fmean(r["dead"] for r in rs)
        ratios = {"fvu": None, "kl": None}
        base = none.get(key[:-1])
        if base is not None and method != "none":
            for metric in ratios:
                per_seed = [r[metric] / base[r["seed"]][metric] for r in rs if r["seed"] in base]
                ratios[metric] = seed_interval(per_seed) if per_seed else None
        verdict = row_verdict(dead, k, ratios["fvu"], ratios["kl"])
        verdicts.append({"key": dict(zip(KEY, key)), "verdict": verdict})
        ratio_cells = [
            "" if ratios[m] is None else (
                format_value(ratios[m][0], ".3f") if not math.isfinite(ratios[m][1])
                else f"{ratios[m][0]:.3f} [{ratios[m][1]:.3f}, {ratios[m][2]:.3f}]")
            for m in ("fvu", "kl")
        ]
        l0 = statistics.fmean(r["l0"] for r in rs)
        lines.append(
            f"| {model} | {budget:,} ({budget // per_step}) | {kind} | {k} | {lr:.3g} | {method} | {len(rs)} | "
            f"{_cell([r['dead'] for r in rs], '.1f', 100)} | {_cell([r['effective'] for r in rs], '.0f')} | "
            f"{l0:.1f} ({l0 / k:.2f}) | {_cell([r['fvu'] for r in rs], '.4f')} | {_cell([r['kl'] for r in rs], '.4f')} | "
            f"{_cell([r['delta_ce'] for r in rs], '+.4f')} | {ratio_cells[0]} | {ratio_cells[1]} | {verdict} |"
        )
    return "\n".join(lines), verdicts


def summary(verdicts: list[dict]) -> str:
    """Per method: rows passed, and the rows it fails, named."""
    by_method: dict[str, list[dict]] = {}
    for v in verdicts:
        by_method.setdefault(v["key"]["method"], []).append(v)
    out = []
    for method, vs in by_method.items():
        failed = [v for v in vs if v["verdict"] != "pass"]
        named = "; ".join(
            f"{v['key']['model']} {v['key']['budget']:,} {v['key']['kind']} K={v['key']['k']} lr {v['key']['lr']:.3g} "
            f"({v['verdict'][6:-1]})" for v in failed)
        out.append(f"- **{method}**: {len(vs) - len(failed)} of {len(vs)} rows pass" + (f"; fails: {named}" if named else ""))
    return "\n".join(out)


def best_lrs(rows: list[dict]) -> str:
    """With several learning rates: per (model, tokens, steps, kind, K, method), the lr of the lowest mean KL among
    the lrs whose code did not collapse (mean L0 ≥ K / 2) — the evidence behind `train.lr: auto`."""
    groups: dict[tuple, dict[float, list[dict]]] = {}
    for r in rows:
        key = _key(r)
        groups.setdefault(key[:5] + key[6:], {}).setdefault(key[5], []).append(r)
    out = []
    for key in sorted(groups, key=lambda k: (MODELS.index(k[0]), k[1:])):
        by_lr = groups[key]
        if len(by_lr) < 2:
            continue
        stats = {lr: (statistics.fmean(r["kl"] for r in rs), statistics.fmean(r["l0"] for r in rs))
                 for lr, rs in by_lr.items()}
        healthy = {lr: kl for lr, (kl, l0) in stats.items() if l0 >= key[4] / 2} or {lr: kl for lr, (kl, _) in stats.items()}
        best = min(healthy, key=healthy.get)
        cells = ", ".join(f"{lr:.3g}: {kl:.4f}{'' if lr in healthy else ' (collapsed)'}"
                          for lr, (kl, _) in sorted(stats.items()))
        model, budget, per_step, kind, k, method = key
        out.append(f"| {model} | {budget:,} ({budget // per_step}) | {kind} | {k} | {method} | {best:.3g} | {cells} |")
    if not out:
        return ""
    return "\n".join(["| model | tokens (steps) | kind | K | method | best lr | KL by lr |", "|" + "---|" * 7, *out])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("EXPERTIZE_DATA"),
                   help="shared data folder holding models/ and corpora/ (default: $EXPERTIZE_DATA)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--budgets", default="small,large", help="small, large or both (BUDGETS: tokens per model)")
    p.add_argument("--lrs", default="rule,rule/3", help="learning rates: rule, rule/N or numbers")
    p.add_argument("--kinds", default="mxd,transcoder")
    p.add_argument("--ks", default=None, help="top-K values (default: 8,32; the quickstart's MxD also 16)")
    p.add_argument("--methods", default="none,anneal,floor", help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--tokens-per-step", type=int, default=TRAIN["tokens_per_step"],
                   help="tokens per optimizer step (the learning-rate rule's evidence varies it)")
    p.add_argument("--runs-dir", default=None, help="keep the runs here (finished identical runs are reused)")
    p.add_argument("--cache-dir", default=None, help="SmolLM2's activation cache folder (captured once)")
    p.add_argument("--from-rows", default=None,
                   help="re-tabulate finished runs' rows.json (comma-separated: merged); trains nothing")
    p.add_argument("--out", default=None, help="also write the Markdown table to this file")
    args = p.parse_args()
    args.budget_list = [b for b in args.budgets.split(",") if b]
    return args


def main() -> int:
    args = parse_args()
    if args.from_rows:
        rows, budget = load_rows(args.from_rows, lambda r: (*_key(r), r["seed"]))
    else:
        bad = ([m for m in args.methods.split(",") if m not in METHODS]
               + [m for m in args.models.split(",") if m not in MODELS]
               + [b for b in args.budget_list if b not in ("small", "large")])
        if bad:
            print(f"error: unknown method / model {bad}", file=sys.stderr)
            return 2
        models = args.models.split(",")
        if any(m in ("tiny-gpt2-shakespeare", "stories260k") for m in models) and not (
                args.data and (Path(args.data) / "models").is_dir()):
            print("error: give --data or set EXPERTIZE_DATA to the shared data folder", file=sys.stderr)
            return 2
        if "smollm2" in models and not (os.environ.get("SMOLLM2") and os.environ.get("DOMAINS")):
            print("error: smollm2 needs SMOLLM2 and DOMAINS (../shared/tools/get_smollm2.py, domain_corpora.py)",
                  file=sys.stderr)
            return 2
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="expertize-dead-units-"))
        seeds = [int(s) for s in args.seeds.split(",") if s]
        rows, started = [], time.perf_counter()
        try:
            for name in models:
                for budget in args.budget_list:
                    for seed in seeds:
                        tree, settings = run_tree(name, args, budget, seed, root)
                        metrics_of, seconds = run_variants(tree, "benchmarks/dead_units.py")
                        print(f"  {name} {budget} seed {seed}: {len(settings)} variants "
                              f"[{'reused' if seconds is None else f'{seconds:.0f}s'}]", flush=True)
                        rows += collect(metrics_of, settings)
                        if args.runs_dir:
                            (root / "rows.partial.json").write_text(json.dumps(rows), encoding="utf-8")
        finally:
            if not args.runs_dir:
                shutil.rmtree(root, ignore_errors=True)
        budget = (f"models {', '.join(models)}; budgets {args.budgets} (tokens: {BUDGETS}); lrs {args.lrs}; "
                  f"kinds {args.kinds}; methods {args.methods}; seeds {args.seeds}; {len(rows)} trained variants; "
                  f"wall time {(time.perf_counter() - started) / 60:.1f} min on CPU")
        if args.runs_dir:
            (root / "rows.json").write_text(json.dumps({"rows": rows, "budget": budget}), encoding="utf-8")
    text, verdicts = table(rows)
    lrs = best_lrs(rows)
    text = f"{text}\n\n{summary(verdicts)}\n\n{lrs + chr(10) + chr(10) if lrs else ''}budget: {budget}\n"
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
