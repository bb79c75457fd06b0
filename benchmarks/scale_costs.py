"""The arithmetic of docs/scale.md: what converting Llama-3-70B costs, from its config and stated assumptions.

Pure arithmetic, no model is loaded and nothing is timed (except the optional --sha256 line): the base's parameter
count from the Llama-3-70B config (hidden 8192, MLP width 28672, 80 layers, vocab 128,256, 64 query / 8 KV heads,
untied head), the sparse layers' parameters from expertize's own spec classes (`MxdSpec.num_parameters`,
`TranscoderSpec.num_parameters`, N from `mxd_experts_for_transcoder`, as a recipe with `match_transcoder` resolves
it), the training state at preflight's 16 bytes per trained parameter, the activation cache's bytes per token as
`expertize capture` counts them, and FLOPs per token:

    base forward     2 x (parameters of the blocks run)  (the embedding is a lookup; the head is not run by a capture;
                     attention's context-dependent FLOPs, ~4 x context x d_model per block, are left out: <1 %)
    layer training   the convention of benchmarks/mxd_speed.py and transcoder_backward.py: a dense matmul counts 3x
                     its forward (forward, grad input, grad weight); the TopK gate / encoder counts its dense forward
                     and a backward over the K selected rows only; the K selected decoder rows 3x.

Times divide FLOPs by an ASSUMED sustained rate (default: 40 % of an H100 SXM's ~989 dense bf16 TFLOPS); nothing
here was measured on a GPU.

    python benchmarks/scale_costs.py [--mfu 0.4] [--peak-tflops 989] [--tokens 200e6] [--sha256]
"""

import argparse
import hashlib
import os
import time

from expertize.conversion.preflight import BYTES_PER_TRAINED_PARAMETER
from expertize.conversion.recipe.param_match import mxd_experts_for_transcoder
from expertize.modeling import MxdSpec, TranscoderSpec

# Llama-3-70B (meta-llama/Meta-Llama-3-70B config.json)
D, F, LAYERS, VOCAB, HEADS, KV_HEADS = 8192, 28672, 80, 128256, 64, 8
HEAD_DIM = D // HEADS
K = 32
GB, TB = 1e9, 1e12


def base_sizes() -> dict[str, int]:
    attention = D * HEADS * HEAD_DIM + 2 * D * KV_HEADS * HEAD_DIM + HEADS * HEAD_DIM * D  # q, k, v, o
    mlp = 3 * D * F  # gate, up, down
    block = attention + mlp + 2 * D  # two RMSNorms
    embedding = VOCAB * D
    total = LAYERS * block + 2 * embedding + D  # untied head, final norm
    return dict(attention=attention, mlp=mlp, block=block, embedding=embedding, total=total)


def layers() -> dict[str, tuple[object, int]]:
    """name -> (spec, training FLOPs per token)."""
    out = {}
    for factor in (16, 32):
        n = mxd_experts_for_transcoder(D, D, F, factor, encoder="glu")
        mxd = MxdSpec(d_in=D, d_out=D, d_hidden=F, num_experts=n, k=K, encoder="glu", activation="silu")
        flops = 3 * 2 * (2 * D * F + F * D) + 2 * D * n + 2 * 2 * K * D + 3 * 2 * K * D
        out[f"mxd {factor}x (N {n:,})"] = (mxd, flops)
        latents = factor * D
        tc = TranscoderSpec(d_in=D, d_out=D, num_latents=latents, k=K)
        flops = 2 * D * latents + 2 * 2 * K * D + 3 * 2 * K * D
        out[f"transcoder {factor}x (L {latents:,})"] = (tc, flops)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mfu", type=float, default=0.4, help="assumed share of the peak sustained (default 0.4)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100 SXM: ~989)")
    p.add_argument("--tokens", type=float, default=200e6, help="training budget (default 200M: the shipped "
                   "every-layer recipes')")
    p.add_argument("--sha256", action="store_true", help="also time hashlib.sha256 over 256 MiB on this machine")
    args = p.parse_args()
    rate = args.mfu * args.peak_tflops * 1e12  # FLOP/s per GPU, assumed

    s = base_sizes()
    print("## Llama-3-70B")
    print(f"attention {s['attention']:,}  mlp {s['mlp']:,}  block {s['block']:,}  embedding {s['embedding']:,}")
    print(f"total {s['total']:,} parameters; bf16 {2 * s['total'] / GB:.1f} GB, fp32 {4 * s['total'] / GB:.1f} GB")
    print(f"block bf16 {2 * s['block'] / GB:.3f} GB; embedding (= head) bf16 {2 * s['embedding'] / GB:.3f} GB")
    for blocks in (1, 8, 40, 80):
        params = blocks * s["block"] + s["embedding"]
        print(f"blocks 0..{blocks - 1} + embedding: {params / 1e9:.2f}B params, bf16 {2 * params / GB:.1f} GB; "
              f"capture {2 * blocks * s['block'] / 1e9:.1f} GFLOP/token, {rate / (2 * blocks * s['block']):,.0f} "
              "tokens/s per GPU (assumed rate)")

    print("\n## Sparse layer at d_model 8192, MLP width 28672 (GLU MxD, H = 28672), K 32")
    print("| layer | parameters | x the MLP | weights fp32 GB | training state GB (16 B/param) | train GFLOP/token |"
          f" GPU-h per layer at {args.tokens / 1e6:.0f}M tokens |")
    for name, (spec, flops) in layers().items():
        n = spec.num_parameters()
        print(f"| {name} | {n / 1e9:.3f}B | {n / s['mlp']:.2f} | {4 * n / GB:.1f} | "
              f"{BYTES_PER_TRAINED_PARAMETER * n / GB:.1f} | {flops / 1e9:.2f} | {args.tokens * flops / rate / 3600:.2f} |")

    print("\n## Activation cache per 1e9 tokens (x and y per layer, int32 token id per token)")
    for itemsize, dtype in ((2, "bf16"), (4, "fp32")):
        for n_layers in (1, 8, 80):
            per_token = n_layers * 2 * D * itemsize + 4
            print(f"{dtype} {n_layers:>2} layer(s): {per_token:,} B/token, {per_token * 1e9 / TB:,.1f} TB")

    if args.sha256:
        block = os.urandom(256 * 2**20)
        start = time.perf_counter()
        hashlib.sha256(block).hexdigest()
        print(f"\nsha256 on this machine: {len(block) / (time.perf_counter() - start) / GB:.2f} GB/s (one core)")


if __name__ == "__main__":
    main()
