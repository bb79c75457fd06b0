"""The transcoder's training step through its sparse gate backward against the previous dense one (issue 20).

One step = the transcoder's forward (encoder TopK(ReLU(W_enc x + b_enc)), decoder W_decᵀ z + b_dec), an MSE loss to a
random target, and its backward. The input x (T, I) has `requires_grad=True` (the layer sits inside a network) and
the parameters' gradients are reset to None before each step, as `optimizer.zero_grad(set_to_none=True)` would.

Paths (same parameters, same input, same target):
    sparse     the real `expertize.modeling.TranscoderLayer`: its encoder is `LinearReluTopK`, whose backward builds
               grad x, grad W_enc and grad b_enc from the K selected rows only (an embedding_bag and its backward).
    previous   the layer as it was before (`git show e047e89:modeling/transcoder.py`): `relu_topk(F.linear(x, W_enc,
               b_enc), k)` under plain autograd, so TopK's backward scatters into a dense (T, L) gradient and the
               linear's backward runs two dense T×L×I products. The decoder (embedding_bag over the K rows) is shared.
The two paths alternate within every round (benchmarks/_timing.py `round_robin_times`), so the load of a shared
machine hits both alike and their ratio holds even where the absolute times drift.

Columns:
    median / min ms   of the whole step (forward + loss + backward).
    peak MB           the most memory the step held at once beyond what was live before it (parameters, x, target),
                      from torch.profiler's allocation records (`profile_memory=True`: the CPU allocator's allocations
                      and frees, summed in time order), in one untimed, profiled step. It includes the parameters'
                      gradients (dense in both paths: W_enc and W_dec alone are 2·L·I·4 bytes) and the (T, L)
                      pre-activations; the previous path adds its dense (T, L) gradient on top. So does today's
                      sparse path, differently: autograd materializes a zero (T, L) gradient for `LinearReluTopK`'s
                      `pre` output, which the step does not use (`ctx.set_materialize_grads(False)` in its forward
                      would drop it: 251 -> 155 MB at 32x, T 1,024).
    saved MB          the tensors autograd keeps between forward and backward (`saved_tensors_hooks`, parameters and
                      the input excluded; benchmarks/_timing.py `saved_megabytes`).
    MFLOP/token       analytic, multiply-add = 2, element-wise work (ReLU, TopK, biases, the loss) not counted:
                      forward 2·I·L (dense encoder) + 2·K·O (the K decoder rows); backward of the decoder 4·K·O
                      (grad of the K rows and of the K values), of the encoder 4·L·I (previous: grad x and grad W_enc
                      as dense products) or 4·K·I (sparse: the K selected rows only).

Then "the same numbers through both paths": the maximum absolute (and relative to the largest entry) difference of the
output, the loss and every gradient, which must agree to float32 summation order (the script exits 1 otherwise).

On a machine whose cores are taken by other jobs, multi-threaded ops that wait on all their threads stall: the index
sort inside embedding_bag's backward takes ~0.2 ms on free cores and ~250 ms with 2 threads when the other core is
busy. The sparse path runs two such backwards (decoder and encoder), the previous path one (decoder), so with
`--threads 2` under load the sparse path loses much of its lead; `--threads 1` shows the arithmetic's ratio there.

Run:  flock /tmp/expertize-cpu.lock python benchmarks/transcoder_backward.py            (about 1 min on 2 cores)
      python benchmarks/transcoder_backward.py --threads 1      (the control for a loaded machine, see above)
      python benchmarks/transcoder_backward.py --tokens 4096 --expansions 32 --repeats 5
"""

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable

import torch
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

from _timing import round_robin_times, saved_megabytes

from expertize.modeling import TranscoderLayer, TranscoderSpec
from expertize.modeling.sparse_kernels import sparse_rows_sum

GRADIENTS = ("x", "W_enc", "b_enc", "W_dec", "b_dec")
RTOL = 1e-5
"""Gradients may differ only by float32 summation order: relative to the largest entry, far below this."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=1024, help="T: tokens per step (default 1024)")
    p.add_argument("--d-model", type=int, default=768, help="I = O: model width (default 768, GPT-2 small)")
    p.add_argument("--expansions", type=int, nargs="+", default=[32, 8],
                   help="L = expansion x d_model, one row pair each (default 32 8: L 24,576 and 6,144)")
    p.add_argument("--k", type=int, default=32, help="K: active latents per token (default 32)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before timing (default 1)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds; the median is reported (default 7)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name in ("tokens", "d_model", "k", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if any(e < 1 for e in args.expansions) or args.k > args.d_model * min(args.expansions):
        p.error("every expansion must be at least 1, and --k at most d_model x the smallest expansion")
    return args


# -- the two paths ---------------------------------------------------------------------------------------------------


def previous_forward(layer: TranscoderLayer, hidden_states: torch.Tensor) -> torch.Tensor:
    """The transcoder's forward as of e047e89: TopK(ReLU) over the dense pre-activations under plain autograd."""
    lead = hidden_states.shape[:-1]
    x = hidden_states.reshape(-1, hidden_states.shape[-1])  # (T, I)
    values, index = F.linear(x, layer.W_enc, layer.b_enc).topk(layer.spec.k, dim=-1, sorted=False)  # (T, K)
    values = F.relu(values)  # the old relu_topk: ReLU after TopK (ReLU is monotone)
    code = layer._hook_code(index, values, lead)  # the old encode's interventions and hook (identity here)
    out = sparse_rows_sum(code.flat(), layer.W_dec) + layer.b_dec  # (T, O)
    if layer.W_skip is not None:
        out = out + F.linear(x, layer.W_skip)
    return out.view(*lead, -1)


