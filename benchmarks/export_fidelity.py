"""How exactly `expertize export` holds a trained model's layers, read back by each tool's loader on held-out text.

For every sparse layer of MODEL_DIR (all of them TopK coders): the fraction of held-out tokens with fewer than K
positive pre-activations (where circuit-tracer's TopK, which has no ReLU, would keep negative ones), and the max abs
diff between the layer's output and

    sparsify        the export loaded with sparsify's own `SparseCoder.load_many` (eai-sparsify installed)
    circuit-tracer  the export loaded as circuit-tracer's source loads it (tests/circuit_tracer_reference.py: its
                    TopK loading is not in its registry release)
    no zero latents the same circuit-tracer weights without the K zero latents the export appends

Run (every layer of the quickstart GPT-2 as a transcoder, then the table on text it never saw):

    expertize upcycle quickstart --set layers=all --set layer.kind=transcoder --set train.balance=none \
        --set output_dir=runs/qs-tc-all
    python benchmarks/export_fidelity.py runs/qs-tc-all --text data/domains/literature.jsonl --tokens 16384
"""

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _reference():
    path = REPO / "tests" / "circuit_tracer_reference.py"
    spec = importlib.util.spec_from_file_location("circuit_tracer_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--text", required=True, help="held-out text (.txt or .jsonl with a \"text\" field)")
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--context-length", type=int, default=128)
    args = parser.parse_args()

    from sparsify import SparseCoder
    from transformers import AutoTokenizer

    from expertize.conversion.data.mlp_pairs import MlpCapture
    from expertize.conversion.export.coders import export_coders
    from expertize.conversion.inspection.corpora import corpus_sequences
    from expertize.conversion.surgery.splice import load_expertize_model

    model = load_expertize_model(args.model_dir).eval()
    ids = corpus_sequences("held-out", args.text, AutoTokenizer.from_pretrained(args.model_dir), args.tokens,
                           args.context_length)  # (S, T)
    layers = model.sparse_layers()
    capture = MlpCapture(model, list(layers))
    pairs = [capture(batch) for batch in ids.split(16)]
    xy = {i: (torch.cat([p[i][0] for p in pairs]), torch.cat([p[i][1] for p in pairs])) for i in layers}  # (T, d)
    reference = _reference()
    with tempfile.TemporaryDirectory() as tmp:
        export_coders(args.model_dir, "sparsify", Path(tmp) / "sp")
        export_coders(args.model_dir, "circuit-tracer", Path(tmp) / "ct", circuit_tracer_topk=True)
        coders = SparseCoder.load_many(str(Path(tmp) / "sp"), local=True)
        config, transcoders = reference.load_transcoder_set(Path(tmp) / "ct")
    k = config["k"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    print(f"{args.model_dir}: {ids.numel():,} held-out tokens of {args.text} (context {args.context_length}), "
          f"K = {k}, float32 CPU, commit {commit.strip()}\n")
    print("| layer | tokens with < K positive pre-activations | sparsify | circuit-tracer | without the zero latents "
          "|")
    print("|---|---|---|---|---|")
    for (i, (x, y)), (hook, coder), transcoder in zip(sorted(xy.items()), sorted(coders.items()), transcoders):
        coder_layer = layers[i].sparse_coder()
        positive = (torch.nn.functional.linear(x, coder_layer.W_enc, coder_layer.b_enc) > 0).sum(-1)  # (T,)
        width = transcoder.d_transcoder - k
        bare = reference.SingleLayerTranscoder(x.shape[1], width, reference.TopK(k), transcoder.W_skip is not None)
        state = transcoder.state_dict()
        bare.load_state_dict({n: p[:width] if n in ("W_enc", "W_dec", "b_enc") else p for n, p in state.items()})
        print(f"| {i} (`{hook}`) | {(positive < k).float().mean().item():.2%} "
              f"| {(coder(x).sae_out - y).abs().max().item():.2g} | {(transcoder(x) - y).abs().max().item():.2g} "
              f"| {(bare(x) - y).abs().max().item():.2g} |")


if __name__ == "__main__":
    sys.exit(main())
