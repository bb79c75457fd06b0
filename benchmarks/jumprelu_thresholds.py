"""Where a trained JumpReLU / CLT folder's dead latents sit: their thresholds against the live ones', and how far
below them their pre-activations stay (issue 47).

A latent is dead here when it never fires on the last `--tokens` tokens of `--text` (held out when the run's own
held-out split is the corpus's tail; say which in a results page). Per threshold layer it prints: latents, dead,
the median threshold θ of the live and of the dead latents, and the quantiles (10 / 50 / 90 %) of a dead latent's
gap (θ − its highest pre-activation) in units of the layer's pre-activation RMS — the unit `dead_preact_gap` uses.
A large θ ratio with large gaps means the thresholds ran away from the tokens; small gaps mean latents just under
the line.

    python benchmarks/jumprelu_thresholds.py RUN_FOLDER --text tinyshakespeare.txt --tokens 32768
"""

import argparse
from pathlib import Path

import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from expertize.conversion.data.mlp_pairs import MlpCapture
from expertize.conversion.surgery.families import decoder_blocks

QUANTILES = (0.1, 0.5, 0.9)


@torch.no_grad()
def threshold_rows(folder: Path, text: str, tokens: int, context: int = 128) -> list[dict]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(text[-tokens * 16:], return_tensors="pt").input_ids[0][-tokens:]  # the text's last tokens
    ids = ids[: len(ids) // context * context].view(-1, context)  # (B, context)
    layers = {i: block.mlp for i, block in enumerate(decoder_blocks(model))
              if getattr(block.mlp, "supports_preact_loss", False)}  # the threshold kinds' layers (the bundle's flag)
    if not layers:
        raise SystemExit(f"{folder}: no JumpReLU or CLT layer (no MLP declares supports_preact_loss)")
    capture = MlpCapture(model, sorted(layers), stop_early=False)
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    for batch in ids.split(16):
        for i, (x, _) in capture(batch).items():
            inputs[i].append(x)  # (B*context, d)
    rows = []
    for i, mlp in sorted(layers.items()):
        x = torch.cat(inputs[i])  # (T, d)
        pre = F.linear(x, mlp.W_enc, mlp.b_enc)  # (T, L)
        theta = mlp.threshold  # (L,)
        dead = (pre > theta).sum(0) == 0  # (L,)
        rms = pre.square().mean().sqrt()
        gap = ((theta - pre.max(0).values) / rms)[dead]  # (dead,)
        q = gap.quantile(torch.tensor(QUANTILES)).tolist() if dead.any() else [float("nan")] * len(QUANTILES)
        live_theta = float(theta[~dead].median())
        dead_theta = float(theta[dead].median()) if dead.any() else float("nan")
        rows.append({"layer": i, "latents": int(dead.numel()), "dead": int(dead.sum()), "tokens": int(x.shape[0]),
                     "theta_live": live_theta, "theta_dead": dead_theta, "gap": q})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--text", type=Path, required=True, help="a plain-text corpus; its tail is read")
    parser.add_argument("--tokens", type=int, default=32_768)
    args = parser.parse_args()
    rows = threshold_rows(args.folder, args.text.read_text(encoding="utf-8"), args.tokens)
    print(f"{args.folder} on the last {rows[0]['tokens']:,} tokens of {args.text.name}\n")
    print("| layer | latents | dead | θ median (live) | θ median (dead) | dead / live | gap / RMS (10 / 50 / 90 %) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        gap = " / ".join(f"{g:.2f}" for g in r["gap"])
        print(f"| {r['layer']} | {r['latents']} | {r['dead']} ({r['dead'] / r['latents']:.1%}) | "
              f"{r['theta_live']:.4f} | {r['theta_dead']:.4f} | {r['theta_dead'] / r['theta_live']:.1f}x | {gap} |")


if __name__ == "__main__":
    main()
