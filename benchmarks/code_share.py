"""Fidelity against code share: is a layer faithful because of its sparse code, or in spite of it (issue 35)?

Code share (evaluation/code_probe.py) = (FVU with every token given the average code − FVU) / (1 − FVU): the share
of what the layer explains that its per-token code carries. 1 for a transcoder (its average code is a constant); near
0 when a dense path (MxD's hidden code Dᵀz, a skip connection) does the work. A low KL means little when the code
carries nothing, so every row reads KL beside the code share.

Each (model, budget, seed) is ONE `expertize upcycle` whose `variants:` are every setting below, trained together on
one activation stream (the same tokens in the same order; tests/test_variants.py: each variant gets the weights it
would get alone); the seed changes the initialization and the stream's order, the held-out split stays the same.
Every variant uses the recipe defaults (lr auto, the annealed floor) and the dead-units benchmark's schedule (warm-up a
tenth of the steps, cosine to 0.1 lr), all at the parameter count of the 8x TopK transcoder (the quickstart: 32x, as
shipped).

Variants at K = 32 and K = 8 (VARIANTS; `--variants` picks a subset):
    transcoder       TopK transcoder (no dense path: share 1 by construction)
    skip_transcoder  TopK transcoder with a linear skip connection
    mxd              MxD as the paper: d_hidden = the MLP's width (H = W; expertize's default until issue 35)
    mxd-h2, -h4, -h16  MxD with d_hidden = W/2 (the default now: DEFAULT_MXD), W/4, W/16 (more experts at the same
                     parameters)
    mxd-randk        H = W with random K (paper App. C.2)
    mxd-unorm        H = W with unit-norm experts (reference code's norm_dec)
    mxd-h4-randk     H = W/4 with random K
    mxd-floor.5, .7  H = W trained with train.code_share_floor 0.5 / 0.7 (training/code_floor.py: a batch term that
                     keeps the output with the average code from explaining more than 1 − floor of the variance)
    mxd-h2-floor.5   H = W/2 with the floor 0.5; skip_transcoder-floor.5: the skip transcoder with it
and `--other-kinds` (K = 32 budget only, the all-kinds benchmark's settings): moe_x, mumoe_cp, monet_hd,
routed_neurons, for their code share.

Models (`--models`): quickstart (tiny-gpt2-shakespeare layer 2, its shipped recipe, N matched to a 32x transcoder),
tiny-gpt2-shakespeare layer 2, stories260k layer 2 (8x budget), smollm2 (layer 15, $SMOLLM2 / $DOMAINS, one activation
cache under --cache-dir). Budgets (`--budgets`): BUDGETS, 4x apart.

Columns: mean over seeds ± the 95 % Student-t half-width; "KL / transcoder" is the per-seed ratio to the TopK
transcoder at the same K in the same run (paired), mean [interval]. The frontier: per (model, budget, K), the variant
with code share ≥ SHARE_TARGET and the lowest KL. The default (third table, `default_choice`): per K, the MxD
variant whose mean code share reaches SHARE_TARGET in every (model, budget) measured, with the lowest geometric mean
over those cells of its paired KL / transcoder.

Run:
    export EXPERTIZE_DATA=/path/to/shared/data
    python benchmarks/code_share.py --runs-dir RUNS --out table.md
        (the default: the quickstart, tiny-gpt2-shakespeare and stories260k, DEFAULT_VARIANTS at K = 32 and 8, three
        budgets, three seeds; 35-45 min on 2 CPU cores, estimated from the measured runs' times)
    SMOLLM2=DIR DOMAINS=DIR python benchmarks/code_share.py --models smollm2 --ks 32 --cache-dir CACHE \
        --variants transcoder,skip_transcoder,mxd,mxd-h2,mxd-h4 --runs-dir RUNS           (~47 min)
    python benchmarks/code_share.py --models quickstart --budgets 0 --seeds 0 --variants mxd,transcoder  (~1 min)
    python benchmarks/code_share.py --from-rows RUNS/rows.json --out table.md --plot docs/results/code_share.png
"""

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _runs import load_rows, run_variants
from dead_units import TRAIN, ensure_cache, model_tree
from dead_units import collect as dead_units_rows
from specialization_claims import format_value, seed_interval

