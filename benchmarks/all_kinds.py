"""Every sparse layer kind on one table: same layer, same training tokens, same parameter budget.

One MLP of a real checkpoint (default: layer 2 of tiny-gpt2-shakespeare, d 128, gelu_new MLP 512) is replaced by
each kind of `expertize.modeling.LAYER_KINDS`. All kinds (and, with --lr-sweep, every kind x learning rate) are the
`variants:` of ONE recipe, trained by ONE `expertize upcycle` (`recipe_from_dict` + `upcycle`, via
`_runs.run_variants_caught`): the base model runs over the corpus once and that one activation stream feeds every
variant's trainer step by step, each variant getting the weights it would get alone (tests/test_variants.py). The
variants differ only in their `layer:` section and `train.lr`:

    every kind   layer.match_transcoder = F (default 8): the kind's size field is the largest value whose spec has at
                 most the parameters of a TopK transcoder with F·d_in latents (mxd: convention "exact"; transcoders:
                 exactly F·d_in latents, so the skip transcoder also has its dense d_in×d_out skip matrix on top;
                 μMoE: the rank; Monet: d_hidden; the other kinds: the number of experts).
    per kind     the sizes matching does not choose are set explicitly (KIND_SETTINGS below, `--set` overrides):

        mxd, transcoder, skip_transcoder   k = 32 (experts / latents per token)
        moe_x                              k = 2 experts per token (the paper's), d_expert = 64 (= 512 / 8, the
                                           paper's 8-expert split of the MLP width); the number of experts is matched
        mumoe_cp, mumoe_tr                 num_experts = 256 (no top-k: entmax gate); the rank is matched
        monet_hd, monet_vd                 num_experts = 1024 (32 x 32 product experts), 8 heads (the paper's),
                                           k = 2 sub-experts per head and side (so at most 8·2·2 = 32 product
                                           experts per token, like the K = 32 of the others; the paper's k = 8 of
                                           S = 512 would be 8 of our 32 sub-experts, a quarter: ~330 of the 1024
                                           product experts per token, and a forward 50x the dense MLP's, spent
                                           building that code); d_hidden is matched
        routed_neurons                     k = 32 routed + 32 shared neurons, router rank 32 (= d/4); the number of
                                           experts is matched

    `activation: auto` everywhere: the base MLP's (gelu_new), except MoE-X, whose recipe default is ReLU experts.

Same data (tinyshakespeare, the checkpoint's training text, 10% of documents held out), same tokens (same seed, same
order), same optimizer settings for every kind: AdamW lr 1e-2, 50 warm-up steps, cosine decay to 0.1 lr, 1,024
tokens per step, NMSE loss (the MxD paper's), fp32, gradient clipping 1.0, routed kinds' auxiliary losses at their
specs' own coefficients, the recipe's default dead-unit handling (train.balance: floor for the kinds that choose a
top K, AuxK off; docs/dead_units.md). (The table in docs/results/all_kinds.md predates that default: it was measured
with AuxK at 1/32 and no selection bias; rerun the script to refresh the table.) Nothing is tuned per kind. The
default budget, 327,680 training tokens (320 steps), is the most tinyshakespeare gives (343,808 training tokens at
context 128). That is short, and the ranking of the kinds depends on the learning rate: in a sweep over
{1e-3, 3e-3, 1e-2, 3e-2} (`--lr-sweep`, measured before AuxK was on by default), 1e-2 was the best shared rate (best
FVU for transcoder, skip_transcoder, monet_hd, monet_vd, routed_neurons; mxd, mumoe_cp and mumoe_tr do better still
at 3e-2, moe_x at 3e-3), and 1e-3 (the fidelity benchmark's rate) left every kind far from converged.

Columns: total parameters (`spec.num_parameters()`); active parameters per token (`spec.active_parameters()`);
NMSE as the MxD paper defines it and FVU on held-out tokens; ΔCE = CE(spliced) − CE(base) on the held-out
sequences; L0 = mean number of non-zero entries of the layer's sparse code per token (its units differ between kinds:
experts, latents, hidden units of the selected experts for MoE-X, product experts for Monet, entmax support for μMoE);
forward time of the trained layer relative to the dense MLP it replaces, on the same held-out MLP inputs (inference,
no grad, all layers timed round-robin in this process, median of the repeats).

Run:  EXPERTIZE_DATA=/path/to/shared/data python benchmarks/all_kinds.py [--out all_kinds.md]
      python benchmarks/all_kinds.py --kinds mxd,moe_x --train-tokens 65536 --set moe_x.k=4

A kind whose layer settings are refused (e.g. a bad --set) is reported as FAILED before training and left out of the
joint run; a variant that diverges stops alone and the others are still published and tabled. Runs go to a
temporary folder, removed at the end, unless --runs-dir is given: then each variant's model folder is
<runs-dir>/<kind>-lr<lr>/, a finished one whose recipe equals this invocation's is reused (so adding --lr-sweep
later trains only the new rates), and an unfinished one resumes.

Runtime: the default run (9 variants in one run) took 37m50s wall, 21 CPU-minutes, with the 2 CPU cores shared with
4-5 other jobs (load average 6-11) and this one niced, so that number says little; one run per kind, as this script
used to do, took 2m13s on 2 idle cores (8m55s with --lr-sweep 1e-3,3e-3,3e-2). At equal work the joint run costs
less: --kinds mxd,transcoder,moe_x --train-tokens 32768 --eval-tokens 8192 --threads 1 took 17.0 CPU-s as one run
vs 20.0 CPU-s as three (same metrics to the last digit); what it saves is the base model's loading and forward per
kind, small next to the sparse layers' own math on this 4-layer model, larger on a real one. Expect about 2-3
minutes on 2 idle cores, plus about as much again per --lr-sweep rate. The forward-time column is timed round-robin
after training, so drifts hit all layers alike, but on busy cores the ratios shrink toward 1 (the dense MLP's time
grew most in the run above); measure it on idle cores.
"""

