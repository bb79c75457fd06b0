"""Training throughput of the distillation pipeline next to its arithmetic, measured side by side in one run.

    (a) pipeline    `expertize upcycle`'s distillation stage itself: the calls of conversion/upcycle.py `_run` up to
                    and including `distil` (run folder claimed, base model loaded, layers built, one `Trainer` per
                    variant fed by `train_together` from one activation stream). Timed around `distil`: reading and
                    tokenizing the text, capture hooks, the chunked shuffle buffer, loss (+ AuxK), AdamW, schedule,
                    dead-unit tracking, progress bar, JSONL log and checkpoints (the recipe's cadence).
    (b) layer math  the sparse layers' forward, loss (+ routed aux and AuxK from the step the pipeline turns it on),
                    backward, optimizer step and the device-side bookkeeping of the step (`Trainer.compute_loss`,
                    backward, `_optimizer_step`, `track`: the very code of a pipeline step, minus logging and data)
                    on captured batches already in memory. `track` moves the selection bias (train.balance), which
                    decides how the next forward chooses its top K, so it belongs to the math of a step.
    (c) capture     the base model's forward up to the last target layer on token ids already packed in memory, as
                    the pipeline configures it (`upcycle.activation_batches`: its `MlpCapture` with
                    train.capture_precision, its sequences per forward from train.capture_batch_sequences), in the
                    recipe's dtype, with train.tf32.
    (t) tokenize    for the diagnosis only: reading, splitting, shuffling, tokenizing and packing the train split
                    (`iter_sequences`), which (a) pays and (b), (c) do not.

Every stage covers the same steps x train.tokens_per_step tokens (the run's budget is set to exactly that). (b)
and (c) run before and after (a) and the faster pass is kept: the conservative reference on a shared machine (the
first pass also absorbs the process's warm-up). Each row gives wall seconds and tokens/s, and the process's CPU
seconds (all threads): on a machine shared with other jobs the CPU column is the steadier one, the wall column the
one the targets are judged on.

Targets (issue 14):
  * CPU: (a) <= 1.15 x ((b) + (c)).
  * CPU, `--variants 8`: 8 variants of the layer (one lr each, the recipe's lr times 2^(i/3) alternately up and
    down) trained together on one stream in one `distil` take <= 1.3 x ((a) + 7 x (b)), i.e. the time of one
    variant plus 7 more layer maths.
  * H100: the paper recipe at >= 700k tokens/s for (a).

Run (CPU, the quickstart: tiny-gpt2-shakespeare, shipped assets; on 2 cores ~4 min at the default 64 steps, ~10 min
with --variants 8, two to three times that when other jobs share the cores):

    python benchmarks/pipeline_throughput.py [--steps 64] [--variants 8]
        [--set layer.kind=transcoder] [--profile 25]

GPU (an H100; needs the gpt2 weights and the OpenWebText stream from the Hub, or any local text through
`--set data.source=text --set data.paths=[...]`): the paper recipe, fp32 as published and then bf16 with 4x larger
steps; `--device cuda` sets train.device (the base model runs in the recipe's `dtype`, the layers under bf16
autocast when train.precision is bf16; the clock synchronizes the GPU around every stage):

    python benchmarks/pipeline_throughput.py --recipe recipes/paper/mxd-gpt2-l8-mxd.yaml --device cuda \\
        --steps 512 --set train.warmup_steps=50
    python benchmarks/pipeline_throughput.py --recipe recipes/paper/mxd-gpt2-l8-mxd.yaml --device cuda \\
        --steps 256 --set train.warmup_steps=50 --set train.precision=bf16 --set train.tokens_per_step=16384 \\
        --variants 4

`--profile N` prints the N entries of a cProfile of (a) with the most own time (its numbers then include the
profiler's overhead; profile in a separate run from the timing). Token ids are moved to the device as the pipeline
moves them (plain copies: a (32, 128) int64 batch is 32 KB, too small for pinned memory to matter).
"""

import argparse
import cProfile
import io
import json
import math
import pstats
import sys
import tempfile
from pathlib import Path

