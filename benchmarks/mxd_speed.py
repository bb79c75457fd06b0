"""Time one MxD training step (forward + backward) at GPT-2 shapes, side by side with three baselines.

Defaults: I = O = 768, H = 3072, N = 21,490 experts, K = 32, 4,096 tokens, float32, CPU with torch's default thread
count. Every row takes the same input x (T, I) with `requires_grad=True` (the layer sits inside a network, so the
gradient w.r.t. its input is needed) and backpropagates `out.sum()`; parameter gradients are reset to None before each
step, as `optimizer.zero_grad(set_to_none=True)` would.

Rows:
    mlp (a)         the dense GPT-2 MLP: Linear(I, H) -> gelu (tanh approximation) -> Linear(H, O).
    mxd ref (b)     MxD as the paper's code computes it: same encoder, gate and decoder as `mxd`, but the TopK
                    coefficients are scattered into a dense (T, N) tensor and Cᵀa is the dense product `a @ C` over all
                    N experts. Shares its parameters with `mxd`, so the two outputs are also checked to agree.
    mxd             the real `expertize.modeling.MxdLayer` (D set to random non-zero values so that every gradient is
                    non-trivial; the paper's init has D = 0). Its gate backward is sparse: the logits' gradient is
                    non-zero only at the K selected experts, so grad x and grad G are gathers / scatters over T·K rows
                    instead of two dense T×N×I products (same values; gradients equal up to float summation order).
    matmuls (c)     the dense products of MxD, bias-free, with autograd: encoder x E (T×I @ I×H), gate x G (T×I @ I×N)
                    and decoder z D (T×H @ H×O); backward of the sum of the three outputs' sums. Since `mxd` does the
                    gate's backward sparsely, only the gate's forward product is truly unavoidable, and `mxd` can beat
                    this row.

FLOP convention (FLOPs actually performed, multiply-add = 2): each dense matmul (M×K @ K×N) counts 2·M·K·N forward and
3× that for forward + backward (forward, grad w.r.t. the input, grad w.r.t. the weight). Gathered products count
their K selected rows only: MxD's Cᵀa 3 × 2·T·K·O, and its gate backward 2 × 2·T·K·I on top of the gate's dense
forward 2·T·I·N. `mxd ref (b)` counts its dense `a @ C` and gate backward in full. Element-wise work (activations,
TopK, biases, the Hadamard product) is not counted. GFLOP/s is that count over the median time.

"saved MB" is the memory held between forward and backward: the bytes of the distinct tensors autograd saves for
backward, excluding the parameters and the input (transient buffers created during backward are not included).

Run:  python benchmarks/mxd_speed.py            (1-2 minutes on 2 idle CPU cores)
      python benchmarks/mxd_speed.py --tokens 1024 --repeats 3
"""

import argparse
import functools
import statistics
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from _timing import round_robin_times, saved_megabytes, train_step

