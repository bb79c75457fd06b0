"""Which kind for a real model? Every kind at equal parameters, three depths, budgets 4x apart (issue 48).

The toy models' verdicts (docs/results/code_share.md) rest on d_model 64-128 and <= 327k tokens; this benchmark asks
the same question of any local model folder: per depth, per budget, per kind, how faithful is the layer (KL, ΔCE,
FVU), how much of it does its code carry (code share), how sparse and how alive is it (L0, dead) — each paired with
the TopK transcoder trained on the same tokens in the same order.

Protocol:
- ONE activation cache (`expertize capture`'s format) of the largest budget at every target layer, captured once:
  only the blocks up to the deepest layer run; every run reads a prefix of its stream.
- Per (budget, seed, layer): ONE `expertize upcycle` of that layer whose `variants:` are the kinds below, trained
  together on one read of the cache (tests/test_variants.py: each gets the weights it would get alone). The seed
  changes the initialization and the stream's order; the held-out split is the same for every run.
- Kinds (KINDS) at the 8x TopK transcoder's parameter count (`match_transcoder: 8`), K = 32 (the JumpReLU's target
  L0 32): transcoder, skip_transcoder, jumprelu_transcoder, mxd (expertize's default, H = W/2), mxd-paper (H = W,
  the paper's), moe_x (the all-kinds benchmark's settings). lr auto, warm-up a tenth of the steps, cosine to 0.1.
  Opt-in: jumprelu_transcoder-resample (dead latents resampled, `train.resample_every_tokens: auto`; issue 47),
  jumprelu_transcoder-nopreact (without the pre-activation loss on dead latents, `train.preact_coef: 0`: the JumpReLU
  transcoder before issue 47's default), jumprelu_transcoder-thr0.1 / -thr0.3 / -thr0.5 (its thresholds at that
  multiple of the learning rate, `train.threshold_lr_scale`).
- The cache: any folder in --cache-dir that holds the run's layers (and more) and as many tokens (or more) is used.
- Columns: mean over seeds ± the 95 % Student-t half-width; "KL / transcoder" the per-seed ratio to the transcoder of
  the same run (paired), mean [95 % interval]. The trend: per (layer, kind), a least-squares line of log(KL ratio)
  against log4(budget) over every seed's point, its slope per 4x with a 95 % interval; where the slope's interval
  excludes 0 the budget at which the line would cross a ratio of 1 is given, marked as an extrapolation.
- Time: the capture's seconds (cache-dir/capture.json) and each run's training seconds (its train_log, all kinds
  together) and wall seconds.

Run (SmolLM2-135M-Instruct: benchmarks/data/get_smollm2.py DIR; five domains: benchmarks/data/domain_corpora.py DIR):
    python benchmarks/real_model.py --model SMOLLM2_DIR --corpus DOMAINS_DIR --layers 5,15,25 \
        --budgets 65536,262144,1048576 --seeds 0,1,2 --top-seeds 2 --cache-dir CACHE --runs-dir RUNS \
        --lock /tmp/expertize-cpu.lock
    python benchmarks/real_model.py --from-rows RUNS/rows.json --out table.md --plot docs/results/real_model.png
  Any local model folder and JSON-lines / text corpus works (`--corpus` a folder of *.jsonl or files, comma-separated).
  `--lock FILE` takes an exclusive lock on FILE for the capture and for each run only, so other jobs sharing the
  machine's cores run between runs and no timing is taken while another holds the cores. Finished runs are reused
  (the same recipe), so an interrupted benchmark resumes where it stopped.
"""

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from _runs import load_rows, run_variants
from code_share import _cell
from specialization_claims import seed_interval, t975