def step(
    layer: TranscoderLayer, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step's compute: gradients reset to None, forward, MSE to `target`, backward. (output, loss)."""
    clear_grads(layer, x)
    out = fn(x)  # (T, O)
    loss = F.mse_loss(out, target)
    loss.backward()
    return out.detach(), loss.detach()


def clear_grads(layer: TranscoderLayer, x: torch.Tensor) -> None:
    for p in layer.parameters():
        p.grad = None
    x.grad = None


def peak_megabytes(layer: TranscoderLayer, x: torch.Tensor, run: Callable[[], object]) -> float:
    """MB of the most memory held at once during `run()` beyond what was live when it started, from the profiler's
    allocation records (each with its signed size: + allocation, - free), summed in time order. The gradients of the
    last step are freed before profiling: the frees of blocks allocated in an earlier profiled run would be recorded
    (as negative sizes) and lower the peak."""
    clear_grads(layer, x)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    sizes: list[tuple[int, int]] = []  # (time ns, signed bytes)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    if not sizes:
        raise RuntimeError("the profiler recorded no allocations: cannot measure peak memory with this torch build")
    live = peak = 0
    for _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return peak / 2**20


def flops_per_token(I: int, O: int, L: int, K: int) -> dict[str, tuple[int, int]]:
    """path -> (forward, backward) FLOPs per token (see the module docstring)."""
    forward = 2 * I * L + 2 * K * O
    decoder_backward = 4 * K * O
    return {"sparse": (forward, decoder_backward + 4 * K * I), "previous": (forward, decoder_backward + 4 * L * I)}


# -- one shape -------------------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, expansion: int) -> tuple[list[str], list[str], bool]:
    """Table rows and equality lines for one dictionary size, and whether the two paths agree."""
    torch.manual_seed(args.seed)
    T, I, K = args.tokens, args.d_model, args.k
    L = expansion * I
    layer = TranscoderLayer(TranscoderSpec(d_in=I, d_out=I, num_latents=L, k=K)).train()
    with torch.no_grad():
        layer.b_enc.normal_(0.0, 0.1)  # the init zeroes the biases; random ones make their gradients non-trivial
        layer.b_dec.normal_(0.0, 0.1)
    x = torch.randn(T, I, requires_grad=True)  # (T, I)
    target = torch.randn(T, I)  # (T, O)
    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "sparse": layer,
        "previous": functools.partial(previous_forward, layer),
    }

    # The same numbers through both paths (and a warm-up of each).
    results = {}
    for name, fn in paths.items():
        out, loss = step(layer, fn, x, target)
        grads = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}
        results[name] = {"output": out, "loss": loss, **grads}
    lines, agree = [], True
    for key in ("output", "loss", *GRADIENTS):
        a, b = results["sparse"][key], results["previous"][key]
        diff = (a - b).abs().max().item()
        scale = b.abs().max().item()
        ok = diff <= RTOL * scale if key not in ("output", "loss") else torch.equal(a, b)
        agree &= ok
        lines.append(f"  {key:<7} max |sparse - previous| = {diff:.2e}   relative to max |previous| {scale:.2e}: "
                     f"{diff / scale if scale else 0.0:.1e}   {'ok' if ok else 'MISMATCH'}")

    steps = {name: functools.partial(step, layer, fn, x, target) for name, fn in paths.items()}
    times = round_robin_times(steps, args.warmup, args.repeats)
    peak = {name: peak_megabytes(layer, x, run) for name, run in steps.items()}
    saved = {name: saved_megabytes(layer, fn, x)[0] for name, fn in paths.items()}
    flops = flops_per_token(I, I, L, K)
    median = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}

    rows = []
    for name in paths:
        fwd, bwd = flops[name]
        rows.append(
            f"{f'{expansion}x (L {L:,})':<15} {name:<9} {median[name]:>9.1f} {1e3 * min(times[name]):>8.1f} "
            f"{median[name] / median['previous']:>8.2f} {peak[name]:>8.1f} {saved[name]:>8.1f} "
            f"{fwd / 1e6:>8.2f} {bwd / 1e6:>8.2f} {(fwd + bwd) / 1e6:>9.2f}"
        )
    return rows, [f"{expansion}x (L {L:,}), T {T}:"] + lines, agree


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(
        f"Transcoder training step (forward + MSE + backward): T={args.tokens} I=O={args.d_model} K={args.k}, "
        f"float32, CPU, {torch.get_num_threads()} threads, torch {torch.__version__}; median of {args.repeats} rounds after "
        f"{args.warmup} warm-up, paths alternating within rounds; load average (1/5/15 min) at start: {load}"
    )
    header = (
        f"{'shape':<15} {'path':<9} {'median ms':>9} {'min ms':>8} {'vs prev':>8} {'peak MB':>8} {'saved MB':>8} "
        f"{'fwd MF/t':>8} {'bwd MF/t':>8} {'step MF/t':>9}"
    )
    table, equality, agree = [header, "-" * len(header)], [], True
    for expansion in args.expansions:
        rows, lines, ok = measure(args, expansion)
        table += rows
        equality += lines
        agree &= ok
    print("\n".join(table))
    print("(MF/t: analytic MFLOP per token; peak MB: torch.profiler allocations; saved MB: saved_tensors_hooks)")
    print("\nThe same numbers through both paths (output and loss must be bitwise equal; gradients within "
          f"{RTOL:g} of the largest entry):")
    print("\n".join(equality))
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if not agree:
        print("FAILED: the sparse and previous paths disagree", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
