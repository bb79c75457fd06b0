"""Capture once, train many: K upcycle runs (K learning rates) from live capture vs one capture + K runs from the cache.

    live   : K x `upcycle(recipe)`: each run re-reads the corpus and runs the base model up to the target layer
    cached : `capture_activations(recipe)` once, then K x `upcycle(recipe + data.activation_cache)`

Every run is a whole `expertize upcycle` (preflight, distillation, evaluation, publish) in this process; the
`distil` column is the distillation stage alone (where the cache changes anything), and the last lines time the
activation stream alone (all of a run's batches, no training): live capture vs read from the cache. The final
weights of a cached run equal its live twin's (checked here with torch.equal, float32).

    python benchmarks/cache_speed.py [--recipe quickstart] [--runs 4] [--device cpu] [--set KEY=VALUE ...]
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import expertize.conversion.upcycle as upcycle_module
from expertize.conversion.capture import capture_activations
from expertize.conversion.data.cache import ActivationCache, cached_batches
from expertize.conversion.preflight import plan_run
from expertize.conversion.recipe import load_recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="quickstart")
    parser.add_argument("--runs", type=int, default=4, help="K: runs, at learning rates lr * 2^i (default 4)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides")
    args = parser.parse_args()

    distil_seconds: list[float] = []
    stage = upcycle_module.distil

    def timed_distil(*a, **kw):  # the distillation stage's own time
        start = time.perf_counter()
        stage(*a, **kw)
        distil_seconds.append(time.perf_counter() - start)

    upcycle_module.distil = timed_distil
    base_lr = load_recipe(args.recipe, args.set).train.lr
    rows, weights = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        def run(name: str, lr: float, extra: list[str]) -> float:
            overrides = [*args.set, f"train.device={args.device}", f"train.lr={lr}", f"output_dir={tmp}/{name}",
                         *extra]
            start = time.perf_counter()
            out = upcycle_module.upcycle(load_recipe(args.recipe, overrides), progress=False)
            seconds = time.perf_counter() - start
            weights[name] = load_file(str(Path(out) / "model.safetensors"))
            rows.append((name, seconds, distil_seconds[-1]))
            return seconds

        start = time.perf_counter()
        cache = capture_activations(load_recipe(args.recipe, [*args.set, f"train.device={args.device}"]),
                                    f"{tmp}/cache")
        capture = time.perf_counter() - start
        rows.append(("capture (once)", capture, float("nan")))
        live, cached = 0.0, capture
        for i in range(args.runs):  # interleaved, so that a busy machine slows both sides alike
            live += run(f"live-{i}", base_lr * 2**i, [])
            cached += run(f"cached-{i}", base_lr * 2**i, [f"data.activation_cache={cache}"])
        size = sum(p.stat().st_size for p in Path(cache).iterdir()) / 2**20
        streams = _stream_seconds(load_recipe(args.recipe, [*args.set, f"train.device={args.device}"]), cache)

    same = all(torch.equal(weights[f"live-{i}"][k], weights[f"cached-{i}"][k])
               for i in range(args.runs) for k in weights["live-0"])
    print(f"recipe {args.recipe}, device {args.device}, {args.runs} runs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; cache {size:.0f} MiB")
    print(f"{'run':<16} {'total s':>9} {'distil s':>9}")
    for name, seconds, distil in rows:
        print(f"{name:<16} {seconds:9.1f} {distil:9.1f}")
    live_distil = sum(d for n, _, d in rows if n.startswith("live"))
    cached_distil = sum(d for n, _, d in rows if n.startswith("cached"))
    print(f"{'K live runs':<16} {live:9.1f} {live_distil:9.1f}")
    print(f"{'capture + K':<16} {cached:9.1f} {capture + cached_distil:9.1f}")
    print(f"speed-up: {live / cached:.2f}x overall, {live_distil / (capture + cached_distil):.2f}x on distillation "
          f"(capture included); cached weights equal live weights: {same}")
    for name, (seconds, steps) in streams.items():
        print(f"activation stream alone, {name}: {seconds:.2f} s for {steps} steps")


def _stream_seconds(recipe, cache) -> dict[str, tuple[float, int]]:
    """Seconds to produce every batch of one run (no training): live capture vs the cache."""
    plan = plan_run(recipe)
    base = upcycle_module.load_base(plan, plan.device)
    args = (recipe, base, plan.tokenizer, plan.layer_ids, plan.distill_steps, plan.device)
    out = {}
    for name, make in (("live", lambda: upcycle_module.activation_batches(*args)),
                       ("cached", lambda: cached_batches(ActivationCache(cache), *args))):
        start = time.perf_counter()
        steps = sum(1 for _ in make().batches())
        out[name] = (time.perf_counter() - start, steps)
    return out


if __name__ == "__main__":
    main()
