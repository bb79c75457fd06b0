"""Training throughput of the distillation pipeline next to the same steps done bare.

    pipeline : `Trainer.fit` as `expertize upcycle` runs it — data stream, capture hooks, chunked shuffle buffer,
               loss, AdamW, schedule, L0 / dead-unit tracking, progress bar, JSONL log, checkpoints.
    bare     : for the same number of steps and the same batch size, a base forward that stops after the last target
               layer (same hooks, batches pre-tokenized in memory), the sparse layers' forward/backward on the captured
               tokens and an AdamW step — nothing else.

Both run in one process, side by side, on the real checkpoint; the ratio is the pipeline's overhead. Target: ≤ 1.20.

    EXPERTIZE_DATA=/path/to/shared/data python benchmarks/pipeline_throughput.py [--steps 60] [--kind mxd]
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from expertize.conversion.data.capture import MlpCapture
from expertize.conversion.data.text import iter_sequences
from expertize.conversion.evaluation.metrics import LOSSES
from expertize.conversion.publishing.run_folder import RunFolder
from expertize.conversion.recipe import load_recipe, resolve_layer_spec
from expertize.conversion.surgery.splice import base_family, load_base_model
from expertize.conversion.training.distill import SparseStack, Trainer
from expertize.conversion.upcycle import activation_batches
from expertize.modeling import FAMILIES, build_sparse_layer
from transformers import AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(Path(__file__).parent.parent / "recipes" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kind", default="mxd", choices=["mxd", "transcoder", "skip_transcoder"])
    args = parser.parse_args()
    if "EXPERTIZE_DATA" not in os.environ:
        parser.error("set EXPERTIZE_DATA to the shared data folder (models/, corpora/)")

    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(args.recipe, [f"layer.kind={args.kind}", f"output_dir={tmp}/run", "train.device=cpu",
                                           "train.log_every=5", "train.checkpoint_every=1000000"])
        train, data = recipe.train, recipe.data
        base = load_base_model(recipe.base_model).eval().requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(recipe.base_model)
        shape = FAMILIES[base_family(base.config.model_type)][0].mlp_shape(base.config)
        spec = resolve_layer_spec(recipe.layer, shape)
        layers_idx = sorted(recipe.layers)

        def fresh_layers():
            torch.manual_seed(0)
            return {i: build_sparse_layer(spec) for i in layers_idx}

        # Bare: batches tokenized up front (not timed), then capture + train step only.
        seq_per_step = train.tokens_per_step // data.context_length
        sequences = list(iter_sequences(data, tokenizer, split="train"))[: args.steps * seq_per_step]
        steps = len(sequences) // seq_per_step
        capture = MlpCapture(base, layers_idx)
        loss_fn = LOSSES[train.loss]

        def run_bare(n_steps: int) -> float:
            stack = SparseStack(fresh_layers())
            optimizer = torch.optim.AdamW(stack.parameters(), lr=train.lr)
            start = time.perf_counter()
            for step in range(n_steps):
                ids = torch.stack(sequences[step * seq_per_step : (step + 1) * seq_per_step])  # (B, T)
                pairs = capture(ids)
                out = stack({str(i): x for i, (x, _) in pairs.items()})
                sum(loss_fn(out[str(i)], y) for i, (_, y) in pairs.items()).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - start

        run_bare(5)  # warm-up (allocator, lazy init), not timed
        bare_first = run_bare(steps)

        # Pipeline: the real trainer, data streamed and shuffled as in `expertize upcycle`.
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        batches = activation_batches(recipe, base, tokenizer, layers_idx, steps, torch.device("cpu"))
        trainer = Trainer(fresh_layers(), batches, train, total_steps=steps, run_dir=run_dir,
                          accelerator=Accelerator(cpu=True), progress=True)
        start = time.perf_counter()
        trainer.fit()
        pipeline = time.perf_counter() - start
        log = [json.loads(line) for line in RunFolder(run_dir).train_log.read_text().splitlines()]
        # Steady state: from the first log record on (the stream's start-up, tokenizing the document shuffle buffer
        # and the first chunk, is excluded; it is paid once per run).
        steady_steps = log[-1]["step"] - log[0]["step"]
        steady = (log[-1]["seconds"] - log[0]["seconds"]) / steady_steps * steps
        # Bare again after the pipeline; the faster bare run is the reference (the conservative choice).
        bare = min(bare_first, run_bare(steps))

    tokens = steps * train.tokens_per_step
    print(f"\n{recipe.base_model.split('/')[-1]} layers {layers_idx}, {args.kind} {spec.num_parameters():,} params, "
          f"{steps} steps x {train.tokens_per_step} tokens, CPU {torch.get_num_threads()} threads")
    print(f"{'run':<10}{'seconds':>10}{'tokens/s':>12}{'ratio':>8}")
    print(f"{'bare':<10}{bare:>10.2f}{tokens / bare:>12,.0f}{1.0:>8.2f}")
    print(f"{'pipeline':<10}{pipeline:>10.2f}{tokens / pipeline:>12,.0f}{pipeline / bare:>8.2f}   (whole fit, start-up included)")
    print(f"{'steady':<10}{steady:>10.2f}{tokens / steady:>12,.0f}{steady / bare:>8.2f}   (pipeline per-step rate x {steps})")
    print(f"target  steady-state pipeline overhead <= 20%: {'PASS' if steady / bare <= 1.2 else 'FAIL'} "
          f"({(steady / bare - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
