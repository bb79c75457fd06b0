"""What each stage of benchmarks/real_model.py costs on a real model, per kind (issue 48: "make it affordable").

Stages, each timed alone on the machine it runs on (hold the cores: `--lock`):
- capture: the activation cache's tokens per second, at every layer of `--layers` (only the blocks up to the deepest
  run): `--steps` x 1,024 tokens captured alone into a scratch folder, and the whole cache real_model.py captured
  (cache-dir/capture.json, timed while other jobs may have shared the cores);
- train: one kind alone, `--steps` optimizer steps of 1,024 tokens read from that cache (the loop's seconds from the
  run's train_log), in fp32 and in bf16 autocast (`train.precision`);
- evaluate: the run's wall time less its training loop (load, held-out forwards, the code probe, the folder).
From the rates, what each budget of real_model.py costs per (layer, seed) run with every kind, and the next 4x.

    python benchmarks/real_model_stages.py --model SMOLLM2_DIR --corpus DOMAINS_DIR --cache-dir CACHE \
        --layers 5,15,25 --budget 1048576 --layer 15 --steps 64 --runs-dir RUNS --lock /tmp/expertize-cpu.lock
"""

import argparse
import json
import sys
import time
from pathlib import Path

from _runs import run_variants
from real_model import KINDS, base_tree, cores, mlp_width, train_seconds

PRECISIONS = ("fp32", "bf16")


def kind_tree(args, cache: Path, kind: str, precision: str) -> dict:
    tokens = args.steps * args.tokens_per_step
    tree = base_tree(args, [args.layer], tokens, 0)
    tree["data"]["activation_cache"] = str(cache)
    tree["train"].update(precision=precision, warmup_steps=1, log_every=max(1, args.steps // 4))
    tree["output_dir"] = str(Path(args.runs_dir) / f"{kind}-{precision}")
    layer = {"k": 32, "match_transcoder": 8, **KINDS[kind]}
    if layer.get("d_hidden") == "W":
        layer["d_hidden"] = mlp_width(args.model)
    tree["variants"] = [{"name": kind, "layer": layer}]
    return tree


def train_rates(args, cache: Path, tokens: int, lines: list[str]) -> dict[str, float]:
    """Each kind trained alone in each precision: its tokens/s (appending the table's rows to `lines`)."""
    rates = {}
    for kind in args.kinds.split(","):
        for precision in PRECISIONS:
            tree = kind_tree(args, cache, kind, precision)
            _, wall = run_variants(tree, "benchmarks/real_model_stages.py")  # wall None: reused (not timed here)
            train = train_seconds(Path(tree["output_dir"]) / kind)
            rates[f"{kind}-{precision}"] = tokens / train
            lines.append(f"| train | {kind} | {precision} | {tokens:,} | {train:.1f} | {tokens / train:,.0f} |")
            lines.append(f"| evaluate and write | {kind} | {precision} | {args.eval_tokens:,} held out | "
                         f"{'reused' if wall is None else f'{wall - train:.1f}'} | – |")
            print(lines[-2], flush=True)
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--separator", default="line")
    p.add_argument("--cache-dir", required=True, help="real_model.py's --cache-dir (its capture is reused)")
    p.add_argument("--layers", default="5,15,25", help="the layers the cache was captured at")
    p.add_argument("--budget", type=int, default=1_048_576, help="the cache's training tokens")
    p.add_argument("--layer", type=int, default=15)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--eval-tokens", type=int, default=8_192)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens-per-step", type=int, default=1024)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--runs-dir", required=True)
    p.add_argument("--lock", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cache = Path(args.cache_dir) / f"{Path(args.model).name}-l{args.layers.replace(',', '-')}-{args.budget}"
    captured = json.loads((Path(args.cache_dir) / "capture.json").read_text(encoding="utf-8")).get(cache.name)
    if not cache.is_dir() or captured is None:
        print(f"error: no activation cache {cache} with its capture time; run benchmarks/real_model.py first",
              file=sys.stderr)
        return 2
    tokens = args.steps * args.tokens_per_step
    lines = ["| stage | kind | precision | tokens | seconds | tokens/s |", "|---|---|---|---:|---:|---:|",
             f"| capture, the whole cache ({len(captured['layers'])} layers, blocks up to "
             f"{max(captured['layers'])}) | – | fp32 | "
             f"{captured['tokens']:,} | {captured['seconds']:,.0f} | "
             f"{captured['tokens'] / captured['seconds']:,.0f} |"]
    from expertize.conversion.capture import capture_activations
    from expertize.conversion.recipe import recipe_from_dict

    layers = [int(x) for x in args.layers.split(",")]
    scratch = Path(args.runs_dir) / "capture-scratch"
    timing = Path(args.runs_dir) / "capture-scratch.json"
    if not timing.exists():
        tree = dict(base_tree(args, layers, tokens, 0), output_dir=str(Path(args.runs_dir) / "unused"))
        with cores(args.lock):
            start = time.perf_counter()
            capture_activations(recipe_from_dict(tree, source="benchmarks/real_model_stages.py"), scratch)
            timing.write_text(json.dumps({"seconds": time.perf_counter() - start}), encoding="utf-8")
    seconds = json.loads(timing.read_text(encoding="utf-8"))["seconds"]
    lines.append(f"| capture alone ({len(layers)} layers) | – | fp32 | {tokens:,} | {seconds:.1f} | "
                 f"{tokens / seconds:,.0f} |")
    with cores(args.lock):  # every training measurement in one hold of the cores
        rates = train_rates(args, cache, tokens, lines)
    fp32 = [rates[f"{k}-fp32"] for k in args.kinds.split(",")]
    per_run = sum(tokens / rate for rate in fp32) / tokens  # seconds per training token of one run with every kind
    lines += ["", "| budget per (layer, seed) run, every kind (fp32) | training seconds |", "|---:|---:|"]
    for budget in (65_536, 262_144, 1_048_576, 4_194_304):
        lines.append(f"| {budget:,} | {budget * per_run:,.0f} |")
    text = "\n".join(lines) + f"\n\nbudget: {args.model} layer {args.layer}, {args.steps} steps of 1,024 tokens per " \
        f"kind and precision, from the cache {cache.name}\n"
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