import torch

from _timing import Seconds, synchronize, timed
from expertize.conversion import upcycle as up
from expertize.conversion.training.distill_plan import recipe_schedule
from expertize.conversion.data.mlp_pairs import excluded_token_ids, kept_positions
from expertize.conversion.data.text import iter_sequences
from expertize.conversion.preflight import plan_run, plan_variants
from expertize.conversion.publishing.run_folder import RunFolder
from expertize.conversion.recipe import load_recipe, recipe_from_dict, recipe_to_dict
from expertize.conversion.training.compute import matmul_precision
from expertize.conversion.device import make_accelerator
from expertize.conversion.training.distill import Trainer
from expertize.modeling import build_sparse_layer

POOL_STEPS = 64
"""At most this many distinct step batches are kept in memory for (b); longer runs cycle over them."""


def say(message: str) -> None:
    print(f"  [upcycle] {message}", file=sys.stderr)


def pipeline(recipe, *, progress: bool, profile: int = 0) -> dict:
    """Run upcycle's stages up to the distillation for `recipe` (with or without variants) and time `distil`:
    {"seconds": whole distil call, "loop": the first variant's train_log seconds (its training loop), "diverged":
    [names], "profile": text}."""
    if recipe.variants:
        runs = up.pending_variants(recipe, restart=False)
    else:
        runs = [(recipe, RunFolder(recipe.output_dir))]
    plans = plan_variants([r for r, _ in runs])
    accelerator = make_accelerator(plans[0].device)
    folders = [folder for _, folder in runs]
    for run_recipe, folder in runs:
        folder.claim(recipe_to_dict(run_recipe))
    base = up.load_base(plans[0], accelerator.device)
    built = []
    for plan in plans:
        torch.manual_seed(plan.recipe.train.seed)
        built.append(up.build_layers(plan, base, accelerator))  # its RNG state taken as upcycle's
    profiler = cProfile.Profile() if profile else None

    def distil():
        if profiler is not None:
            profiler.enable()
        try:
            return up.distil(plans, base, built, folders, accelerator, progress=progress, say=say)[1]
        finally:
            if profiler is not None:
                profiler.disable()

    seconds, diverged = timed(accelerator.device, distil)
    log = [json.loads(line) for line in folders[0].train_log.read_text().splitlines()]
    text = ""
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(profile)
        text = out.getvalue()
    return {"seconds": seconds, "loop": log[-1]["seconds"] if log else float("nan"), "diverged": sorted(diverged),
            "profile": text}


