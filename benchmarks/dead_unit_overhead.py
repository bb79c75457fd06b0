"""What the dead-unit handling costs per training step: the distillation trainer's whole step (forward, loss,
backward, AdamW, the dead-unit trackers and the handling's own work) with each method, side by side in one run.

    none       train.balance none, auxk_coef 0
    floor      train.balance floor (the default): a biased top-K choice and one update of the bias per step
    bias       train.balance bias (DeepSeek-V3's symmetric rule): the same work, another update rule
    auxk       AuxK (coef 1/32) reusing the forward's dense pre-activations (and MxD's Dᵀz), as the trainer runs it
    auxk-old   AuxK recomputing them (the previous implementation: a second dense gate product and hidden path)

Every unit is marked dead from the first step (a 1-step window) so that AuxK runs on every step. The steps of all
methods alternate within every round (benchmarks/_timing.py), so a slow drift of a shared machine hits them alike;
the median step time and its ratio to `none` are printed. Shapes: the quickstart's (d 128, MLP 512, N 3,584, K 16)
and GPT-2 small's at the 8x budget (d 768, MLP 3,072), 1,024 tokens per step, fp32, CPU threads as set.

Run:  python benchmarks/dead_unit_overhead.py [--tokens 1024] [--repeats 20] [--threads 2]
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from _timing import round_robin_times

SHAPES = {  # name: spec fields
    "quickstart MxD (d 128, N 3,584)": dict(kind="mxd", d_in=128, d_out=128, d_hidden=512, num_experts=3584, k=16,
                                            activation="gelu_new"),
    "GPT-2 MxD 8x (d 768, N 2,688)": dict(kind="mxd", d_in=768, d_out=768, d_hidden=3072, num_experts=2688, k=32,
                                          activation="gelu_new"),
    "GPT-2 transcoder 8x (d 768, L 6,144)": dict(kind="transcoder", d_in=768, d_out=768, num_latents=6144, k=32),
}
METHODS = {
    "none": dict(balance="none", auxk_coef=0.0),
    "floor": dict(balance="floor", auxk_coef=0.0),
    "bias": dict(balance="bias", auxk_coef=0.0),
    "auxk": dict(balance="none", auxk_coef=1 / 32, dead_window_tokens=1),
    "auxk-old": dict(balance="none", auxk_coef=1 / 32, dead_window_tokens=1),
}


class _Stream:
    """ActivationBatches' interface: the same in-memory batch every step."""

    def __init__(self, batch: dict) -> None:
        self.batch = batch

    def batches(self, start_step: int = 0):
        while True:
            yield self.batch


def _trainer(spec: dict, method: str, batch: dict, folder: Path, steps: int):
    from expertize.conversion.recipe import TrainConfig
    from expertize.conversion.device import make_accelerator
    from expertize.conversion.training.distill import Trainer
    from expertize.modeling import build_sparse_layer

    torch.manual_seed(0)
    layer = build_sparse_layer({**spec, "selection_bias": METHODS[method]["balance"] != "none"})
    cfg = TrainConfig(lr=1e-3, warmup_steps=0, tokens_per_step=batch[0][0].shape[0], checkpoint_every=0,
                      log_every=10**9, device="cpu", **METHODS[method])
    trainer = Trainer({0: layer}, _Stream(batch), cfg, total_steps=steps, accelerator=make_accelerator(torch.device(
        "cpu")), run_dir=folder, progress=False)
    trainer.open()
    return trainer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from expertize.modeling import SparseLayer

    keep = SparseLayer._keep
    print(f"torch {torch.__version__}, {args.threads} threads, {args.tokens} tokens per step, median of "
          f"{args.repeats} steps per method (round robin, {args.warmup} warm-up rounds)\n")
    print("| shape | method | ms / step | x none |\n|---|---|---:|---:|")
    for shape, spec in SHAPES.items():
        gen = torch.Generator().manual_seed(1)
        d = spec["d_in"]
        batch = {0: (torch.randn(args.tokens, d, generator=gen), torch.randn(args.tokens, d, generator=gen))}
        steps = args.warmup + args.repeats + 1
        with tempfile.TemporaryDirectory() as tmp:
            trainers = {}
            for method in METHODS:
                trainers[method] = _trainer(spec, method, batch, Path(tmp) / method, steps)

            def step(method):
                trainer = trainers[method]
                if method == "auxk-old":  # the forward keeps nothing: AuxK recomputes its dense products
                    SparseLayer._keep = lambda self, source, **tensors: None
                try:
                    trainer.train_step(batch)
                finally:
                    SparseLayer._keep = keep

            times = round_robin_times({m: (lambda m=m: step(m)) for m in trainers}, args.warmup, args.repeats)
        base = statistics.median(times["none"])
        for method, values in times.items():
            median = statistics.median(values)
            print(f"| {shape} | {method} | {median * 1e3:.1f} | {median / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
