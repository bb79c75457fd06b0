"""Cost of `expertize inspect`'s statistics pass against a bare forward of the same model over the same tokens (CPU).

    python benchmarks/inspect_speed.py                                 # tiny-gpt2-shakespeare + a fresh MxD layer
    python benchmarks/inspect_speed.py --model-dir runs/quickstart     # any expertize folder
    python benchmarks/inspect_speed.py --base DIR --layers 10,20 --corpus code=code.jsonl --corpus wiki=wiki.jsonl

Without --model-dir the model is built here: the base (`--base`, default shared/data/models/tiny-gpt2-shakespeare via
EXPERTIZE_DATA) with a freshly initialized MxD at `--layers` (N = 8 x d_model experts, K = 32; D filled with random
values, since the paper's D = 0 init would make every output direction zero; speed does not depend on the values).
Corpora default to Tiny Shakespeare and WikiText-2 from the shared data.

Rows (each in its own subprocess, so that its peak memory is its own): "bare forward" runs `model(input_ids)` over
every batch; "inspect" runs `collect_stats` (every sparse layer, top-N contexts, per-corpus rates, vocabulary effects,
routing) over the same batches. Time: the median of --repeats passes after one warm-up batch; tokens/s from it.
Peak memory: the process's peak RSS (ru_maxrss) minus its RSS after loading the model and the tokens.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build_model(args, out: Path) -> Path:
    """A spliced expertize folder: the base with fresh MxD layers (see the module docstring)."""
    from transformers import AutoTokenizer

    from expertize.conversion.surgery.families import mlp_shape
    from expertize.conversion.surgery.splice import load_base_model, save_model, splice
    from expertize.modeling import MxdLayer, MxdSpec

    base = load_base_model(args.base)
    shape = mlp_shape(base.config)
    torch.manual_seed(0)
    layers = {}
    for i in args.layers:
        spec = MxdSpec(d_in=shape.d_model, d_out=shape.d_model, d_hidden=shape.d_hidden, num_experts=8 * shape.d_model,
                       k=32, encoder="glu" if shape.glu else "mlp", activation=shape.activation)
        layer = MxdLayer(spec)
        with torch.no_grad():
            layer.W_dec.normal_(0, 0.02)
        layers[i] = layer
    return save_model(splice(base, layers), out, AutoTokenizer.from_pretrained(args.base), overwrite=True)


def child(args) -> None:
    """One row, in this process: prints a JSON line with seconds per pass and the peak memory."""
    from expertize.conversion.inspection import InspectionSettings, collect_stats
    from expertize.conversion.inspection.corpora import corpus_sequences
    from expertize.conversion.inspection.from_folder import load_for_inspection, token_texts

    torch.set_num_threads(args.threads)
    model, tokenizer = load_for_inspection(args.model_dir)
    corpora = dict(c.split("=", 1) for c in args.corpus)
    per_corpus = args.tokens // len(corpora)
    sequences = {n: corpus_sequences(n, p, tokenizer, per_corpus, args.context_length) for n, p in corpora.items()}
    settings = InspectionSettings(context_length=args.context_length, batch_size=args.batch_size, top_n=args.top_n)
    warm = {n: s[: args.batch_size] for n, s in list(sequences.items())[:1]}

    def bare(seqs):
        with torch.no_grad():
            for s in seqs.values():
                for lo in range(0, s.shape[0], args.batch_size):
                    model(input_ids=s[lo : lo + args.batch_size], use_cache=False)

    def inspect(seqs):
        collect_stats(model, seqs, settings, token_texts(tokenizer))

    run = bare if args.child == "bare" else inspect
    run(warm)
    base_rss = _rss_mb()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        run(sequences)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = sum(int(s.numel()) for s in sequences.values())
    units = sum(layer.num_units for layer in model.sparse_layers().values())
    print(json.dumps({"seconds": sorted(times)[len(times) // 2], "tokens": tokens, "peak_mb": peak - base_rss,
                      "layers": sorted(model.sparse_layers()), "units": units}))


def main() -> None:
    data = Path(os.environ.get("EXPERTIZE_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="an expertize folder to time (default: build one from --base)")
    p.add_argument("--base", default=str(data / "models" / "tiny-gpt2-shakespeare"))
    p.add_argument("--layers", default="2", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--corpus", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--tokens", type=int, default=65_536, help="tokens in all (split evenly over the corpora)")
    p.add_argument("--context-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--top-n", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", choices=["bare", "inspect"], help=argparse.SUPPRESS)
    args = p.parse_args()
    args.corpus = args.corpus or [f"shakespeare={data / 'corpora' / 'tinyshakespeare.txt'}",
                                  f"wikitext={data / 'corpora' / 'wikitext2_test.raw'}"]
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or str(build_model(args, Path(tmp) / "model"))
        rows = {}
        for name in ("bare", "inspect"):
            cmd = [sys.executable, __file__, "--child", name, "--model-dir", model_dir, "--tokens", str(args.tokens),
                   "--context-length", str(args.context_length), "--batch-size", str(args.batch_size),
                   "--top-n", str(args.top_n), "--repeats", str(args.repeats), "--threads", str(args.threads)]
            cmd += [f"--corpus={c}" for c in args.corpus]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows[name] = json.loads(out.strip().splitlines()[-1])
    bare, ins = rows["bare"], rows["inspect"]
    what = args.model_dir or f"{Path(args.base).name} + fresh MxD (N=8·d_model, K=32) at layers {args.layers}"
    print(f"{what}; {bare['tokens']:,} tokens ({', '.join(c.split('=')[0] for c in args.corpus)}), context "
          f"{args.context_length}, batch {args.batch_size}, top-N {args.top_n}; sparse layers {ins['layers']} "
          f"({ins['units']:,} units); CPU, {args.threads} threads, torch {torch.__version__}; "
          f"median of {args.repeats}")
    print()
    print("| row | seconds | tokens/s | x bare | peak memory over the loaded model (MB) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in (("bare forward", bare), ("inspect", ins)):
        print(f"| {name} | {r['seconds']:.2f} | {r['tokens'] / r['seconds']:,.0f} | "
              f"{r['seconds'] / bare['seconds']:.2f} | {r['peak_mb']:.0f} |")


if __name__ == "__main__":
    main()