import argparse
import functools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml
from _runs import run_variants_caught, text_data
from _timing import round_robin_times

MODELS = {
    # name: (model folder, corpus, document separator, default layer)
    "tiny-gpt2-shakespeare": ("models/tiny-gpt2-shakespeare", "corpora/tinyshakespeare.txt", "blank_line", 2),
    "stories260k": ("models/stories260k", "corpora/stories260k_samples.txt", "line", 2),
}
KINDS = ("mxd", "transcoder", "skip_transcoder", "moe_x", "mumoe_cp", "mumoe_tr", "monet_hd", "monet_vd",
         "routed_neurons")
# The recipe `layer:` keys of each kind besides kind and match_transcoder (see the module docstring).
KIND_SETTINGS = {
    "mxd": {"k": 32, "match_convention": "exact"},
    "transcoder": {"k": 32},
    "skip_transcoder": {"k": 32},
    "moe_x": {"k": 2, "options": {"d_expert": 64}},
    "mumoe_cp": {"num_experts": 256},
    "mumoe_tr": {"num_experts": 256},
    "monet_hd": {"num_experts": 1024, "k": 2, "options": {"num_heads": 8}},
    "monet_vd": {"num_experts": 1024, "k": 2, "options": {"num_heads": 8}},
    "routed_neurons": {"k": 32, "options": {"num_shared": 32, "router_rank": 32}},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", default=os.environ.get("EXPERTIZE_DATA"),
                   help="shared data folder holding models/ and corpora/ (default: $EXPERTIZE_DATA)")
    p.add_argument("--model", default="tiny-gpt2-shakespeare", choices=list(MODELS), help="base checkpoint")
    p.add_argument("--layer", type=int, default=None, help="decoder layer to replace (default: 2, a middle layer)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {', '.join(KINDS)}")
    p.add_argument("--match-transcoder", type=float, default=8,
                   help="parameter budget of every kind: a TopK transcoder with this many latents per input dim "
                        "(default 8)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KIND.KEY=VALUE",
                   help="change a kind's layer setting, YAML value, e.g. moe_x.k=4 or routed_neurons.options."
                        "num_shared=0 (repeatable)")
    p.add_argument("--train-tokens", type=int, default=327_680,
                   help="training tokens per run, the same for every kind (default 327,680 = 320 steps of 1,024, "
                        "just under the 343,808 training tokens tinyshakespeare gives at context 128)")
    p.add_argument("--lr", type=float, default=1e-2, help="peak AdamW learning rate, shared by all kinds (1e-2)")
    p.add_argument("--lr-sweep", default="", metavar="LR,LR,...",
                   help="also train every kind at these learning rates and print their FVU / ΔCE side by side with "
                        "--lr's (e.g. 1e-3,3e-3,3e-2; default: none). The main table always uses --lr")
    p.add_argument("--warmup-steps", type=int, default=50, help="linear warm-up steps (default 50)")
    p.add_argument("--tokens-per-step", type=int, default=1024, help="tokens per optimizer step (default 1024)")
    p.add_argument("--context-length", type=int, default=128, help="tokens per packed sequence (default 128)")
    p.add_argument("--eval-tokens", type=int, default=32_768, help="held-out evaluation tokens (default 32,768)")
    p.add_argument("--generation-prompts", type=int, default=0,
                   help="greedy-continuation prompts of the evaluation (default 0: skipped, not in the table)")
    p.add_argument("--timing-tokens", type=int, default=4096, help="held-out tokens per timed forward (default 4096)")
    p.add_argument("--timing-repeats", type=int, default=20, help="timed forwards per layer; median (default 20)")
    p.add_argument("--seed", type=int, default=0, help="data, init and shuffle seed (default 0)")
    p.add_argument("--runs-dir", default=None,
                   help="keep the runs in this folder (default: a temporary folder, removed at the end)")
    p.add_argument("--out", default=None, help="also write the Markdown table (and the configuration) to this file")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    return p.parse_args()