SHARE_TARGET = 0.5
"""The code share a default must reach (issue 35: half of what the layer explains carried by the code)."""
DEFAULT_MXD = "mxd-h2"
"""The variant that is expertize's default MxD (d_hidden = half the MLP's width: MxdSpec.mlp_defaults)."""
DEFAULT_K = 32
"""The K at which the default is chosen (issue 35's; one d_hidden serves every K, the recipes' K is 32)."""
MODELS = ("quickstart", "tiny-gpt2-shakespeare", "stories260k", "smollm2")
BUDGETS = {
    # training tokens per model, each 4x the one before (Tiny Shakespeare's train split holds 343,808 tokens)
    "quickstart": (12_500, 50_000, 200_000),
    "tiny-gpt2-shakespeare": (20_480, 81_920, 327_680),
    "stories260k": (20_480, 81_920, 327_680),
    "smollm2": (16_384, 65_536, 262_144),
}
MLP_WIDTH = {"quickstart": 512, "tiny-gpt2-shakespeare": 512, "stories260k": 172, "smollm2": 1536}

# name -> (kind, layer keys besides kind / k / match_transcoder, d_hidden divisor or None, train keys)
VARIANTS = {
    "transcoder": ("transcoder", {}, None, {}),
    "skip_transcoder": ("skip_transcoder", {}, None, {}),
    "mxd": ("mxd", {}, 1, {}),
    "mxd-h2": ("mxd", {}, 2, {}),
    "mxd-h4": ("mxd", {}, 4, {}),
    "mxd-h16": ("mxd", {}, 16, {}),
    "mxd-randk": ("mxd", {"options": {"random_k": True}}, 1, {}),
    "mxd-unorm": ("mxd", {"options": {"unit_norm_experts": True}}, 1, {}),
    "mxd-h4-randk": ("mxd", {"options": {"random_k": True}}, 4, {}),
    # train.code_share_floor (training/code_floor.py): the code must carry this share of each batch
    "mxd-floor.5": ("mxd", {}, 1, {"code_share_floor": 0.5}),
    "mxd-floor.7": ("mxd", {}, 1, {"code_share_floor": 0.7}),
    "mxd-h2-floor.5": ("mxd", {}, 2, {"code_share_floor": 0.5}),
    "skip_transcoder-floor.5": ("skip_transcoder", {}, None, {"code_share_floor": 0.5}),
}
DEFAULT_VARIANTS = ("transcoder", "skip_transcoder", "mxd", "mxd-h2", "mxd-h4", "mxd-h16", "mxd-randk", "mxd-unorm")
"""The default run (under an hour on 2 cores); the floor variants and mxd-h4-randk are opt-in (--variants)."""
OTHER_KINDS = {
    # the all-kinds benchmark's settings (benchmarks/all_kinds.py KIND_SETTINGS)
    "moe_x": {"k": 2, "options": {"d_expert": 64}},
    "mumoe_cp": {"num_experts": 256},
    "monet_hd": {"num_experts": 1024, "k": 2, "options": {"num_heads": 8}},
    "routed_neurons": {"k": 32, "options": {"num_shared": 32, "router_rank": 32}},
}
EVAL_TOKENS = 16_384


