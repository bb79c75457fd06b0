"""What a bf16 capture costs in fidelity: the same recipe, seed and tokens trained from activations captured in fp32
(the default) and under bf16 autocast (train.capture_precision: bf16), both evaluated the same way (the evaluation
runs the base model in full fp32 whatever the capture's precision).

    quickstart         tiny-gpt2-shakespeare (GPT-2, d 128), layer 2, MxD K = 16, 200k tokens (recipes/quickstart.yaml)
    stories260k        stories260k (Llama, d 64, SwiGLU), layer 2, MxD K = 32, 800k tokens (recipes/stories260k-mxd.yaml)

Per model and capture: the trained layer's FVU and NMSE on the held-out pairs, ΔCE = CE(spliced) - CE(base) and
KL(base ‖ spliced); and, the noise a bf16 capture adds to what the layer learns from, the FVU of the bf16-captured
MLP inputs and outputs against the fp32 ones on the held-out sequences (`pairs FVU x / y`). The change columns are
each run minus the fp32 run: for bf16 the fidelity cost of the faster capture at the same seed, for "fp32, seed 1"
how far the metrics move when only train.seed changes (the yardstick the bf16 change is read against).

Run:  EXPERTIZE_DATA=/path/to/shared/data python benchmarks/capture_precision.py [--models quickstart,stories260k]
      [--out runs/capture-precision]    (3 runs per model: about 2 + 9 minutes on 2 CPU cores; finished runs are
                                         reused, so an interrupted invocation continues where it stopped)
"""

import argparse
import os
from pathlib import Path

import torch
from _runs import run_upcycle

from expertize.conversion.data.mlp_pairs import MlpCapture
from expertize.conversion.data.text import load_eval_sequences
from expertize.conversion.preflight import load_tokenizer
from expertize.conversion.recipe import load_recipe, recipe_to_dict
from expertize.conversion.surgery.splice import load_base_model

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"quickstart": ROOT / "recipes" / "quickstart.yaml", "stories260k": ROOT / "recipes" / "stories260k-mxd.yaml"}
RUNS = {  # name: overrides; "fp32, seed 1" is the yardstick: how much the metrics move with the training seed alone
    "fp32": ["train.capture_precision=fp32"],
    "bf16": ["train.capture_precision=bf16"],
    "fp32, seed 1": ["train.capture_precision=fp32", "train.seed=1"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--out", default="runs/capture-precision", help="output folder (finished runs are reused)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override for every run (repeatable)")
    return p.parse_args()


def fvu(got: torch.Tensor, want: torch.Tensor) -> float:
    """Σ‖got - want‖² / Σ‖want - mean(want)‖² over rows (n, d)."""
    return float((got - want).pow(2).sum() / (want - want.mean(0)).pow(2).sum())


def pair_noise(recipe) -> tuple[float, float]:
    """FVU of the bf16-autocast captured (x, y) against the fp32 ones on the recipe's held-out sequences."""
    base = load_base_model(recipe.base_model).eval()
    sequences = load_eval_sequences(recipe.data, load_tokenizer(recipe.base_model))  # (S, T)
    layer = recipe.layers[0]
    fp32, bf16 = MlpCapture(base, [layer]), MlpCapture(base, [layer], precision="bf16")
    pieces = [(fp32(batch)[layer], bf16(batch)[layer]) for batch in sequences.split(16)]
    x32, y32 = (torch.cat([p[0][j] for p in pieces]) for j in (0, 1))
    x16, y16 = (torch.cat([p[1][j] for p in pieces]) for j in (0, 1))
    return fvu(x16, x32), fvu(y16, y32)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    print("| model | run | FVU | NMSE | ΔCE | KL | pairs FVU x / y | ΔFVU | ΔΔCE |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|")
    for model in args.models.split(","):
        rows = {}
        for name, overrides in RUNS.items():
            folder = name.replace(", ", "-").replace(" ", "")
            recipe = load_recipe(str(MODELS[model]), args.overrides + overrides + [
                "train.device=cpu", f"output_dir={args.out}/{model}-{folder}",
            ])
            metrics, seconds, _ = run_upcycle(recipe_to_dict(recipe), source=f"{model}-{folder}")
            layer = metrics["layers"][str(recipe.layers[0])]
            rows[name] = (layer["fvu"], layer["nmse_paper"], metrics["ce"]["delta"], metrics["ce"]["kl_base_spliced"])
        noise = pair_noise(recipe)
        for name, (f, n, d, kl) in rows.items():
            pairs = f"{noise[0]:.1e} / {noise[1]:.1e}" if name == "bf16" else "0 (fp32 capture)"
            change = ("", "") if name == "fp32" else (f"{f - rows['fp32'][0]:+.4f}", f"{d - rows['fp32'][2]:+.4f}")
            print(f"| {model} | {name} | {f:.4f} | {n:.4f} | {d:+.4f} | {kl:.4f} | {pairs} | {change[0]} | "
                  f"{change[1]} |")


if __name__ == "__main__":
    if not os.environ.get("EXPERTIZE_DATA"):
        raise SystemExit("set EXPERTIZE_DATA to the shared data folder (stories260k's recipe reads it)")
    main()
