"""Secret MoEs on real activations: a routed single-neuron MoE vs a dense narrow MLP with as many active neurons.

The claim ("Secret mixtures of experts inside your LLM", Boix-Adsera 2025; shared/papers/digests/secret_moe.md): one
MLP of a pretrained LM, distilled into a MoE of single-neuron experts plus shared neurons, reaches a lower held-out
FVU than a dense MLP with the same number of *active* neurons (MoE/MLP FVU ratio about 0.4-0.7 on real data). With
Gaussian inputs of the same mean and covariance the advantage mostly disappears (ratio about 0.85-1.1): the MoE
exploits the (dictionary-)sparse structure of real activations.

This script checks that on the real checkpoints of the shared data folder, on a budget a laptop CPU affords:

    tiny-gpt2-shakespeare  layer 2 of 4, d 128, gelu_new MLP 512     corpora/tinyshakespeare.txt
    stories260k            layer 2 of 5, d 64, SwiGLU MLP 172         corpora/stories260k_samples.txt

For each model and each number A of active neurons, two students, trained the same way on the same tokens:

    routed MoE    `routed_neurons` (the library's layer): N single-neuron experts, top-k = A/2 routed by a low-rank
                  router (d -> r -> N) with softmax over the selected logits, plus A/2 shared neurons (the paper's
                  even split, Table 1); so A active neurons per token.
    dense narrow  a plain MLP of width A, Linear(d, A) -> φ -> Linear(A, d), biases: the paper's MLP student. Its
                  init is that of routed_neurons' shared neurons (inputs U(±1/√d), output rows 0, b_dec = mean output).

(`routed_neurons` with num_experts = k is *not* a dense MLP: each neuron is scaled by a softmax gate that sums to 1
over the K neurons, so it is checked and reported at start-up, and the dense student is a plain nn.Module. With
num_experts = k = 1 the single routed neuron has gate 1 and the layer equals a dense MLP of width num_shared + 1.)

and two input distributions:

    real       the MLP's real inputs (post-LayerNorm / RMSNorm), captured on the corpus with the library's pipeline
               (packed sequences from `iter_sequences`, `MlpCapture` hooks); targets: the real MLP outputs.
               Held out: the held-out documents (`load_eval_sequences`, 10% of documents by a stable hash).
    gaussian   samples of N(μ, Σ), μ and Σ the mean and covariance of the real *training* inputs (+ 1e-6·tr Σ/d
               jitter);
               targets: the same dense MLP applied to them. Held out: fresh samples. Same token counts as `real`.

Training (the paper's recipe on a smaller budget): Adam (default betas, no weight decay), MSE on the layer output,
batch 1,024 tokens, cosine decay to 0 without warm-up, one pass over the training tokens, no gradient clipping; the
same seed and data order for both students. Learning rate: each student (per model, inputs and A) is trained with every
rate of `--lrs` (default 3e-3, 1e-2, 3e-2) and keeps the one with the lower FVU on a validation split (8,192 held-out
tokens of other documents / fresh Gaussian samples, disjoint from the test tokens); the paper picks the best of
{1e-3, 3e-4, 1e-4} on its test split, but trains ~2,000x longer. FVU (`expertize.conversion.training.losses.fvu`) on held-out
test tokens: Σ‖ŷ − y‖² / Σ‖y − ȳ‖², as the paper's test MSE / output variance. Ratio = FVU(MoE) / FVU(dense): < 1
means the MoE wins.

Budget caveat: 320 steps is far from convergence for the MoE (a pilot on tiny-gpt2-shakespeare real inputs, A = 64:
MoE FVU 0.288 after 192 steps, 0.190 after 768; dense 0.535 and 0.493, and 0.482 after 3,072 steps), so short
budgets understate the MoE's advantage rather than overstate it; `--epochs` repeats the training tokens.

Run:  EXPERTIZE_DATA=/path/to/shared/data python benchmarks/secret_moe.py
      python benchmarks/secret_moe.py --data /path/to/shared/data --models stories260k --train-tokens 65536

Default budget: 327,680 training tokens per run (320 steps of 1,024), 3 learning rates per student, 32 configurations
(2 models x 2 input distributions x 4 A x 2 students): about 3 minutes on 2 idle CPU cores (measured 3m06s), several
times that when the cores are shared.
"""

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