def run_tree(name: str, args, budget: int, seed: int, root: Path) -> tuple[dict, list[dict]]:
    tokens = BUDGETS[name][budget]
    tree = model_tree(name, args, tokens, seed)
    tree["train"]["warmup_steps"] = max(1, tokens // tree["train"]["tokens_per_step"] // 10)
    tree["data"]["eval_tokens"] = min(tree["data"]["eval_tokens"], EVAL_TOKENS)
    tree["eval"]["generation_prompts"] = 0
    tree["output_dir"] = str(root / f"{name}-b{budget}-s{seed}")
    if name == "smollm2":
        tree["data"]["activation_cache"] = str(ensure_cache(args, tree, max(BUDGETS["smollm2"])))
    match = tree["layer"]["match_transcoder"]
    width = MLP_WIDTH[name]
    variants, settings = [], []
    for k in [int(k) for k in args.ks.split(",")]:
        for vname in args.variants.split(","):
            kind, extra, divisor, train = VARIANTS[vname]
            layer = {"kind": kind, "k": k, "match_transcoder": match, **extra}
            if divisor is not None:
                layer["d_hidden"] = max(1, width // divisor)
            # every variant states its floor (0: plain distillation), whatever `auto` gives its kind
            variants.append({"name": f"{vname}-k{k}", "layer": layer, "train": {"code_share_floor": 0.0, **train}})
            settings.append({"model": name, "budget": tokens, "variant": vname, "kind": kind, "k": k, "seed": seed,
                             "name": f"{vname}-k{k}"})
        if args.other_kinds and k == 32 and budget == len(BUDGETS[name]) - 1:
            for kind, extra in OTHER_KINDS.items():
                layer = {"kind": kind, "match_transcoder": match, **extra}
                variants.append({"name": kind, "layer": layer})
                settings.append({"model": name, "budget": tokens, "variant": kind, "kind": kind,
                                 "k": extra.get("k") or 0, "seed": seed, "name": kind})
    tree["variants"] = variants
    return tree, settings


def collect(metrics_of: dict, settings: list[dict]) -> list[dict]:
    """dead_units.py's rows (units, dead, FVU, L0, KL, ΔCE) with the code's share of the layer and the resolved lr."""
    rows = dead_units_rows(metrics_of, settings)
    for row in rows:
        metrics = metrics_of[row["name"]]
        (m,) = metrics["layers"].values()
        row.update(fvu_mean_code=m.get("fvu_mean_code"), share=m.get("code_share"),
                   lr=metrics.get("train", {}).get("lr"))
    return rows


def _cell(values: list, fmt: str, scale: float = 1.0) -> str:
    values = [v * scale for v in values if v is not None]
    if not values:
        return "n/a"
    mean, low, high = seed_interval(values)
    if len(values) < 2 or not math.isfinite(low):
        return format_value(mean, fmt)
    return f"{format_value(mean, fmt)} ± {format_value((high - low) / 2, fmt)}"


def _order(variant: str) -> int:
    names = list(VARIANTS) + list(OTHER_KINDS)
    return names.index(variant) if variant in names else len(names)


def groups_of(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["budget"], r["k"], r["variant"]), []).append(r)
    return groups


def transcoder_runs(groups: dict[tuple, list[dict]]) -> dict[tuple, dict[int, dict]]:
    """(model, budget, K) -> {seed: the TopK transcoder's row}: what every other variant's KL is paired with."""
    return {key[:3]: {r["seed"]: r for r in rs} for key, rs in groups.items() if key[3] == "transcoder"}


def paired_ratio(rs: list[dict], base: dict[int, dict] | None, metric: str) -> tuple | None:
    if not base:
        return None
    per_seed = [r[metric] / base[r["seed"]][metric] for r in rs if r["seed"] in base and base[r["seed"]][metric]]
    return seed_interval(per_seed) if per_seed else None


def _ratio_text(ratio: tuple | None) -> str:
    if ratio is None:
        return ""
    mean, low, high = ratio
    return format_value(mean, ".2f") if not math.isfinite(low) else f"{mean:.2f} [{low:.2f}, {high:.2f}]"


def table(rows: list[dict]) -> str:
    groups = groups_of(rows)
    transcoder = transcoder_runs(groups)
    lines = ["| model | tokens | K | variant | units | seeds | dead % | L0 | FVU | FVU, average code | code share | KL "
             "| KL / transcoder | ΔCE |", "|" + "---|" * 14]
    for key in sorted(groups, key=lambda k: (MODELS.index(k[0]), k[1], -k[2], _order(k[3]))):
        rs = sorted(groups[key], key=lambda r: r["seed"])
        model, budget, k, variant = key
        ratio = None if variant == "transcoder" else paired_ratio(rs, transcoder.get(key[:3]), "kl")
        lines.append(
            f"| {model} | {budget:,} | {k or '–'} | {variant} | {rs[0]['units']:,} | {len(rs)} | "
            f"{_cell([r['dead'] for r in rs], '.1f', 100)} | {_cell([r['l0'] for r in rs], '.1f')} | "
            f"{_cell([r['fvu'] for r in rs], '.4f')} | {_cell([r['fvu_mean_code'] for r in rs], '.3f')} | "
            f"{_cell([r['share'] for r in rs], '.2f')} | {_cell([r['kl'] for r in rs], '.4f')} | "
            f"{_ratio_text(ratio)} | {_cell([r['delta_ce'] for r in rs], '+.4f')} |"
        )
    return "\n".join(lines)


def frontier(rows: list[dict]) -> str:
    """Per (model, budget, K): the MxD variant of lowest mean KL among those whose mean code share ≥ SHARE_TARGET,
    against the transcoder (paired KL ratio), beside the default MxD's, the paper's MxD's and the skip transcoder's
    share and KL."""
    groups = groups_of(rows)
    transcoder = transcoder_runs(groups)
    out = ["| model | tokens | K | default MxD (H = W/2): share, KL | paper's MxD (H = W): share, KL | best MxD with "
           "share ≥ 0.5 | its share | its KL | KL / transcoder | transcoder KL | skip transcoder: share, KL |",
           "|" + "---|" * 11]
    for model, budget, k in sorted({key[:3] for key in groups if key[2]}, key=lambda t: (MODELS.index(t[0]), t[1], -t[2])):
        def mean(variant: str, metric: str) -> float | None:
            rs = groups.get((model, budget, k, variant))
            values = [r[metric] for r in rs or [] if r[metric] is not None]
            return statistics.fmean(values) if values else None

        mxds = [v for (m, b, kk, v) in groups if (m, b, kk) == (model, budget, k) and v.startswith("mxd")]
        eligible = [v for v in mxds if (mean(v, "share") or 0) >= SHARE_TARGET]
        best = min(eligible, key=lambda v: mean(v, "kl")) if eligible else None
        ratio = paired_ratio(groups[(model, budget, k, best)], transcoder.get((model, budget, k)), "kl") if best else None

        def pair(variant: str) -> str:
            share, kl = mean(variant, "share"), mean(variant, "kl")
            return "n/a" if kl is None else f"{format_value(share, '.2f')}, {kl:.4f}"

        out.append(
            f"| {model} | {budget:,} | {k} | {pair(DEFAULT_MXD)} | {pair('mxd')} | {best or 'none'} | "
            f"{format_value(mean(best, 'share') if best else None, '.2f')} | "
            f"{format_value(mean(best, 'kl') if best else None, '.4f')} | {_ratio_text(ratio)} | "
            f"{format_value(mean('transcoder', 'kl'), '.4f')} | {pair('skip_transcoder')} |"
        )
    return "\n".join(out)


def default_choice(rows: list[dict]) -> tuple[str, dict[int, str | None]]:
    """Per K, every MxD variant measured in every (model, budget) cell of that K: the lowest of its cells' mean code
    share, and the geometric mean over the cells of its KL / transcoder (paired per seed, then averaged over seeds),
    with the range. The choice: the lowest geometric mean among variants whose share reaches SHARE_TARGET in every
    cell; a variant not run in every cell, or with no share defined in one (FVU ≥ 1), is listed but not a candidate.
    Returns (the table, {K: chosen variant or None})."""
    groups = groups_of(rows)
    transcoder = transcoder_runs(groups)
    out = [f"| K | MxD variant | cells | lowest cell share | KL / transcoder, geometric mean over cells [range] | "
           f"share ≥ {SHARE_TARGET} everywhere |", "|" + "---|" * 6]
    chosen: dict[int, str | None] = {}
    for k in sorted({key[2] for key in groups if key[2] and key[3] == "transcoder"}, reverse=True):
        cells = sorted({key[:2] for key in groups if key[2] == k and key[3] == "transcoder"})
        scored, unscored = [], []
        for variant in sorted({key[3] for key in groups if key[2] == k and key[3].startswith("mxd")}, key=_order):
            shares, ratios, missing = [], [], 0
            for model, budget in cells:
                rs = groups.get((model, budget, k, variant))
                ratio = paired_ratio(rs, transcoder.get((model, budget, k)), "kl") if rs else None
                values = [r["share"] for r in rs or [] if r["share"] is not None]
                if ratio is None or not values:
                    missing += 1  # not run there, or no share defined (FVU ≥ 1: it explains nothing)
                    continue
                shares.append(statistics.fmean(values))
                ratios.append(ratio[0])
            if missing:
                unscored.append((variant, len(cells) - missing))
            else:
                geo = math.exp(statistics.fmean(math.log(q) for q in ratios))
                scored.append((variant, min(shares), geo, min(ratios), max(ratios)))
        eligible = [v for v in scored if v[1] >= SHARE_TARGET]
        chosen[k] = min(eligible, key=lambda v: v[2])[0] if eligible else None
        for variant, low_share, geo, lo, hi in scored:
            mark = "**chosen**" if variant == chosen[k] else "yes" if low_share >= SHARE_TARGET else "no"
            out.append(f"| {k} | {variant} | {len(cells)} | {low_share:.2f} | {geo:.2f} [{lo:.2f}, {hi:.2f}] | "
                       f"{mark} |")
        for variant, measured in unscored:
            out.append(f"| {k} | {variant} | {measured} of {len(cells)} | – | – | not a candidate: no reading in "
                       f"{len(cells) - measured} cell(s) |")
    return "\n".join(out), chosen


def comparison(rows: list[dict]) -> str:
    """Per (model, K, budget): the default MxD, the paper's MxD (H = W) and the skip transcoder, each its code share
    and its KL / transcoder (paired per seed), beside the transcoder's KL."""
    groups = groups_of(rows)
    transcoder = transcoder_runs(groups)
    out = ["| model | K | tokens | seeds | default MxD (H = W/2): code share | its KL / transcoder | paper's MxD (H = W): "
           "code share | its KL / transcoder | skip transcoder: code share | its KL / transcoder | transcoder KL |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model, budget, k in sorted(transcoder, key=lambda t: (MODELS.index(t[0]), -t[2], t[1])):
        base = transcoder[(model, budget, k)]
        cells = []
        for variant in (DEFAULT_MXD, "mxd", "skip_transcoder"):
            rs = groups.get((model, budget, k, variant))
            cells += ([_cell([r["share"] for r in rs], ".2f"), _ratio_text(paired_ratio(rs, base, "kl"))] if rs
                      else ["–", "–"])
        out.append(f"| {model} | {k} | {budget:,} | {len(base)} | " + " | ".join(cells) + " | "
                   f"{_cell([r['kl'] for r in base.values()], '.4f')} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """KL against code share, one panel per model (its largest budget), one point per (variant, K) (mean over seeds),
    MxD variants joined by K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = groups_of(rows)
    models = [m for m in MODELS if any(key[0] == m for key in groups)]
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        budget = max(key[1] for key in groups if key[0] == model)
        for (m, b, k, variant), rs in sorted(groups.items(), key=lambda kv: _order(kv[0][3])):
            if (m, b) != (model, budget):
                continue
            share = statistics.fmean(r["share"] for r in rs if r["share"] is not None) if any(
                r["share"] is not None for r in rs) else float("nan")
            kl = statistics.fmean(r["kl"] for r in rs)
            marker = "o" if variant.startswith("mxd") else "s" if "transcoder" in variant else "^"
            ax.scatter(share, kl, marker=marker, color="C0" if k == 32 else "C1" if k == 8 else "C2")
            ax.annotate(f"{variant} K{k}" if k else variant, (share, kl), fontsize=6, xytext=(3, 2),
                        textcoords="offset points")
        ax.axvline(SHARE_TARGET, color="grey", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_xlabel("code share (1 = the code carries everything)")
        ax.set_ylabel("KL(base ‖ spliced), nats/token")
        ax.set_title(f"{model}, {budget:,} tokens", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.environ.get("EXPERTIZE_DATA"))
    p.add_argument("--models", default="quickstart,tiny-gpt2-shakespeare,stories260k")
    p.add_argument("--budgets", default="0,1,2", help="indices into BUDGETS (0 = smallest)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: {', '.join(DEFAULT_VARIANTS)})")
    p.add_argument("--ks", default="32,8")
    p.add_argument("--other-kinds", action="store_true", help="also the other kinds at K = 32, largest budget")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--tokens-per-step", type=int, default=TRAIN["tokens_per_step"])
    p.add_argument("--runs-dir", default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--from-rows", default=None, help="re-tabulate rows.json files (comma-separated); trains nothing")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="write the KL-vs-code-share plot here (PNG)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.from_rows:
        rows, budget_line = load_rows(args.from_rows, lambda r: (r["model"], r["budget"], r["k"], r["variant"],
                                                                  r["seed"]))
    else:
        bad = [v for v in args.variants.split(",") if v not in VARIANTS] + [
            m for m in args.models.split(",") if m not in MODELS]
        if bad:
            print(f"error: unknown variant / model {bad}", file=sys.stderr)
            return 2
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="expertize-code-share-"))
        root.mkdir(parents=True, exist_ok=True)
        rows, started = [], time.perf_counter()
        for name in args.models.split(","):
            for budget in [int(b) for b in args.budgets.split(",")]:
                if budget >= len(BUDGETS[name]):
                    continue
                for seed in [int(s) for s in args.seeds.split(",")]:
                    tree, settings = run_tree(name, args, budget, seed, root)
                    metrics_of, seconds = run_variants(tree, "benchmarks/code_share.py")
                    print(f"  {name} {BUDGETS[name][budget]:,} tokens seed {seed}: {len(settings)} variants "
                          f"[{'reused' if seconds is None else f'{seconds:.0f}s'}]", flush=True)
                    rows += collect(metrics_of, settings)
                    (root / "rows.partial.json").write_text(json.dumps(rows), encoding="utf-8")
        budget_line = (f"models {args.models}; budgets {', '.join(f'{m} {BUDGETS[m]}' for m in args.models.split(','))}"
                       f"; variants {args.variants}; K {args.ks}; seeds {args.seeds}; {len(rows)} trained variants; "
                       f"wall time {(time.perf_counter() - started) / 60:.1f} min on CPU")
        (root / "rows.json").write_text(json.dumps({"rows": rows, "budget": budget_line}), encoding="utf-8")
    choice, chosen = default_choice(rows)
    text = f"{table(rows)}\n\n{frontier(rows)}\n\n{choice}\n\n{comparison(rows)}\n\nbudget: {budget_line}\n"
    if chosen.get(DEFAULT_K) not in (None, DEFAULT_MXD):
        text += (f"\nnote: at K = {DEFAULT_K} these rows choose {chosen[DEFAULT_K]}, not the default {DEFAULT_MXD} "
                 "(MxdSpec.mlp_defaults): revisit the default\n")
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
