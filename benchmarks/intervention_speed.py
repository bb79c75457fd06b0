"""Cost of one masking / steering condition of `expertize specialize`: full forward vs the suffix replay (CPU).

    python benchmarks/intervention_speed.py                              # tiny-gpt2-shakespeare, fresh MxD at layer 2
    python benchmarks/intervention_speed.py --base /data/smollm2 --layer 15 \\
        --corpus code=/data/domains/code.jsonl --corpus wiki=/data/domains/wiki.jsonl

The model is the base (`--base`, default shared/data/models/tiny-gpt2-shakespeare via EXPERTIZE_DATA) with a freshly
initialized MxD at `--layer` (N = 8 x d_model experts, K = 32, D random: speed does not depend on the values). The
eval text is `--tokens` per corpus (default Tiny Shakespeare and WikiText-2 from the shared data), packed as
`specialize` packs it. Conditions: half ablate 5 % of the units (a masking condition), half steer one unit.

Each row runs `conditions.condition_ce` (the code `specialize` runs) on every corpus: with no condition (the one full
forward per batch that records the prefix: base CE, pooled codes), with C conditions on the suffix (the default),
with C conditions stacked along the batch (`--stack`, equal to float rounding), and with C conditions as full
forwards (the reference); the replay check is off here (`specialize` makes it once per model, on one batch). Per
condition = (time with C − time with none) / C, the median of --repeats. The suffix's CE sums are checked equal to the
full forwards' (torch.equal).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def fresh_model(base_dir: str, layer: int):
    """The base with a fresh MxD at `layer` (see the module docstring), and its tokenizer."""
    from transformers import AutoTokenizer

    from expertize.conversion.surgery.families import mlp_shape
    from expertize.conversion.surgery.splice import load_base_model, splice
    from expertize.modeling import MxdLayer, MxdSpec

    base = load_base_model(base_dir, dtype=torch.float32)
    shape = mlp_shape(base.config)
    torch.manual_seed(0)
    spec = MxdSpec(d_in=shape.d_model, d_out=shape.d_model, d_hidden=shape.d_hidden, num_experts=8 * shape.d_model,
                   k=32, encoder="glu" if shape.glu else "mlp", activation=shape.activation)
    mxd = MxdLayer(spec)
    with torch.no_grad():
        mxd.W_dec.normal_(0, 0.02)
    return splice(base, {layer: mxd}).eval(), AutoTokenizer.from_pretrained(base_dir)


def conditions(num_units: int, count: int):
    from expertize.conversion.specialization import Condition

    gen = torch.Generator().manual_seed(0)
    out = []
    for c in range(count):
        units = torch.randperm(num_units, generator=gen)
        if c % 2 == 0:
            out.append(Condition(ablate=tuple(sorted(units[: max(1, num_units // 20)].tolist()))))
        else:
            out.append(Condition(steer=((int(units[0]), 3.0),)))
    return out


def measure(args) -> list[tuple[str, float]]:
    from expertize.conversion.specialization import SuffixRunner, condition_ce, pack_with_documents, read_documents

    torch.set_num_threads(args.threads)
    model, tokenizer = fresh_model(args.base, args.layer)
    layer = model.sparse_layers()[args.layer]
    texts = {}
    for spec in args.corpus:
        name, path = spec.split("=", 1)
        texts[name] = pack_with_documents(name, read_documents(name, path), tokenizer, args.tokens,
                                          args.context_length)
    runner = SuffixRunner(model, args.layer)
    conds = conditions(layer.num_units, args.conditions)

    def run(chosen, **options):
        start = time.perf_counter()
        sums = [condition_ce(runner, layer, ids, docs, chosen, args.batch_size, check=False, **options).conditions
                for ids, docs in texts.values()]
        return time.perf_counter() - start, sums

    run(conds[:1])  # warm-up
    rows = {"prefix record (one full forward per batch)": [], "suffix": [], "suffix, stacked": [],
            "full forward": []}
    identical = True
    for _ in range(args.repeats):
        none, _ = run([])
        suffix, a = run(conds)
        stacked, _ = run(conds, stack=True)
        full, b = run(conds, full_forward=True)
        identical &= all(torch.equal(x, y) for x, y in zip(a, b))
        rows["prefix record (one full forward per batch)"].append(none)
        for name, seconds in (("suffix", suffix), ("suffix, stacked", stacked), ("full forward", full)):
            rows[name].append((seconds - none) / len(conds))
    tokens = sum(ids.numel() for ids, _ in texts.values())
    print(f"{Path(args.base).name}, fresh MxD at layer {args.layer} of {len(runner.blocks)}; {len(texts)} corpora x "
          f"{args.tokens:,} tokens (context {args.context_length}, batch {args.batch_size}; {tokens:,} tokens); "
          f"{len(conds)} conditions; {args.threads} threads; median of {args.repeats}")
    print("| pass | seconds | x full forward |\n|---|---:|---:|")
    full = statistics.median(rows["full forward"])
    out = []
    for name, values in rows.items():
        seconds = statistics.median(values)
        per = "" if name.startswith("prefix") else " per condition"
        print(f"| {name}{per} | {seconds:.3f} | {full / seconds:.2f} |")
        out.append((name, seconds))
    print(f"suffix CE sums equal to the full forwards' (torch.equal): {identical}")
    return out


def main() -> int:
    data = Path(os.environ.get("EXPERTIZE_DATA", "../shared/data"))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=str(data / "models" / "tiny-gpt2-shakespeare"))
    p.add_argument("--layer", type=int, default=2)
    p.add_argument("--corpus", action="append", default=None, metavar="NAME=PATH")
    p.add_argument("--tokens", type=int, default=4096, help="eval tokens per corpus (default 4096)")
    p.add_argument("--context-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--conditions", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    args.corpus = args.corpus or [f"shakespeare={data / 'corpora' / 'tinyshakespeare.txt'}",
                                  f"wikitext={data / 'corpora' / 'wikitext2_test.raw'}"]
    measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