# name: (model folder, corpus, document separator, layer, active neurons, routed experts N, router rank r)
MODELS = {
    "tiny-gpt2-shakespeare": ("models/tiny-gpt2-shakespeare", "corpora/tinyshakespeare.txt", "blank_line", 2,
                              (8, 16, 32, 64), 2048, 32),
    "stories260k": ("models/stories260k", "corpora/stories260k_samples.txt", "line", 2, (4, 8, 16, 32), 1024, 16),
}
DISTRIBUTIONS = ("real", "gaussian")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", default=os.environ.get("EXPERTIZE_DATA"),
                   help="shared data folder holding models/ and corpora/ (default: $EXPERTIZE_DATA)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--distributions", default=",".join(DISTRIBUTIONS), help="comma-separated subset of real,gaussian")
    p.add_argument("--active", default=None,
                   help="comma-separated active-neuron counts A (even; A/2 routed + A/2 shared), the same for every "
                        "model (default per model: " + "; ".join(f"{m} {','.join(map(str, v[4]))}"
                                                                  for m, v in MODELS.items()) + ")")
    p.add_argument("--num-experts", type=int, default=None,
                   help="N routed single-neuron experts (default per model: "
                        + ", ".join(f"{m} {v[5]}" for m, v in MODELS.items()) + ")")
    p.add_argument("--router-rank", type=int, default=None,
                   help="r of the low-rank router d -> r -> N (default d/4: "
                        + ", ".join(f"{m} {v[6]}" for m, v in MODELS.items()) + "; the paper: 128 for d = 512)")
    p.add_argument("--activation", default="gelu", help="φ of both students (default gelu, the paper's)")
    p.add_argument("--train-tokens", type=int, default=327_680,
                   help="training tokens per run (default 327,680 = 320 steps of 1,024, just under the 343,808 "
                        "training tokens tinyshakespeare gives at context 128)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training tokens (default 1)")
    p.add_argument("--eval-tokens", type=int, default=32_768, help="held-out test tokens (default 32,768)")
    p.add_argument("--tokens-per-step", type=int, default=1024, help="batch size in tokens (default 1,024, paper's)")
    p.add_argument("--lrs", default="3e-3,1e-2,3e-2",
                   help="Adam learning rate(s); with several, each student (per model, inputs and A) keeps the one "
                        "with the lowest FVU on a validation split disjoint from the test tokens (default "
                        "3e-3,1e-2,3e-2)")
    p.add_argument("--val-tokens", type=int, default=8_192,
                   help="validation tokens for --lrs selection (used only with several rates; default 8,192: "
                        "tinyshakespeare holds out 42,240 tokens)")
    p.add_argument("--context-length", type=int, default=128, help="tokens per packed sequence (default 128)")
    p.add_argument("--seed", type=int, default=0, help="data split, sampling, init and order seed (default 0)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    return p.parse_args()


# -- students --------------------------------------------------------------------------------------------------------


class DenseMlp(nn.Module):
    """y = W_dec φ(W_enc x + b_enc) + b_dec, width A; init as routed_neurons' shared neurons (decoder_init zeros)."""

    def __init__(self, d: int, width: int, activation: str) -> None:
        super().__init__()
        from expertize.modeling.sparse_base import ACTIVATIONS, linear_bound, uniform_

        self.act = ACTIVATIONS[activation]
        self.W_enc = nn.Parameter(torch.empty(width, d))  # (A, I)
        self.b_enc = nn.Parameter(torch.empty(width))  # (A,)
        self.W_dec = nn.Parameter(torch.zeros(width, d))  # (A, O)
        self.b_dec = nn.Parameter(torch.zeros(d))  # (O,)
        uniform_(self.W_enc, linear_bound(d))
        uniform_(self.b_enc, linear_bound(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(F.linear(x, self.W_enc, self.b_enc)) @ self.W_dec + self.b_dec  # (T, O)


def routed_moe(d: int, active: int, num_experts: int, router_rank: int, activation: str) -> nn.Module:
    from expertize.modeling import RoutedNeuronsSpec, build_sparse_layer

    k = active // 2
    return build_sparse_layer(RoutedNeuronsSpec(d_in=d, d_out=d, num_experts=num_experts, k=k, num_shared=active - k,
                                                router_rank=router_rank, activation=activation))


def equivalence_check(activation: str) -> str:
    """How routed_neurons relates to a dense MLP: num_experts = k gates its neurons by a softmax (not dense);
    num_experts = k = 1 plus shared neurons is dense. Returns a one-paragraph report with the measured differences."""
    from expertize.modeling import RoutedNeuronsSpec, build_sparse_layer

    torch.manual_seed(0)
    d, width = 16, 8
    x = torch.randn(256, d, dtype=torch.float64)
    dense = DenseMlp(d, width, activation).double()
    with torch.no_grad():
        dense.W_dec.normal_()
        dense.b_dec.normal_()
    # (a) N = K = width, no shared neurons, the same neuron weights.
    all_routed = build_sparse_layer(RoutedNeuronsSpec(d_in=d, d_out=d, num_experts=width, k=width, num_shared=0,
                                                      activation=activation, router_rank=4)).double()
    # (b) N = K = 1 routed neuron (gate softmax of one logit = 1) + width - 1 shared neurons.
    one_routed = build_sparse_layer(RoutedNeuronsSpec(d_in=d, d_out=d, num_experts=1, k=1, num_shared=width - 1,
                                                      activation=activation, router_rank=4)).double()
    with torch.no_grad():
        for layer in (all_routed, one_routed):
            layer.b_dec.copy_(dense.b_dec)
        all_routed.W_enc.copy_(dense.W_enc)
        all_routed.b_enc.copy_(dense.b_enc)
        all_routed.W_dec.copy_(dense.W_dec)
        one_routed.W_enc.copy_(dense.W_enc[:1])
        one_routed.b_enc.copy_(dense.b_enc[:1])
        one_routed.W_dec.copy_(dense.W_dec[:1])
        one_routed.W_shared_enc.copy_(dense.W_enc[1:])
        one_routed.b_shared_enc.copy_(dense.b_enc[1:])
        one_routed.W_shared_dec.copy_(dense.W_dec[1:])
        y = dense(x)
        scale = (y - dense.b_dec).abs().max().item()
        diff_all = (all_routed(x) - y).abs().max().item() / scale
        diff_one = (one_routed(x) - y).abs().max().item() / scale
    return (f"routed_neurons(num_experts=k={width}, no shared) vs a dense MLP of width {width} with the same neuron "
            f"weights: max |Δy| / max |y - b| = {diff_all:.3f} (not dense: every neuron is scaled by a softmax gate "
            f"summing to 1); routed_neurons(num_experts=k=1, num_shared={width - 1}): {diff_one:.1e} (dense). The "
            "dense student below is a plain module.")


# -- data ------------------------------------------------------------------------------------------------------------


def capture_pairs(base, tokenizer, data_cfg, layer: int, split: str, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) = (MLP input, MLP output) at `layer` on the first `tokens` tokens of the split, (tokens, d) each."""
    from expertize.conversion.data.mlp_pairs import MlpCapture
    from expertize.conversion.data.text import batch_sequences, iter_sequences, load_eval_sequences

    capture = MlpCapture(base, [layer])
    if split == "train":
        sequences = iter_sequences(data_cfg, tokenizer, split="train")
    else:
        sequences = iter(load_eval_sequences(data_cfg, tokenizer))
    xs, ys = [], []
    for ids in batch_sequences(sequences, 32):
        x, y = capture(ids)[layer]
        xs.append(x.float())
        ys.append(y.float())
    x, y = torch.cat(xs), torch.cat(ys)
    if x.shape[0] < tokens:
        raise SystemExit(f"error: the {split} split gives only {x.shape[0]:,} tokens, fewer than the {tokens:,} "
                         "asked; lower --train-tokens / --eval-tokens / --val-tokens")
    return x[:tokens], y[:tokens]


def gaussian_like(x: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """n samples of N(mean(x), cov(x) + 1e-6·tr(cov)/d·I), float32 (computed in float64)."""
    x64 = x.double()
    mu = x64.mean(0)
    cov = torch.cov(x64.T)
    d = cov.shape[0]
    cov = cov + 1e-6 * cov.trace() / d * torch.eye(d, dtype=torch.float64)
    chol = torch.linalg.cholesky(cov)
    z = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return (mu + z @ chol.T).float()


@torch.no_grad()
def apply_mlp(mlp: nn.Module, x: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    return torch.cat([mlp(x[i : i + chunk]) for i in range(0, x.shape[0], chunk)])


# -- training --------------------------------------------------------------------------------------------------------


def train_student(student: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float, tokens_per_step: int,
                  seed: int, epochs: int = 1) -> None:
    """`epochs` passes over (x, y), each in its own seeded order: Adam, MSE, cosine decay to 0 over all steps, b_dec =
    mean output of the first batch."""
    from expertize.conversion.training.losses import LOSSES
    from expertize.conversion.recipe import TrainConfig
    from expertize.conversion.training.engine import lr_lambda

    per_epoch = x.shape[0] // tokens_per_step
    steps = per_epoch * epochs
    cfg = TrainConfig(lr=lr, warmup_steps=0, schedule="cosine", min_lr_ratio=0.0, tokens_per_step=tokens_per_step,
                      loss="mse", grad_clip=None, shuffle_buffer_tokens=tokens_per_step)
    gen = torch.Generator().manual_seed(seed)
    used = per_epoch * tokens_per_step
    order = torch.cat([torch.randperm(x.shape[0], generator=gen)[:used] for _ in range(epochs)])
    optimizer = torch.optim.Adam(student.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, steps))
    loss_fn = LOSSES[cfg.loss]
    student.train()
    with torch.no_grad():
        student.b_dec.copy_(y[order[:tokens_per_step]].mean(0))
    for step in range(steps):
        idx = order[step * tokens_per_step : (step + 1) * tokens_per_step]
        loss = loss_fn(student(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    student.eval()


@torch.no_grad()
def held_out_fvu(student: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 8192) -> float:
    from expertize.conversion.training.losses import fvu

    return float(fvu(torch.cat([student(x[i : i + chunk]) for i in range(0, x.shape[0], chunk)]), y))


def fit_and_score(make, data: dict, lrs: list[float], args) -> tuple[float, float, float | None]:
    """Train one student per learning rate (same seed); returns (test FVU, chosen lr, its validation FVU)."""
    best = None
    for lr in lrs:
        torch.manual_seed(args.seed)
        student = make()
        train_student(student, data["x_train"], data["y_train"], lr, args.tokens_per_step, args.seed, args.epochs)
        val = held_out_fvu(student, data["x_val"], data["y_val"]) if len(lrs) > 1 else None
        if best is None or (val is not None and val < best[0]):
            best = (val, lr, student)
    val, lr, student = best
    return held_out_fvu(student, data["x_test"], data["y_test"]), lr, val


# -- main ------------------------------------------------------------------------------------------------------------


def _split_list(text: str, cast) -> list:
    return [cast(v.strip()) for v in text.split(",") if v.strip()]


def main() -> int:
    args = parse_args()
    if not args.data:
        print("error: give --data or set EXPERTIZE_DATA to the shared data folder (models/, corpora/)",
              file=sys.stderr)
        return 2
    data_root = Path(args.data)
    if not (data_root / "models").is_dir():
        print(f"error: {data_root} has no models/ folder; EXPERTIZE_DATA / --data must point at the shared data "
              "folder (models/, corpora/)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from expertize.conversion.data.mlp_pairs import decoder_blocks
    from expertize.conversion.recipe.data import DataConfig
    from expertize.conversion.surgery.splice import load_base_model
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    models = _split_list(args.models, str)
    distributions = _split_list(args.distributions, str)
    lrs = _split_list(args.lrs, float)
    for m in models:
        if m not in MODELS:
            print(f"error: unknown model {m!r}; choose from {', '.join(MODELS)}", file=sys.stderr)
            return 2
    for dist in distributions:
        if dist not in DISTRIBUTIONS:
            print(f"error: unknown distribution {dist!r}; choose from {', '.join(DISTRIBUTIONS)}", file=sys.stderr)
            return 2
    active_override = _split_list(args.active, int) if args.active else None
    if active_override and any(a < 2 or a % 2 for a in active_override):
        print("error: --active values must be even and >= 2 (A/2 routed + A/2 shared neurons)", file=sys.stderr)
        return 2
    steps = args.train_tokens // args.tokens_per_step
    if steps < 1 or args.epochs < 1:
        print("error: --train-tokens must cover at least one step of --tokens-per-step, and --epochs be >= 1",
              file=sys.stderr)
        return 2
    train_tokens = steps * args.tokens_per_step
    val_tokens = args.val_tokens if len(lrs) > 1 else 0

    selection = f" (best per student on {val_tokens:,} validation tokens)" if len(lrs) > 1 else ""
    print(f"Secret MoEs: routed single-neuron MoE (routed_neurons, A/2 routed + A/2 shared, low-rank router, softmax "
          f"over the top-k) vs dense narrow MLP of width A; students' activation {args.activation}; {train_tokens:,} "
          f"training tokens per run ({args.epochs} pass(es), {steps * args.epochs} steps x {args.tokens_per_step}), "
          f"Adam lr {'/'.join(f'{lr:g}' for lr in lrs)}{selection}, "
          f"cosine to 0, MSE loss, no clipping; test FVU on {args.eval_tokens:,} held-out tokens; seed {args.seed}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    print(equivalence_check(args.activation), flush=True)

    rows, start = [], time.perf_counter()
    for model in models:
        model_dir, corpus, separator, layer, default_active, default_n, default_r = MODELS[model]
        actives = active_override or list(default_active)
        num_experts = args.num_experts or default_n
        router_rank = args.router_rank or default_r
        t0 = time.perf_counter()
        base = load_base_model(str(data_root / model_dir), dtype=torch.float32).eval().requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(str(data_root / model_dir))
        mlp = decoder_blocks(base)[layer].mlp
        data_cfg = DataConfig(source="text", paths=[str(data_root / corpus)], document_separator=separator,
                              context_length=args.context_length, train_tokens=train_tokens,
                              eval_tokens=args.eval_tokens + val_tokens, eval_fraction=0.1, seed=args.seed)
        x_train, y_train = capture_pairs(base, tokenizer, data_cfg, layer, "train", train_tokens)
        x_held, y_held = capture_pairs(base, tokenizer, data_cfg, layer, "eval", args.eval_tokens + val_tokens)
        d = x_train.shape[1]
        gen = torch.Generator().manual_seed(args.seed + 1)
        conditions = {}
        for dist in distributions:
            if dist == "real":
                x_test, y_test = x_held[: args.eval_tokens], y_held[: args.eval_tokens]
                x_val, y_val = x_held[args.eval_tokens :], y_held[args.eval_tokens :]
                xt, yt = x_train, y_train
            else:
                xt = gaussian_like(x_train, train_tokens, gen)
                x_test = gaussian_like(x_train, args.eval_tokens, gen)
                x_val = gaussian_like(x_train, val_tokens, gen)
                yt, y_test, y_val = apply_mlp(mlp, xt), apply_mlp(mlp, x_test), apply_mlp(mlp, x_val)
            conditions[dist] = {"x_train": xt, "y_train": yt, "x_test": x_test, "y_test": y_test, "x_val": x_val,
                                "y_val": y_val}
            variance = float((y_test - y_test.mean(0)).pow(2).sum(1).mean())
            print(f"  {model} L{layer} (d {d}, base MLP {type(mlp).__name__}) {dist}: {xt.shape[0]:,} train / "
                  f"{x_test.shape[0]:,} test tokens, test output variance tr Cov(y) = {variance:.4g}", flush=True)
        print(f"  {model}: data ready in {time.perf_counter() - t0:.0f}s; routed experts N = {num_experts}, router "
              f"rank r = {router_rank}, active neurons A = {actives}", flush=True)
        for dist in distributions:
            data = conditions[dist]
            for active in actives:
                t1 = time.perf_counter()
                fvu_moe, lr_moe, _ = fit_and_score(
                    lambda: routed_moe(d, active, num_experts, router_rank, args.activation), data, lrs, args)
                t2 = time.perf_counter()
                fvu_dense, lr_dense, _ = fit_and_score(lambda: DenseMlp(d, active, args.activation), data, lrs, args)
                t3 = time.perf_counter()
                row = {"model": model, "layer": layer, "dist": dist, "active": active, "k": active // 2,
                       "shared": active - active // 2, "num_experts": num_experts, "fvu_moe": fvu_moe,
                       "fvu_dense": fvu_dense, "ratio": fvu_moe / fvu_dense, "lr_moe": lr_moe, "lr_dense": lr_dense,
                       "seconds_moe": t2 - t1, "seconds_dense": t3 - t2}
                rows.append(row)
                print(f"  {model} {dist:<8} A={active:<3} FVU MoE {fvu_moe:.4f} dense {fvu_dense:.4f} ratio "
                      f"{row['ratio']:.3f} [{t2 - t1:.0f}s + {t3 - t2:.0f}s]", flush=True)
    wall = time.perf_counter() - start

    multi = len(lrs) > 1
    cols = ["model", "layer", "inputs", "active neurons A", "routed k + shared", "experts N", "FVU routed MoE",
            "FVU dense narrow", "ratio MoE/dense"] + (["lr MoE", "lr dense"] if multi else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        cells = [r["model"], str(r["layer"]), r["dist"], str(r["active"]), f"{r['k']} + {r['shared']}",
                 f"{r['num_experts']:,}", f"{r['fvu_moe']:.4f}", f"{r['fvu_dense']:.4f}", f"{r['ratio']:.3f}"]
        if multi:
            cells += [f"{r['lr_moe']:g}", f"{r['lr_dense']:g}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Geometric mean of the ratio FVU(MoE)/FVU(dense) over A (paper, Pythia/Gemma: about 0.4-0.7 real, "
              "0.85-1.1 Gaussian):", "", "| model | real | gaussian |", "|---|---|---|"]
    for model in models:
        cells = []
        for dist in DISTRIBUTIONS:
            ratios = [r["ratio"] for r in rows if r["model"] == model and r["dist"] == dist]
            cells.append(f"{math.exp(statistics.fmean(math.log(v) for v in ratios)):.3f}" if ratios else "n/a")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    print()
    print("\n".join(lines))
    print(f"\nwall time {wall:.0f}s (MoE runs {sum(r['seconds_moe'] for r in rows):.0f}s, dense runs "
          f"{sum(r['seconds_dense'] for r in rows):.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
