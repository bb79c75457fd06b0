"""Folders and held-out activations for the export tests (tests/test_export.py, tests/test_export_tools.py)."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from expertize.conversion.publishing.local_paths import base_model_provenance
from expertize.conversion.surgery.families import decoder_blocks
from expertize.conversion.surgery.splice import save_model, splice
from expertize.modeling import SparseLayer, build_sparse_layer

from tests.conftest import tiny_base_model, tiny_tokenizer, write_json
from tests.kinds import tiny_spec

GLU = {"gpt2": False, "gpt_neox": False, "llama": True, "mistral": True, "qwen2": True}
ACTIVATION = {"gpt2": "gelu_new", "gpt_neox": "gelu", "llama": "silu", "mistral": "silu", "qwen2": "silu"}


def needs(module: str, package: str) -> None:
    """Skip (with the reason) when a tool's package is absent; CI installs them all (`.[interop]`, .ci/run)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{package} is not installed: pip install 'expertize[interop]' (.ci/run installs it)")


def tool_python(variable: str, tool: str) -> str:
    """The python of the second venv (scripts/circuit_tracer_env.sh: the tools that pin transformers 4.x), named by
    the environment `variable`; a missing one fails the test with the fix (.ci/run makes the venv)."""
    value = os.environ.get(variable)
    if not value or not Path(value).is_file():
        raise RuntimeError(
            f"{variable} must name the python of a venv with {tool} (got {value!r}): make one with "
            f"`scripts/circuit_tracer_env.sh DIR` and export {variable}=DIR/bin/python (.ci/run does both)")
    return value


def sparse_layer(kind: str, family: str = "llama", seed: int = 0, **fields) -> SparseLayer:
    """A tiny `kind` layer for `family`'s MLP with non-trivial weights (normal, std 0.3, seeded)."""
    spec = tiny_spec(kind, glu=GLU[family], activation=ACTIVATION[family])
    spec.update(fields)
    torch.manual_seed(seed)
    layer = build_sparse_layer(spec)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(std=0.3)
    return layer


def model_folder(tmp_path: Path, layers: dict[int, SparseLayer], family: str = "llama", name: str = "model") -> Path:
    """An expertize folder spliced from a saved base folder (tmp_path/base-<family>), which its provenance.json
    records as `expertize upcycle` does."""
    base = tmp_path / f"base-{family}"
    if not base.exists():
        tiny_base_model(family).save_pretrained(base)
        tiny_tokenizer().save_pretrained(base)
    folder = save_model(splice(str(base), layers), tmp_path / name, tiny_tokenizer())
    write_json(folder / "provenance.json", base_model_provenance(str(base)))
    return folder


def held_out_ids(batch: int = 4, length: int = 16, seed: int = 1) -> torch.Tensor:
    """(batch, length) token ids the layers never saw (no training happened on them)."""
    return torch.randint(4, 99, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def mlp_inputs_outputs(model, input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{sparse layer index: (its inputs (T, I), its outputs (T, O))} over `input_ids`, from the expertize model."""
    seen, hooks = {}, []
    blocks = decoder_blocks(model)
    for i in model.sparse_layers():
        def keep(module, args, output, i=i):
            seen[i] = (args[0].reshape(-1, args[0].shape[-1]).clone(), output.reshape(-1, output.shape[-1]).clone())
        hooks.append(blocks[i].mlp.register_forward_hook(keep))
    try:
        model(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return seen
