"""Time one MoE-X training step (forward + backward): sorted dropless dispatch vs all-experts vs a matched dense MLP.

Defaults are the paper's GPT-2-small language setting with every expert a copy of the MLP (I = O = 768, M = 8 experts
of width D = 3072, K = 2), on 1,024 tokens so that a 2-core CPU finishes in about a minute; `--d-expert 384` gives
the split-upcycling shape (D = 3072 / 8). Every row takes the same x (T, I) with `requires_grad=True` and
backpropagates a fixed random projection of its output; parameter gradients are reset to None before each step.

Rows:
    dense mlp (a)   Linear(I, K·D) -> ReLU -> Linear(K·D, O): a dense MLP with the same hidden units per token as
                    the MoE's K active experts (the paper's "activated parameters matched" comparison).
    all experts (b) MoE-X computed densely: every expert on every token ((T, M, D) hidden), then the gate weights
                    zero the M − K unselected experts. Shares the MoE-X layer's parameters and router; its output is
                    checked against the layer's.
    moe_x           `expertize.modeling.MoeXLayer` (sparsity router): assignments sorted by expert, one matmul per
                    expert over its tokens, codes gathered back per token, through the code hook.
    expert mm (c)   only the per-expert matmuls moe_x runs (encoder, ReLU, decoder on T·K/M pre-sorted rows per
                    expert, the layer's weights), without router, sorting or code: the floor of any per-expert
                    dispatch on this machine. moe_x / (c) is the dispatch's own overhead; (c) / (a) is the price of
                    M/K times more weights (their gradients are M/K times larger for the same FLOPs).

FLOPs (multiply-add = 2; forward + backward = 3 × forward for each matmul): (a), (c) and moe_x do 3·2·T·K·D·(I + O)
in their expert matmuls, (b) M/K times that; the sparsity router adds 3·2·2·T·I·M (μᵀx and σ²ᵀx²) to (b) and moe_x.
Element-wise work, TopK, sorting and the column statistics are not counted. GFLOP/s is that count over the median.

Run:  python benchmarks/moe_x_dispatch.py                 (~1 minute on 2 idle CPU cores)
      python benchmarks/moe_x_dispatch.py --d-expert 384 --tokens 4096
On a shared, oversubscribed CPU pass --threads 1: OpenMP's thread waits then add ~15 ms to every op, which hits
the per-expert loop (dozens of small ops) far harder than the dense rows and makes the ratios meaningless.
"""

import argparse
import functools
import statistics
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from _timing import round_robin_times, saved_megabytes, train_step

from expertize.modeling import MoeXLayer, MoeXSpec


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=1024, help="T: tokens per step (default 1024)")
    p.add_argument("--d-model", type=int, default=768, help="I = O (default 768)")
    p.add_argument("--d-expert", type=int, default=3072, help="D: expert width (default 3072, copy-upcycling)")
    p.add_argument("--num-experts", type=int, default=8, help="M (default 8)")
    p.add_argument("--k", type=int, default=2, help="K: experts per token (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before timing (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def all_experts(layer: MoeXLayer, x: torch.Tensor) -> torch.Tensor:
    """MoE-X with every expert run on every token, then masked by the gates: (T, I) -> (T, O)."""
    routing = layer.route(x)
    gates = torch.zeros_like(routing.router_logits, dtype=x.dtype).scatter(
        -1, routing.top_k_index, routing.top_k_weights
    )  # (T, M), K non-zero
    z = layer.act(torch.einsum("ti,mdi->tmd", x, layer.W_enc))  # (T, M, D)
    return torch.einsum("tmd,mod->to", z * gates.unsqueeze(-1), layer.W_dec) + layer.b_dec  # (T, O)


class ExpertMatmuls(nn.Module):
    """The per-expert products of MoE-X alone, on a stand-in (T·K, I) input already grouped by expert."""

    def __init__(self, layer: MoeXLayer, tokens: int) -> None:
        super().__init__()
        self.layer = layer
        M, K = layer.spec.num_experts, layer.spec.k
        self.x_sorted = nn.Parameter(torch.randn(tokens * K, layer.spec.d_in))  # needs a gradient like x does
        self.counts = [tokens * K // M + (j < tokens * K % M) for j in range(M)]

    def forward(self, _x: torch.Tensor) -> torch.Tensor:
        W_enc, W_dec = self.layer.W_enc.unbind(0), self.layer.W_dec.unbind(0)
        groups = self.x_sorted.split(self.counts)  # (T·K / M, I) each
        parts = [F.linear(F.relu(F.linear(x_j, W_enc[j])), W_dec[j]) for j, x_j in enumerate(groups)]
        return torch.cat(parts).view(-1, self.layer.spec.k, self.layer.spec.d_out).sum(1)  # (T, O)


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    T, I, D, M, K = args.tokens, args.d_model, args.d_expert, args.num_experts, args.k
    O = I

    layer = MoeXLayer(MoeXSpec(d_in=I, d_out=O, d_expert=D, num_experts=M, k=K))
    with torch.no_grad():  # spread the columns' statistics so that routing is not near-uniform noise
        layer.W_enc.add_(0.02 * torch.randn(M, 1, I))
    mlp = nn.Sequential(nn.Linear(I, K * D), nn.ReLU(), nn.Linear(K * D, O))
    bare = ExpertMatmuls(layer, T)
    x = torch.randn(T, I, requires_grad=True)
    proj = torch.randn(T, O)

    experts = 3 * 2 * T * K * D * (I + O)
    router = 3 * 2 * 2 * T * I * M
    rows: dict[str, tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], int]] = {
        "dense mlp (a)": (mlp, mlp, experts),
        "all experts (b)": (layer, lambda v: all_experts(layer, v), experts * M // K + router),
        "moe_x": (layer, layer, experts + router),
        "expert mm (c)": (bare, bare, experts),
    }

    times = round_robin_times(
        {name: functools.partial(train_step, module, fn, x, proj) for name, (module, fn, _) in rows.items()},
        args.warmup, args.repeats,
    )
    saved = {name: saved_megabytes(module, fn, x)[0] for name, (module, fn, _) in rows.items()}
    with torch.no_grad():
        diff = (layer(x) - all_experts(layer, x)).abs().max().item()
        load = torch.bincount(layer.route(x).top_k_index.flatten(), minlength=M).tolist()

    median_ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    t_a, t_b, t_c = median_ms["dense mlp (a)"], median_ms["all experts (b)"], median_ms["expert mm (c)"]
    print(
        f"MoE-X forward+backward: T={T} I=O={I} M={M} D={D} K={K}, float32, CPU, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; median of {args.repeats} after {args.warmup} warm-up round(s)"
    )
    header = (
        f"{'row':<16} {'median ms':>10} {'min ms':>9} {'vs (a)':>7} {'vs (b)':>7} {'vs (c)':>7} {'GFLOP/s':>8} "
        f"{'saved MB':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, (_, _, flops) in rows.items():
        ms = median_ms[name]
        print(
            f"{name:<16} {ms:>10.1f} {1e3 * min(times[name]):>9.1f} {ms / t_a:>6.2f}x {ms / t_b:>6.2f}x "
            f"{ms / t_c:>6.2f}x "
            f"{flops / (ms * 1e-3) / 1e9:>8.1f} {saved[name]:>9.1f}"
        )
    print(f"\nmoe_x vs all experts (b): max |output difference| = {diff:.2e}; assignments per expert: {load}")


if __name__ == "__main__":
    main()