def capture(base, plan, sequences: list[torch.Tensor], device: torch.device) -> tuple[Seconds, list[dict]]:
    """(c): seconds of the base forwards over `sequences`; and up to POOL_STEPS step batches of the captured
    pairs ({layer: (x, y)}, the excluded special positions left out as in the pipeline) for (b)."""
    recipe = plan.recipe
    stream = up.activation_batches(recipe, base, plan.tokenizer, plan.layer_ids, plan.distill_steps, device)
    mlp_capture, per_forward = stream.capture, stream.capture_batch_sequences  # the pipeline's own settings
    tokens_per_step = recipe.train.tokens_per_step
    excluded = excluded_token_ids(recipe.data, plan.tokenizer)
    keep_sequences = math.ceil(min(len(sequences), POOL_STEPS * tokens_per_step / recipe.data.context_length))
    kept: list[tuple[dict, torch.Tensor]] = []

    def run():
        for start in range(0, len(sequences), per_forward):
            input_ids = torch.stack(sequences[start : start + per_forward]).to(device)  # (B, T)
            pairs = mlp_capture(input_ids)  # layer -> (x, y), each (B*T, d)
            if start < keep_sequences:
                kept.append((pairs, kept_positions(input_ids, excluded)))

    with matmul_precision(device, recipe.train.tf32):
        seconds, _ = timed(device, run)
    rows = {i: (torch.cat([p[i][0] for p, _ in kept]), torch.cat([p[i][1] for p, _ in kept])) for i in plan.layer_ids}
    keep = None if kept[0][1] is None else torch.cat([k for _, k in kept])  # (rows,) bool
    pool = []
    for s in range(min(POOL_STEPS, len(keep if keep is not None else rows[plan.layer_ids[0]][0]) // tokens_per_step)):
        window = slice(s * tokens_per_step, (s + 1) * tokens_per_step)
        take = (lambda t: t[window]) if keep is None else (lambda t, w=keep[window]: t[window][w])
        pool.append({i: (take(x), take(y)) for i, (x, y) in rows.items()})
    return seconds, pool


def layer_math(plan, pool: list[dict], steps: int, accelerator, folder: Path, warmup: int = 0) -> Seconds:
    """(b): seconds of `steps` training steps of the plan's sparse layers on the batches of `pool` (cycled), through
    the pipeline's own step code (the Trainer's loss, backward, optimizer step and bookkeeping) without its data,
    logging or checkpoints; after `warmup` untimed steps (e.g. to compile, train.compile)."""
    recipe = plan.recipe
    torch.manual_seed(recipe.train.seed)
    layers = {i: build_sparse_layer(plan.spec) for i in plan.layer_ids}
    trainer = Trainer(
        layers, None, recipe.train, total_steps=steps, accelerator=accelerator, checkpoint_path=folder / "state.pt",
        log_path=folder / "log.jsonl", progress=False,
    )
    trainer.model.train()

    def run(first: int, count: int):
        for step in range(first, first + count):
            if step == 0:
                trainer.first_batch(pool[0])  # b_dec from the first batch, as the pipeline starts
            loss, parts = trainer.compute_loss(pool[step % len(pool)])
            trainer._backward(loss)
            trainer._optimizer_step()
            trainer.track(parts)  # dead-unit trackers (AuxK from the step the pipeline turns it on), the balancer

    try:
        with matmul_precision(accelerator.device, recipe.train.tf32):
            run(0, warmup)
            seconds, _ = timed(accelerator.device, lambda: run(warmup, steps))
    finally:
        trainer.release()
    return seconds


def variants_recipe(recipe, n: int, output_dir: str):
    """`recipe` with `n` variants of its layer, one learning rate each (the recipe's, then x 2^(1/3), x 2^(-1/3),
    x 2^(2/3), ...), under `output_dir`. The recipe's rate is the one its distillation trains at: train.lr, or what
    `auto` resolves to for its kind and steps (`recipe_schedule`, the plan's rule)."""
    tree = recipe_to_dict(recipe)
    lr = recipe_schedule(recipe).lr
    factors = [1.0] + [2 ** (math.ceil(i / 2) / 3 * (1 if i % 2 else -1)) for i in range(1, n)]
    tree["variants"] = [{"name": f"v{i}-lr{lr * f:.3g}", "train": {"lr": lr * f}} for i, f in enumerate(factors)]
    tree["output_dir"] = output_dir
    return recipe_from_dict(tree, source="variants")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(Path(__file__).parent.parent / "recipes" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=64, help="training steps of every stage (sets data.train_tokens)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="train.device of the run")
    parser.add_argument("--variants", type=int, default=1, help="also train N variants together (N > 1)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override, as `expertize upcycle --set` (repeatable)")
    parser.add_argument("--kind", help="shortcut for --set layer.kind=KIND")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the top N cProfile entries of (a)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (default: torch's; 1 is steadier on a machine shared with other jobs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar in (a) (upcycle shows one)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = list(args.overrides) + ([f"layer.kind={args.kind}"] if args.kind else [])

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        probe = load_recipe(args.recipe, overrides)
        tokens = args.steps * probe.train.tokens_per_step
        recipe = load_recipe(args.recipe, overrides + [
            f"output_dir={tmp}/one", f"train.device={args.device}", f"data.train_tokens={tokens}",
        ])
        plan = plan_run(recipe)
        device = plan.device
        accelerator = make_accelerator(device)
        base = up.load_base(plan, device)
        data, train = recipe.data, recipe.train

        t_tokenize, sequences = timed(device, lambda: list(iter_sequences(data, plan.tokenizer, split="train")))
        captures, maths = [], []

        def references(label: str) -> None:
            seconds, pool = capture(base, plan, sequences, device)
            captures.append(seconds)
            maths.append(layer_math(plan, pool, args.steps, accelerator, tmp / f"math-{label}"))

        references("before")
        one = pipeline(recipe, progress=not args.no_progress, profile=args.profile)
        many = None
        if args.variants > 1:
            many = pipeline(variants_recipe(recipe, args.variants, f"{tmp}/many"), progress=not args.no_progress)
        references("after")
        synchronize(device)

    # Per measure, the faster of the two passes of (b) and (c) (the conservative reference).
    t_capture = Seconds(min(c.wall for c in captures), min(c.cpu for c in captures))
    t_math = Seconds(min(m.wall for m in maths), min(m.cpu for m in maths))
    reference = t_capture + t_math
    name = recipe.base_model.rstrip("/").split("/")[-1]
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    print(f"\n{name} layers {plan.layer_ids}, {recipe.layer.kind} {plan.spec.num_parameters():,} params, "
          f"{args.steps} steps x {train.tokens_per_step} tokens ({tokens:,}), dtype {recipe.dtype}, "
          f"precision {train.precision}, {device}{threads}")
    print(f"{'stage':<36}{'seconds':>9}{'tokens/s':>11}{'x (b+c)':>9}{'CPU s':>9}{'x (b+c)':>9}")

    def row(label: str, t: Seconds, n_tokens: int = tokens, ref: Seconds = reference) -> None:
        print(f"{label:<36}{t.wall:>9.2f}{n_tokens / t.wall:>11,.0f}{t.wall / ref.wall:>9.2f}{t.cpu:>9.2f}"
              f"{t.cpu / ref.cpu:>9.2f}")

    row("(t) tokenize + pack (diagnosis)", t_tokenize)
    row("(c) capture forward", t_capture)
    row("(b) layer math", t_math)
    row("(b+c)", reference)
    row("(a) pipeline: distil", one["seconds"])
    print(f"{'    of which the training loop':<36}{one['loop']:>9.2f}{tokens / one['loop']:>11,.0f}"
          f"{one['loop'] / reference.wall:>9.2f}")
    ratio = one["seconds"].wall / reference.wall
    print(f"target (a) <= 1.15 x (b+c): {'PASS' if ratio <= 1.15 else 'FAIL'} ({ratio:.2f}x wall, "
          f"{one['seconds'].cpu / reference.cpu:.2f}x CPU; passes of (c) "
          f"{', '.join(f'{c.wall:.2f}' for c in captures)} s, of (b) {', '.join(f'{m.wall:.2f}' for m in maths)} s)")
    if many is not None:
        n = args.variants
        expected = one["seconds"] + t_math * (n - 1)
        print(f"{f'(a) 1 variant + {n - 1} x (b)':<36}{expected.wall:>9.2f}{n * tokens / expected.wall:>11,.0f}"
              f"{'':>9}{expected.cpu:>9.2f}   (variant-tokens/s)")
        print(f"{f'(a) {n} variants on one stream':<36}{many['seconds'].wall:>9.2f}"
              f"{n * tokens / many['seconds'].wall:>11,.0f}{'':>9}{many['seconds'].cpu:>9.2f}")
        v_ratio = many["seconds"].wall / expected.wall
        print(f"target {n} variants <= 1.3 x (1 variant + {n - 1} x (b)): {'PASS' if v_ratio <= 1.3 else 'FAIL'} "
              f"({v_ratio:.2f}x wall, {many['seconds'].cpu / expected.cpu:.2f}x CPU)"
              + (f"; diverged: {', '.join(many['diverged'])}" if many["diverged"] else ""))
    if one["profile"]:
        print(f"\ncProfile of (a), top {args.profile} by own time (includes the profiler's overhead):")
        print(one["profile"])


if __name__ == "__main__":
    main()