from expertize.modeling import MxdLayer, MxdSpec


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=4096, help="T: tokens per step (default 4096)")
    p.add_argument("--d-model", type=int, default=768, help="I = O: model width (default 768)")
    p.add_argument("--d-hidden", type=int, default=3072, help="H: MLP / MxD hidden width (default 3072)")
    p.add_argument("--num-experts", type=int, default=21490, help="N: MxD experts (default 21490)")
    p.add_argument("--k", type=int, default=32, help="K: active experts per token (default 32)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before timing (default 1)")
    p.add_argument("--repeats", type=int, default=4, help="timed rounds; the median is reported (default 4)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


# -- rows ------------------------------------------------------------------------------------------------------------


def mxd_reference(layer: MxdLayer, x: torch.Tensor) -> torch.Tensor:
    """The paper code's MxD: dense (T, N) coefficients and `a @ C` over all N experts."""
    logits = F.linear(x, layer.W_gate, layer.b_gate)  # (T, N)
    values, index = F.relu(logits).topk(layer.spec.k, dim=-1)  # (T, K)
    a = torch.zeros_like(logits).scatter(-1, index, values)  # (T, N)
    return (a @ layer.W_experts) * (layer.hidden(x) @ layer.W_dec) + layer.b_dec  # (T, O)


class BareMatmuls(nn.Module):
    """The dense products of MxD, nothing else: x E (T, H), x G (T, N), z D (T, O).

    Weights are stored as MxdLayer stores them (E (H, I) and G (N, I) in nn.Linear layout, D (H, O)), so the products
    run on the same memory layouts.
    """

    def __init__(self, I: int, O: int, H: int, N: int, tokens: int) -> None:
        super().__init__()
        self.W_enc = nn.Parameter(torch.randn(H, I) / I**0.5)  # (H, I)
        self.W_gate = nn.Parameter(torch.randn(N, I) / I**0.5)  # (N, I)
        self.W_dec = nn.Parameter(torch.randn(H, O) / H**0.5)  # (H, O)
        self.z = nn.Parameter(torch.randn(tokens, H))  # (T, H): stand-in decoder input; needs a gradient like z does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enc = F.linear(x, self.W_enc)  # (T, H)
        gate = F.linear(x, self.W_gate)  # (T, N)
        dec = self.z @ self.W_dec  # (T, O)
        return enc.sum() + gate.sum() + dec.sum()


def gpt2_mlp(I: int, O: int, H: int) -> nn.Module:
    return nn.Sequential(nn.Linear(I, H), nn.GELU(approximate="tanh"), nn.Linear(H, O))


# -- main ------------------------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    T, I, H, N, K = args.tokens, args.d_model, args.d_hidden, args.num_experts, args.k
    O = I

    mxd = MxdLayer(MxdSpec(d_in=I, d_out=O, d_hidden=H, num_experts=N, k=K, activation="gelu_new"))
    with torch.no_grad():
        mxd.W_dec.normal_(0.0, H**-0.5)  # the paper's init has D = 0: no gradient would reach E, G or C
        mxd.b_dec.normal_(0.0, 0.1)
    mlp = gpt2_mlp(I, O, H)
    bare = BareMatmuls(I, O, H, N, T)
    x = torch.randn(T, I, requires_grad=True)  # (T, I)

    # name -> (module owning the parameters, forward fn, forward + backward FLOPs; see the module docstring)
    enc_dec = 3 * 2 * T * (I * H + H * O)  # encoder + decoder, dense, fwd + bwd
    gate = 3 * 2 * T * I * N  # gate, dense, fwd + bwd
    rows: dict[str, tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], int]] = {
        "mlp (a)": (mlp, mlp, enc_dec),
        "mxd ref (b)": (mxd, lambda v: mxd_reference(mxd, v), enc_dec + gate + 3 * 2 * T * N * O),
        "mxd": (mxd, mxd, enc_dec + 2 * T * I * N + 2 * 2 * T * K * I + 3 * 2 * T * K * O),
        "matmuls (c)": (bare, bare, enc_dec + gate),
    }

    times = round_robin_times(
        {name: functools.partial(train_step, module, fn, x) for name, (module, fn, _) in rows.items()},
        args.warmup, args.repeats,
    )
    saved, outputs = {}, {}
    for name, (module, fn, _) in rows.items():
        saved[name], outputs[name] = saved_megabytes(module, fn, x)
    diff = (outputs["mxd"] - outputs["mxd ref (b)"]).abs().max().item()

    median_ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    t_a, t_b, t_mxd, t_c = (median_ms[n] for n in ("mlp (a)", "mxd ref (b)", "mxd", "matmuls (c)"))

    print(
        f"MxD forward+backward: T={T} I=O={I} H={H} N={N} K={K}, float32, CPU, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; median of {args.repeats} after {args.warmup} warm-up round(s)"
    )
    header = f"{'row':<13} {'median ms':>10} {'min ms':>9} {'vs (c)':>7} {'vs (a)':>7} {'GFLOP/s':>8} {'saved MB':>9}"
    print(header)
    print("-" * len(header))
    for name, (_, _, flops) in rows.items():
        ms = median_ms[name]
        gflops = flops / (ms * 1e-3) / 1e9
        print(
            f"{name:<13} {ms:>10.1f} {1e3 * min(times[name]):>9.1f} {ms / t_c:>6.2f}x {ms / t_a:>6.2f}x "
            f"{gflops:>8.1f} {saved[name]:>9.1f}"
        )
    print(f"\nmxd vs mxd ref (b): max |output difference| = {diff:.2e}")
    ok_b = t_mxd < t_b
    ok_c = t_mxd <= 1.25 * t_c
    verdict = {True: "PASS", False: "FAIL"}
    print(f"target  mxd faster than mxd ref (b):  {verdict[ok_b]}  (time ratio mxd / (b) = {t_mxd / t_b:.2f})")
    print(f"target  mxd <= 1.25x matmuls (c):     {verdict[ok_c]}  (time ratio mxd / (c) = {t_mxd / t_c:.2f})")


if __name__ == "__main__":
    main()
