"""What loading the base only as deep as a capture reads saves (`expertize capture`, conversion/surgery/trunk.py):
peak resident memory and load time of the whole causal LM (`load_base_model`, what capture loaded before) against
the trunk (`load_base_trunk`: the embeddings and blocks 0..L, no later blocks, no LM head), for a capture of an
early layer L.

Each measurement is a fresh Python process (peak RSS, the kernel's VmHWM, is a high-water mark per process; not
`ru_maxrss`, which keeps the parent's mark across the fork and exec that start a child): it imports
torch, transformers and expertize, notes its resident memory, loads the model, runs one capture forward (4 x 128
tokens, stopped after layer L as `expertize capture` runs it) and reports the peak resident memory, what the load
and the forward added to it, the bytes of the parameters the model holds and the load's wall time. Three cases:

    float32            the checkpoint's own dtype (SmolLM2 and the tiny models are stored in float32): safetensors
                       memory-maps the file and the weights are read only where a forward touches them, so the whole
                       model's later blocks cost little resident memory even when loaded
    bfloat16           a recipe dtype other than the checkpoint's: every loaded weight is converted, in memory
    float32 + copy     every loaded weight copied once after the load, as `.to(device)` copies it to an accelerator
                       (here into host memory: the bytes a GPU would hold)

The variants alternate over `--repeats` rounds (the median is printed), so a shared machine's drift hits both alike;
the checkpoint files are read once before the first round, so every load reads them from the page cache.

Models: SmolLM2-135M (30 Llama blocks, tied embeddings) at $SMOLLM2 (default /work/bench/smollm2) when present,
capturing layer 3; the quickstart's tiny GPT-2 (expertize/assets, 4 blocks) capturing layer 1; stories260k (5 Llama
blocks, $EXPERTIZE_DATA/models) capturing layer 1 when present.

    python benchmarks/partial_load.py [--repeats 3] [--model PATH:LAYER ...]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def default_models() -> list[tuple[str, int]]:
    models = []
    smollm2 = Path(os.environ.get("SMOLLM2", "/work/bench/smollm2"))
    if (smollm2 / "config.json").is_file():
        models.append((str(smollm2), 3))
    models.append((str(ROOT / "expertize" / "assets" / "tiny-gpt2-shakespeare"), 1))
    stories = Path(os.environ.get("EXPERTIZE_DATA", "")) / "models" / "stories260k"
    if os.environ.get("EXPERTIZE_DATA") and (stories / "config.json").is_file():
        models.append((str(stories), 1))
    return models


def _status_mb(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS: resident now, VmHWM: its peak) in MB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 2**10  # kB


CASES = {"float32": ("float32", False), "bfloat16": ("bfloat16", False), "float32 + copy": ("float32", True)}


def child(model: str, variant: str, layer: int, case: str) -> None:
    """One measurement, in this fresh process: prints a JSON line."""
    import torch

    from expertize.conversion.data.mlp_pairs import MlpCapture
    from expertize.conversion.surgery.splice import load_base_model
    from expertize.conversion.surgery.trunk import load_base_trunk

    dtype, copy = CASES[case]
    before = _status_mb("VmRSS")
    start = time.perf_counter()
    if variant == "full":
        loaded = load_base_model(model, dtype=getattr(torch, dtype))
        blocks = loaded.config.num_hidden_layers
        record = {"blocks": [0, blocks - 1], "of": blocks, "head": True}
    else:
        loaded, record = load_base_trunk(model, layer + 1, dtype=getattr(torch, dtype))
    seconds = time.perf_counter() - start
    loaded.eval().requires_grad_(False)
    if copy:  # what a move to an accelerator reads and allocates: every loaded weight, once
        for p in loaded.parameters():
            p.data = p.data.clone()
    ids = torch.randint(0, loaded.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    MlpCapture(loaded, [layer])(ids)
    peak = _status_mb("VmHWM")
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in loaded.parameters()}  # tied weights once
    print(json.dumps({"seconds": seconds, "peak_mb": peak, "added_mb": peak - before,
                      "params_mb": sum(unique.values()) / 2**20, "record": record}))


def measure(model: str, variant: str, layer: int, case: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", model, variant, str(layer), case], check=True,
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the median is printed (default 3)")
    parser.add_argument("--model", action="append", default=[], metavar="PATH:LAYER",
                        help="a base model folder and the layer captured (repeatable; default: see above)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), args.child[3])
        return
    models = [(m.rpartition(":")[0], int(m.rpartition(":")[2])) for m in args.model] or default_models()
    rows = []
    for model, layer in models:
        for weights in Path(model).glob("*.safetensors"):
            with open(weights, "rb") as f:  # into the page cache: every load below reads warm files
                while f.read(1 << 24):
                    pass
        for case in CASES:
            runs: dict[str, list[dict]] = {"full": [], "trunk": []}
            for _ in range(args.repeats):
                for variant in runs:
                    runs[variant].append(measure(model, variant, layer, case))
            for variant, results in runs.items():
                median = {key: statistics.median(r[key] for r in results)
                          for key in ("seconds", "peak_mb", "added_mb", "params_mb")}
                rows.append((Path(model).name, layer, case, variant, results[0]["record"], median))
    print(f"CPU, median of {args.repeats} fresh processes per row (`python benchmarks/partial_load.py --repeats "
          f"{args.repeats}`); RSS added: the peak over the resident memory after the imports\n")
    print("| model | layer | case | load | blocks loaded | parameters (MB) | peak RSS (MB) | RSS added (MB) "
          "| load time (s) |")
    print("|---|---:|---|---|---|---:|---:|---:|---:|")
    for name, layer, case, variant, record, m in rows:
        blocks = f"{record['blocks'][0]}..{record['blocks'][1]} of {record['of']}"
        blocks += "" if record["head"] else ", no head"
        print(f"| {name} | {layer} | {case} | {variant} | {blocks} | {m['params_mb']:,.1f} | {m['peak_mb']:,.0f} "
              f"| {m['added_mb']:,.0f} | {m['seconds']:.2f} |")


if __name__ == "__main__":
    main()