K = 32
MATCH_TRANSCODER = 8
KINDS = {
    # name -> the variant's layer section besides k / match_transcoder; "d_hidden": "W" = the MLP's own width
    "transcoder": {"kind": "transcoder"},
    "skip_transcoder": {"kind": "skip_transcoder"},
    "jumprelu_transcoder": {"kind": "jumprelu_transcoder"},
    "mxd": {"kind": "mxd"},
    "mxd-paper": {"kind": "mxd", "d_hidden": "W"},
    "moe_x": {"kind": "moe_x", "k": 2, "options": {"d_expert": 64}},
    # not in the default --kinds: a liveness setting of issue 47 ("train" overrides the run's train section)
    "jumprelu_transcoder-resample": {"kind": "jumprelu_transcoder", "train": {"resample_every_tokens": "auto"}},
    # ... and the JumpReLU transcoder as trained before issue 47's default (no pre-activation loss on dead latents)
    "jumprelu_transcoder-nopreact": {"kind": "jumprelu_transcoder", "train": {"preact_coef": 0.0}},
    # ... and with its thresholds at a fraction of the learning rate (train.threshold_lr_scale; issue 47)
    **{f"jumprelu_transcoder-thr{s:g}": {"kind": "jumprelu_transcoder", "train": {"threshold_lr_scale": s}}
       for s in (0.1, 0.3, 0.5)},
}
DEFAULT_KINDS = ("transcoder", "skip_transcoder", "jumprelu_transcoder", "mxd", "mxd-paper", "moe_x")
TRAIN = {"schedule": "cosine", "min_lr_ratio": 0.1, "tokens_per_step": 1024, "loss": "nmse", "precision": "fp32",
         "grad_clip": 1.0, "checkpoint_every": 0, "log_every": 20, "device": "cpu", "capture_batch_sequences": 16,
         "shuffle_buffer_tokens": 65_536}
EVAL = {"batch_sequences": 8, "generation_prompts": 0, "histogram": False}
CONTEXT, EVAL_TOKENS, EVAL_FRACTION = 128, 8_192, 0.05


def corpus_paths(spec: str) -> tuple[str, list[str]]:
    """(data.source, paths) of `--corpus`: a folder of *.jsonl files, or comma-separated files of one format."""
    path = Path(spec)
    files = sorted(str(p) for p in path.glob("*.jsonl")) if path.is_dir() else spec.split(",")
    if not files or not all(Path(f).is_file() for f in files):
        raise SystemExit(f"--corpus {spec}: no *.jsonl files in that folder, or a listed file does not exist")
    return ("jsonl" if all(f.endswith(".jsonl") for f in files) else "text"), files


def mlp_width(model: str) -> int:
    """The dense MLP's hidden width W, as expertize reads it for the model's family (`families.mlp_shape`)."""
    from expertize.conversion.surgery.families import mlp_shape
    from transformers import AutoConfig

    return mlp_shape(AutoConfig.from_pretrained(model)).d_hidden