def kind_settings(overrides: list[str]) -> dict[str, dict]:
    settings = json.loads(json.dumps(KIND_SETTINGS))
    for text in overrides:
        key, sep, value = text.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 2 or parts[0] not in settings:
            raise SystemExit(f"error: --set {text}: expected KIND.KEY=VALUE with KIND one of {', '.join(KINDS)}")
        node = settings[parts[0]]
        for part in parts[1:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(value)
    return settings


def build_tree(args: argparse.Namespace, kind: str, settings: dict, out_dir: Path) -> dict:
    """The recipe of one kind (the joint run's shared sections; its variants differ only in `layer:` and lr)."""
    model_dir, corpus, separator, _ = MODELS[args.model]
    data = Path(args.data)
    return {
        "base_model": str(data / model_dir),
        "dtype": "float32",
        "layers": [args.layer],
        "layer": {"kind": kind, "match_transcoder": args.match_transcoder, **settings},  # = layer_section
        "data": text_data(data / corpus, separator, args.context_length, args.train_tokens, args.eval_tokens, args.seed),
        "train": {
            "lr": args.lr,
            "warmup_steps": args.warmup_steps,
            "schedule": "cosine",
            "min_lr_ratio": 0.1,
            "tokens_per_step": args.tokens_per_step,
            "loss": "nmse",
            "precision": "fp32",
            "grad_clip": 1.0,
            "checkpoint_every": 0,
            "log_every": 50,
            "seed": args.seed,
            "device": "cpu",
        },
        "eval": {
            "batch_sequences": 16,
            "generation_prompts": args.generation_prompts,
            "prompt_tokens": 4,
            "continuation_tokens": 32,
            "histogram": False,
        },
        "output_dir": str(out_dir),
    }


def where_it_failed(error: BaseException) -> str:
    """The innermost frame of the traceback inside this repository (or the innermost at all), as file:line."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:  # never raised (e.g. a variant that left no metrics.json)
        return "benchmarks/all_kinds.py"
    root = str(Path(__file__).resolve().parent.parent)
    ours = [f for f in frames if f.filename.startswith(root)]
    frame = (ours or frames)[-1]
    name = os.path.relpath(frame.filename, root) if frame.filename.startswith(root) else frame.filename
    return f"{name}:{frame.lineno} ({frame.name})"


def trained_layer(run_dir: Path, layer: int):
    """The trained sparse layer of a finished run, from its saved model folder."""
    from expertize.conversion.data.mlp_pairs import decoder_blocks
    from expertize.conversion.surgery.splice import load_expertize_model

    model = load_expertize_model(run_dir)
    return decoder_blocks(model)[layer].mlp.eval()


@torch.no_grad()
def time_forwards(modules: dict[str, torch.nn.Module], x: torch.Tensor, repeats: int, warmup: int = 2) -> dict:
    """Median forward seconds of each module on x, round-robin (slow drifts of a shared machine hit all alike)."""
    times = round_robin_times({name: functools.partial(module, x) for name, module in modules.items()}, warmup, repeats)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _f(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, fmt)


def variant_name(kind: str, lr: float) -> str:
    """The folder of one (kind, lr) variant under --runs-dir, e.g. mxd-lr0.01 (no '+': 1e+06 -> 1e06)."""
    return f"{kind}-lr{lr:g}".replace("+", "")


def layer_section(args: argparse.Namespace, kind: str, settings: dict) -> dict:
    """The recipe `layer:` section of one kind (see the module docstring)."""
    return {"kind": kind, "match_transcoder": args.match_transcoder, **settings[kind]}


def check_kind(args: argparse.Namespace, kind: str, settings: dict) -> None:
    """Raise the recipe / spec error of one kind's layer settings (e.g. a bad --set) before the joint run, so that
    one kind's mistake leaves it out of the table instead of stopping every other kind's training."""
    from expertize.conversion.preflight import base_model_config
    from expertize.conversion.recipe import recipe_from_dict, resolve_layer_spec
    from expertize.conversion.surgery.families import mlp_shape

    tree = build_tree(args, kind, settings[kind], Path(tempfile.gettempdir()) / "expertize-all-kinds-check")
    recipe = recipe_from_dict(tree, source=f"benchmarks/all_kinds.py {kind}")
    resolve_layer_spec(recipe.layer, mlp_shape(base_model_config(recipe.base_model)))


def failure(kind: str, lr: float, error: BaseException) -> dict:
    return {"kind": kind, "lr": lr, "where": where_it_failed(error), "error": f"{type(error).__name__}: {error}",
            "traceback": "".join(traceback.format_exception(error))}


def run_kinds(args: argparse.Namespace, lrs: list[float], kinds: list[str], settings: dict, root: Path):
    """Upcycle every (kind, lr) as a variant of ONE recipe into root/<kind>-lr<lr>: one activation stream (one
    capture of the base model) feeds every variant's trainer step by step, and each variant's weights are those it
    would get alone. Returns (rows, failures, seconds of the joint run or None when every variant was reused)."""
    from expertize.modeling import spec_from_dict

    failures, ok = [], []
    for kind in kinds:
        try:
            check_kind(args, kind, settings)
            ok.append(kind)
        except Exception as error:  # report precisely, go on with the other kinds
            for lr in lrs:
                failures.append(failure(kind, lr, error))
            print(f"  {kind}: FAILED at {failures[-1]['where']}: {failures[-1]['error']}", flush=True)
    if not ok:
        return [], failures, None
    tree = build_tree(args, ok[0], settings[ok[0]], root)
    tree["variants"] = [
        {"name": variant_name(kind, lr), "layer": layer_section(args, kind, settings), "train": {"lr": lr}}
        for lr in lrs for kind in ok
    ]
    print(f"  one run, {len(tree['variants'])} variants on one activation stream: "
          f"{', '.join(v['name'] for v in tree['variants'])}", flush=True)
    metrics_of, seconds, caught, error = run_variants_caught(tree, "benchmarks/all_kinds.py")
    when = "all reused" if seconds is None else f"{seconds:.0f}s"
    print(f"  trained [{when}]" + (f"; the run ended with {type(error).__name__}" if error else ""), flush=True)
    for message in caught:
        print(f"    warning: {message}", flush=True)
    rows = []
    for lr in lrs:
        for kind in ok:
            name = variant_name(kind, lr)
            if name not in metrics_of:
                failures.append(failure(kind, lr, error or RuntimeError(f"variant {name} has no metrics.json")))
                print(f"  {name}: FAILED at {failures[-1]['where']}: {failures[-1]['error']}", flush=True)
                continue
            out_dir = root / name
            metrics = metrics_of[name]
            config = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
            spec = spec_from_dict(config["sparse_layers"][str(args.layer)])
            m, ce = metrics["layers"][str(args.layer)], metrics["ce"]
            row = {"kind": kind, "lr": lr, "spec": spec.to_dict(), "parameters": spec.num_parameters(),
                   "active_parameters": spec.active_parameters(), "nmse_paper": m["nmse_paper"], "fvu": m["fvu"],
                   "delta_ce": ce["delta"], "l0": m["l0"], "num_units": m["num_units"],
                   "dead_fraction": m["dead_fraction"], "ce_base": ce["base"], "run_dir": str(out_dir)}
            rows.append(row)
            print(f"  {name}: NMSE {row['nmse_paper']:.4f}, FVU {row['fvu']:.4f}, ΔCE {row['delta_ce']:+.4f}, "
                  f"L0 {row['l0']:.1f}, dead {row['dead_fraction']:.1%}", flush=True)
            print(f"    spec {json.dumps(row['spec'])}", flush=True)
    return rows, failures, seconds


def main() -> int:
    args = parse_args()
    if not args.data:
        print("error: give --data or set EXPERTIZE_DATA to the shared data folder (models/, corpora/)",
              file=sys.stderr)
        return 2
    if not (Path(args.data) / "models").is_dir():
        print(f"error: {args.data} has no models/ folder; EXPERTIZE_DATA / --data must point at the shared data "
              "folder (models/, corpora/)", file=sys.stderr)
        return 2
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for kind in kinds:
        if kind not in KINDS:
            print(f"error: unknown kind {kind!r}; choose from {', '.join(KINDS)}", file=sys.stderr)
            return 2
    if args.layer is None:
        args.layer = MODELS[args.model][3]
    settings = kind_settings(args.overrides)
    try:
        args.lr_sweep = [float(v) for v in args.lr_sweep.split(",") if v.strip()]
    except ValueError:
        print(f"error: --lr-sweep: expected comma-separated numbers, got {args.lr_sweep!r}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from expertize.conversion.data.mlp_pairs import MlpCapture, decoder_blocks
    from expertize.conversion.data.text import load_eval_sequences
    from expertize.conversion.recipe import recipe_from_dict
    from expertize.conversion.recipe.schema import TrainConfig
    from expertize.conversion.surgery.splice import base_family, load_base_model
    from expertize.modeling import FAMILIES
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    steps = args.train_tokens // args.tokens_per_step
    auxk = TrainConfig()  # the recipe's defaults: build_tree leaves the dead-unit keys alone
    header = (
        f"All kinds on {args.model} layer {args.layer}, parameter-matched to a {args.match_transcoder:g}x transcoder; "
        f"{steps * args.tokens_per_step:,} training tokens per kind ({steps} steps x {args.tokens_per_step}, context "
        f"{args.context_length}); AdamW lr {args.lr:g}, warm-up {args.warmup_steps}, cosine to 0.1 lr, NMSE loss, "
        f"clip 1.0, fp32, dead-unit handling balance {auxk.balance}"
        f"{f' (floor {auxk.balance_floor:g})' if auxk.balance == 'floor' else ''}, AuxK coef {auxk.auxk_coef:g} "
        f"(top-k kinds), seed {args.seed}; every kind and lr a variant of one run (one activation stream); eval on "
        f"{args.eval_tokens:,} held-out tokens; forward time: "
        f"{args.timing_tokens:,} held-out MLP inputs, median of {args.timing_repeats}, inference; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(header, flush=True)
    for kind in kinds:
        print(f"  layer settings {kind}: {json.dumps(settings[kind])}", flush=True)

    runs_root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="expertize-all-kinds-"))
    start = time.perf_counter()
    sweep: dict[float, list[dict]] = {}
    try:
        lrs = [args.lr, *dict.fromkeys(lr for lr in args.lr_sweep if lr != args.lr)]
        all_rows, all_failures, train_seconds = run_kinds(args, lrs, kinds, settings, runs_root)
        rows = [r for r in all_rows if r["lr"] == args.lr]
        failures = [f for f in all_failures if f["lr"] == args.lr]
        for lr in lrs[1:]:
            sweep[lr] = [r for r in all_rows if r["lr"] == lr]

        # Forward time of every trained layer vs the dense MLP, on the same held-out MLP inputs, round-robin.
        recipe = recipe_from_dict(build_tree(args, kinds[0], settings[kinds[0]], runs_root / "unused"))
        base = load_base_model(recipe.base_model, dtype=torch.float32).eval().requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(recipe.base_model)
        sequences = load_eval_sequences(recipe.data, tokenizer)
        n_seq = max(1, math.ceil(args.timing_tokens / args.context_length))
        x, y_dense = MlpCapture(base, [args.layer])(sequences[:n_seq])[args.layer]
        x = x[: args.timing_tokens]
        modules = {"dense MLP": decoder_blocks(base)[args.layer].mlp}
        for row in rows:
            modules[row["kind"]] = trained_layer(Path(row["run_dir"]), args.layer)
        seconds = time_forwards(modules, x, args.timing_repeats)
        dense_params = sum(p.numel() for p in modules["dense MLP"].parameters())
        shape = FAMILIES[base_family(base.config.model_type)][0].mlp_shape(base.config)
        dense_size = f"{'GLU ' if shape.glu else ''}H={shape.d_hidden:,}, {shape.activation}"
        for row in rows:
            row["forward_ms"] = 1e3 * seconds[row["kind"]]
            row["forward_ratio"] = seconds[row["kind"]] / seconds["dense MLP"]
    finally:
        if not args.runs_dir:
            shutil.rmtree(runs_root, ignore_errors=True)
    wall = time.perf_counter() - start

    cols = ["kind", "size (matched field in bold)", "params", "active params/token", "NMSE (paper)", "FVU", "ΔCE",
            "L0 / units", "fwd time vs dense"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 1)) + "|"]
    lines.append(f"| dense MLP (base) | {dense_size} | {dense_params:,} | {dense_params:,} | 0 | 0 | 0 | – | 1.00 |")
    for r in rows:
        lines.append(
            f"| {r['kind']} | {size_text(r['spec'])} | {r['parameters']:,} | {r['active_parameters']:,} | "
            f"{_f(r['nmse_paper'], '.4f')} | {_f(r['fvu'], '.4f')} | {_f(r['delta_ce'], '+.4f')} | "
            f"{_f(r['l0'], '.1f')} / {r['num_units']:,} | {r['forward_ratio']:.2f} |"
        )
    for f in failures:
        first_line = f["error"].splitlines()[0][:120]
        lines.append(f"| {f['kind']} | FAILED: {first_line} ({f['where']}) |  |  |  |  |  |  |  |")
    base_ce = rows[0]["ce_base"] if rows else float("nan")
    footer = (f"Base CE {base_ce:.4f} nats/token on the held-out tokens; dense MLP forward "
              f"{1e3 * seconds['dense MLP']:.2f} ms per {x.shape[0]:,} tokens.")
    if sweep:
        sweep_lrs = sorted({args.lr, *sweep})
        by_lr = {args.lr: {r["kind"]: r for r in rows}, **{lr: {r["kind"]: r for r in rs} for lr, rs in sweep.items()}}
        lines += ["", "FVU (ΔCE) of the same runs at other learning rates, everything else equal; the best FVU of "
                  "each kind in bold:", "", "| kind | " + " | ".join(f"lr {lr:g}" for lr in sweep_lrs) + " |",
                  "|---|" + "---:|" * len(sweep_lrs)]
        for kind in kinds:
            got = {lr: by_lr[lr][kind] for lr in sweep_lrs if kind in by_lr[lr]}
            best = min(got, key=lambda lr: got[lr]["fvu"]) if got else None
            cells = []
            for lr in sweep_lrs:
                if lr not in got:
                    cells.append("failed")
                    continue
                text = f"{_f(got[lr]['fvu'], '.4f')} ({_f(got[lr]['delta_ce'], '+.4f')})"
                cells.append(f"**{text}**" if lr == best else text)
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    table = "\n".join([header, "", *lines, "", footer])
    print()
    print(table)
    if all_failures:
        print("\nFailures:")
        shown = {}  # one traceback per (kind, error): a kind refused before training fails at every lr alike
        for f in all_failures:
            shown.setdefault((f["kind"], f["error"]), []).append(f)
        for (kind, _), same in shown.items():
            f, at = same[0], ", ".join(format(g["lr"], "g") for g in same)
            print(f"\n{kind} (lr {at}): {f['where']}: {f['error']}\n"
                  f"{f['traceback']}")
    trained = "all reused from --runs-dir" if train_seconds is None else f"{train_seconds:.0f}s"
    print(f"\nwall time {wall:.0f}s (the one training run of {len(all_rows)} variants: {trained}; the rest is the "
          "forward timing)")
    if args.out:
        Path(args.out).write_text(table + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 1 if failures else 0


def size_text(spec: dict) -> str:
    """The spec's size fields, e.g. 'N=512, H=512, K=32'; the field parameter matching chose is in bold."""
    from expertize.modeling import LAYER_KINDS  # the spec class says which field parameter matching picks

    kind = spec["kind"]
    names = {"num_experts": "N", "num_latents": "L", "d_hidden": "H", "d_expert": "D", "rank": "R", "k": "K",
             "num_shared": "S", "router_rank": "r", "num_heads": "heads", "rank_1": "R1", "rank_2": "R2"}
    matched = LAYER_KINDS[kind][0].size_field()
    parts = []
    for field, short in names.items():
        if field in spec:
            text = f"{short}={spec[field]:,}"
            parts.append(f"**{text}**" if field == matched else text)
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