def base_tree(args, layers: list[int], tokens: int, seed: int) -> dict:
    source, paths = corpus_paths(args.corpus)
    steps = max(1, tokens // args.tokens_per_step)
    return {
        "base_model": args.model, "dtype": "float32", "layers": layers,
        "layer": {"kind": "transcoder", "k": K, "match_transcoder": MATCH_TRANSCODER},
        "data": {"source": source, "paths": paths, "context_length": CONTEXT, "train_tokens": tokens,
                 "eval_tokens": args.eval_tokens, "eval_fraction": EVAL_FRACTION,
                 **({"document_separator": args.separator} if source == "text" else {})},
        "train": {**TRAIN, "seed": seed, "warmup_steps": max(1, steps // 10) if steps > 1 else 0,
                  "device": args.device,
                  "tokens_per_step": args.tokens_per_step, "precision": args.precision},
        "eval": EVAL,
    }


@contextlib.contextmanager
def cores(lock: str | None):
    """Hold `lock` (an exclusive flock) for the duration, when given."""
    if not lock:
        yield
        return
    with open(lock, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
            time.sleep(2)  # a job waiting on the lock gets it before this benchmark's next run takes it back


def find_cache(root: Path, model: str, layers: list[int], tokens: int) -> Path | None:
    """A cache in `root` of `model` at these layers (and perhaps more) of `tokens` tokens or more (a run reads a
    prefix of its stream), the first by name; None when none holds them."""
    for cached in sorted(root.glob(f"{model}-l*-*")):
        held, _, size = cached.name[len(model) + 2:].rpartition("-")
        if size.isdigit() and int(size) >= tokens and set(layers) <= {int(x) for x in held.split("-") if x.isdigit()}:
            return cached
    return None


def cache_digest(folder: Path) -> str:
    """12 hex digits naming a cache's content: the sha256 of its shards' own sha256 (cache.json). Two captures of one
    name can differ (a corpus domain built from another machine's files); the budget line and every row carry this,
    so that a table mixing them says so."""
    shards = json.loads((folder / "cache.json").read_text(encoding="utf-8"))["shards"]
    return hashlib.sha256("".join(shard["sha256"] for shard in shards).encode()).hexdigest()[:12]


def ensure_cache(args, layers: list[int], tokens: int) -> Path:
    """The activation cache of `tokens` training tokens at every layer in `layers` (captured once; the capture's
    seconds go to cache-dir/capture.json)."""
    from expertize.conversion.capture import capture_activations
    from expertize.conversion.recipe import recipe_from_dict

    root = Path(args.cache_dir)
    folder = root / f"{Path(args.model).name}-l{'-'.join(map(str, layers))}-{tokens}"
    cached = find_cache(root, Path(args.model).name, layers, tokens)
    if cached is not None:
        return cached
    tree = dict(base_tree(args, layers, tokens, 0), output_dir=str(root / "unused"))
    print(f"  capturing layers {layers} of {args.model}, {tokens:,} tokens, into {folder} ...", flush=True)
    with cores(args.lock):
        start = time.perf_counter()
        capture_activations(recipe_from_dict(tree, source="benchmarks/real_model.py"), folder)
        seconds = time.perf_counter() - start
    record = root / "capture.json"
    saved = json.loads(record.read_text(encoding="utf-8")) if record.exists() else {}
    saved[folder.name] = {"seconds": round(seconds, 1), "tokens": tokens, "layers": layers}
    record.write_text(json.dumps(saved, indent=1), encoding="utf-8")
    return folder


def run_tree(args, cache: Path | None, layer: int, tokens: int, seed: int) -> tuple[dict, list[dict]]:
    tree = base_tree(args, [layer], tokens, seed)
    if cache is not None:  # else each run captures its own stream live (--no-cache)
        tree["data"]["activation_cache"] = str(cache)
    tree["output_dir"] = str(Path(args.runs_dir) / f"l{layer}-b{tokens}-s{seed}")
    width, variants, settings = mlp_width(args.model), [], []
    for name in args.kinds.split(","):
        section = dict(KINDS[name])
        train = section.pop("train", None)
        layer_section = {"k": K, "match_transcoder": MATCH_TRANSCODER, **section}
        if layer_section.get("d_hidden") == "W":
            layer_section["d_hidden"] = width
        variants.append({"name": name, "layer": layer_section, **({"train": train} if train else {})})
        settings.append({"model": Path(args.model).name, "layer": layer, "budget": tokens, "seed": seed,
                         "variant": name, "kind": layer_section["kind"]})
    tree["variants"] = variants
    return tree, settings


def train_seconds(folder: Path) -> float | None:
    """The training loop's seconds from the run's train_log (its last record; None without one)."""
    from expertize.conversion.training.log import JsonlLog

    last = JsonlLog(folder / "train_log.jsonl").last()
    return None if last is None else last.get("seconds")


def collect(metrics_of: dict, settings: list[dict], root: Path, seconds: float | None,
            cache: str | None = None) -> list[dict]:
    """One row per variant; `cache` the activation cache's `cache_digest` (None: captured live)."""
    rows = []
    for s in settings:
        metrics = metrics_of[s["variant"]]
        (m,) = metrics["layers"].values()
        rows.append({**s, "units": m["num_units"], "dead": m["dead_fraction"], "fvu": m["fvu"], "l0": m["l0"],
                     "share": m.get("code_share"), "kl": metrics["ce"]["kl_base_spliced"],
                     "delta_ce": metrics["ce"]["delta"], "lr": metrics.get("train", {}).get("lr"),
                     "train_s": train_seconds(root / s["variant"]), "run_s": seconds, "cache": cache})
    return rows


# ---- tables ----------------------------------------------------------------------------------------------------

def groups_of(rows: list[dict]) -> dict[tuple, list[dict]]:
    """(model, layer, budget, variant) -> rows (one per seed), in KINDS order."""
    order = {name: i for i, name in enumerate(KINDS)}
    out: dict[tuple, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (r["model"], r["layer"], r["budget"], order.get(r["variant"], 99), r["seed"])):
        out.setdefault((r["model"], r["layer"], r["budget"], r["variant"]), []).append(r)
    return out


def per_seed_ratios(rows: list[dict], groups: dict, key: tuple, metric: str = "kl") -> list[tuple[int, float]]:
    """[(seed, this variant's metric / the transcoder's of the same run)]."""
    base = {r["seed"]: r[metric] for r in groups.get(key[:3] + ("transcoder",), [])}
    return [(r["seed"], r[metric] / base[r["seed"]]) for r in groups[key] if base.get(r["seed"])]


def _ratio_text(values: list[float]) -> str:
    if not values:
        return ""
    mean, low, high = seed_interval(values)
    return f"{mean:.2f}" if not math.isfinite(low) else f"{mean:.2f} [{low:.2f}, {high:.2f}]"


def table(rows: list[dict]) -> str:
    groups = groups_of(rows)
    lines = ["| model | layer | tokens | kind | units | seeds | KL | KL / transcoder | ΔCE | FVU | code share | L0 | "
             "dead % | train s (run) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, rs in groups.items():
        model, layer, budget, variant = key
        ratios = [v for _, v in per_seed_ratios(rows, groups, key)] if variant != "transcoder" else []
        lines.append(
            f"| {model} | {layer} | {budget:,} | {variant} | {rs[0]['units']:,} | {len(rs)} | "
            f"{_cell([r['kl'] for r in rs], '.4f')} | {_ratio_text(ratios)} | "
            f"{_cell([r['delta_ce'] for r in rs], '+.4f')} | "
            f"{_cell([r['fvu'] for r in rs], '.3f')} | {_cell([r['share'] for r in rs], '.2f')} | "
            f"{_cell([r['l0'] for r in rs], '.1f')} | {_cell([r['dead'] for r in rs], '.1f', 100)} | "
            f"{_cell([r['train_s'] for r in rs], '.0f')} |")
    return "\n".join(lines)


def across_depths(rows: list[dict]) -> str:
    """Per (model, budget, kind): the paired KL ratio to the transcoder over every (layer, seed) run that has one —
    the kind's standing on the model as a whole at that budget, its interval over those runs (depths and seeds
    taken as exchangeable: the per-layer table above says where they differ). Only budgets with two runs or more."""
    groups = groups_of(rows)
    pooled: dict[tuple, dict[str, list]] = {}
    for key in groups:
        model, layer, budget, variant = key
        if variant == "transcoder":
            continue
        ratios = per_seed_ratios(rows, groups, key)
        shares = {r["seed"]: r["share"] for r in groups[key]}
        entry = pooled.setdefault((model, budget, variant), {"ratios": [], "shares": [], "layers": set()})
        entry["ratios"] += [v for _, v in ratios]
        entry["shares"] += [shares[seed] for seed, _ in ratios if shares.get(seed) is not None]
        entry["layers"].add(layer)
    lines = ["| model | tokens | kind | runs (layers) | KL / transcoder [95 %] | code share (min–max) |",
             "|---|---:|---|---:|---:|---:|"]
    for (model, budget, variant), entry in pooled.items():
        if len(entry["ratios"]) < 2:
            continue
        mean, low, high = seed_interval(entry["ratios"])
        share = (f"{min(entry['shares']):.2f}–{max(entry['shares']):.2f}" if entry["shares"] else "")
        lines.append(f"| {model} | {budget:,} | {variant} | {len(entry['ratios'])} "
                     f"({', '.join(map(str, sorted(entry['layers'])))}) | {mean:.3f} [{low:.3f}, {high:.3f}] | "
                     f"{share} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def trend(rows: list[dict]) -> str:
    """Per (model, layer, kind): log(KL ratio) against log4(budget), least squares over every seed's point."""
    groups = groups_of(rows)
    points: dict[tuple, list[tuple[float, float]]] = {}
    for key in groups:
        if key[3] == "transcoder":
            continue
        for _, ratio in per_seed_ratios(rows, groups, key):
            points.setdefault((key[0], key[1], key[3]), []).append((math.log(key[2], 4), math.log(ratio)))
    lines = ["| model | layer | kind | budgets | points | KL ratio change per 4x tokens [95 %] | "
             "crosses 1 at (extrapolated) |",
             "|---|---:|---|---:|---:|---:|---|"]
    for (model, layer, variant), pts in points.items():
        budgets = len({x for x, _ in pts})
        if budgets < 2 or len(pts) < 3:
            continue
        slope, intercept, half = _fit(pts)
        change = f"{math.exp(slope):.3f}x [{math.exp(slope - half):.3f}, {math.exp(slope + half):.3f}]"
        crossing = "slope's interval holds 0: no trend to extrapolate"
        if slope - half > 0 or slope + half < 0:
            at = 4 ** (-intercept / slope)
            mean_now = statistics.fmean(math.exp(y) for x, y in pts if x == max(x for x, _ in pts))
            if (mean_now > 1) == (slope < 0):
                crossing = f"~{at:,.0f} tokens (the line's point estimate)"
            else:
                crossing = "moving away from 1"
        lines.append(f"| {model} | {layer} | {variant} | {budgets} | {len(pts)} | {change} | {crossing} |")
    return "\n".join(lines)


def _fit(pts: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(slope, intercept, the slope's 95 % half-width) of the least-squares line."""
    n = len(pts)
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    intercept = my - slope * mx
    residual = sum((y - intercept - slope * x) ** 2 for x, y in pts) / max(n - 2, 1)
    return slope, intercept, t975(n - 2) * math.sqrt(residual / sxx)  # n >= 3: trend() fits no fewer points


def plot(rows: list[dict], path: Path) -> None:
    """One panel per (model, layer): each kind's KL / transcoder against budget (log axes), seeds' mean and range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    groups = groups_of(rows)
    panels = sorted({key[:2] for key in groups})
    budgets = sorted({key[2] for key in groups})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for i, variant in enumerate(v for v in KINDS if v != "transcoder"):
            xs, means, lows, highs = [], [], [], []
            for key in sorted(k for k in groups if k[:2] == panel and k[3] == variant):
                ratios = [v for _, v in per_seed_ratios(rows, groups, key)]
                if ratios:
                    xs.append(key[2])
                    means.append(statistics.fmean(ratios))
                    lows.append(min(ratios))
                    highs.append(max(ratios))
            if xs:
                ax.plot(xs, means, marker="o", color=f"C{i}", label=variant)
                ax.fill_between(xs, lows, highs, color=f"C{i}", alpha=0.15)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(min(budgets) / 1.5, max(budgets) * 1.5)  # every panel on the same budget axis
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2f"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.2f"))
        ax.set_xlabel("training tokens")
        ax.set_ylabel("KL / TopK transcoder's (same tokens)")
        ax.set_title(f"{panel[0]}, layer {panel[1]}", fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


# ---- driver ----------------------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.environ.get("SMOLLM2"), help="a local model folder (default $SMOLLM2)")
    p.add_argument("--corpus", default=os.environ.get("DOMAINS"),
                   help="a folder of *.jsonl files or comma-separated files (default $DOMAINS)")
    p.add_argument("--separator", default="line", help="a text corpus's document separator (line, blank_line)")
    p.add_argument("--layers", default="5,15,25")
    p.add_argument("--budgets", default="65536,262144,1048576", help="training tokens per layer, ascending")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS, help="held-out tokens per evaluation")
    p.add_argument("--top-seeds", type=int, default=2, help="seeds at the largest budget (the first of --seeds)")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"any of {', '.join(KINDS)}")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--runs-dir", default=None)
    p.add_argument("--no-cache", action="store_true",
                   help="capture each run's stream live (a GPU's budgets: a cache of 100M tokens does not fit)")
    p.add_argument("--device", default="cpu", help="train.device (cuda on a GPU)")
    p.add_argument("--tokens-per-step", type=int, default=1024)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="train.precision")
    p.add_argument("--keep-weights", action="store_true",
                   help="keep each run's model.safetensors (by default removed once its metrics are read)")
    p.add_argument("--lock", default=None, help="an exclusive flock held during the capture and each run only")
    p.add_argument("--from-rows", default=None, help="re-tabulate rows.json files (comma-separated); trains nothing")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    return p.parse_args()


def check_args(args) -> str | None:
    """What is wrong with the arguments of a training run (before any work), or None."""
    if not args.model or not (Path(args.model) / "config.json").is_file():
        return f"--model {args.model!r}: not a local model folder (no config.json); give one, or set SMOLLM2"
    if not args.corpus:
        return "--corpus: give a folder of *.jsonl files or a list of files (or set DOMAINS)"
    if not ((args.cache_dir or args.no_cache) and args.runs_dir):
        return ("give --cache-dir (the activation cache, captured once; or --no-cache) and --runs-dir (one folder per "
                "run)")
    unknown = [k for k in args.kinds.split(",") if k not in KINDS]
    if unknown:
        return f"--kinds: unknown {unknown}; choose from {list(KINDS)}"
    if "transcoder" not in args.kinds.split(","):
        return "--kinds must include transcoder: every ratio is paired with it"
    return None


def main() -> int:
    args = parse_args()
    if args.from_rows:
        rows, budget_line = load_rows(args.from_rows, lambda r: (r["model"], r["layer"], r["budget"],
                                                                  r["variant"], r["seed"]))
    else:
        problem = check_args(args)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        corpus_paths(args.corpus)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        layers = [int(x) for x in args.layers.split(",")]
        budgets = sorted(int(b) for b in args.budgets.split(","))
        seeds = [int(s) for s in args.seeds.split(",")]
        root = Path(args.runs_dir)
        root.mkdir(parents=True, exist_ok=True)
        if not args.no_cache:
            Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
        cache = None if args.no_cache else ensure_cache(args, layers, budgets[-1])
        digest = None if cache is None else cache_digest(cache)
        rows, started = [], time.perf_counter()
        # seed-major: every budget and depth at the first seed before the next seed, so that an interrupted run
        # (it resumes) already shows the trend, and the later seeds add the intervals
        order = [(seed, budget) for seed in seeds for budget in budgets
                 if budget != budgets[-1] or seed in seeds[: args.top_seeds]]
        for seed, budget in order:
            for layer in layers:
                tree, settings = run_tree(args, cache, layer, budget, seed)
                with cores(args.lock):
                    metrics_of, seconds = run_variants(tree, "benchmarks/real_model.py")
                print(f"  layer {layer}, {budget:,} tokens, seed {seed}: {len(settings)} kinds "
                      f"[{'reused' if seconds is None else f'{seconds:.0f}s'}]", flush=True)
                rows += collect(metrics_of, settings, Path(tree["output_dir"]), seconds, digest)
                if not args.keep_weights:  # 0.5 GB per SmolLM2 folder; the rows need only metrics.json
                    for folder in Path(tree["output_dir"]).iterdir():
                        if folder.is_dir():
                            (folder / "model.safetensors").unlink(missing_ok=True)
                (root / "rows.partial.json").write_text(json.dumps(rows), encoding="utf-8")
        capture_line = "capture live in every run (no cache)"
        if cache is not None:
            captured = json.loads((Path(args.cache_dir) / "capture.json").read_text(encoding="utf-8"))[cache.name]
            # the cache's own extent (its name: layers and tokens), which may exceed this run's layers and budgets
            capture_line = f"capture {captured['seconds']} s, once, into {cache.name} (content {digest})"
        budget_line = (f"model {args.model}; layers {layers}; budgets {budgets}; seeds {seeds} "
                       f"({args.top_seeds} at {budgets[-1]:,}); kinds {args.kinds}; K {K}; "
                       f"{MATCH_TRANSCODER}x transcoder parameters; {args.eval_tokens:,} held-out tokens; "
                       f"{len(rows)} trained layers; {capture_line}; "
                       f"wall time {(time.perf_counter() - started) / 60:.1f} min on CPU")
        (root / "rows.json").write_text(json.dumps({"rows": rows, "budget": budget_line}), encoding="utf-8")
    depths = across_depths(rows)
    text = f"{table(rows)}\n\n{depths + chr(10) * 2 if depths else ''}{trend(rows)}\n\nbudget: {budget_line}\n"
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
