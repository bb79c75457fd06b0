"""Issue 36: the kind checklist (CONTRIBUTING.md, "Add a layer kind", items 1-5) proven end to end. A toy kind is
written into a scratch copy of the Hub bundle by the checklist's steps alone — its file, the registry row, the
exports, a direct import in each entry file — a model with it is saved by that bundle, and the folder loads in a
fresh process through `trust_remote_code=True` (no expertize, no scratch bundle on the path), reproduces the saved
logits and generates. The in-process toy-kind tests (tests/toy_kind.py) register the kind in the process that loads
it, so they never showed that a kind added by the checklist survives a fresh load."""

import json
import shutil
from pathlib import Path

import pytest

import expertize.modeling
from tests.conftest import run_isolated

TOY = Path(__file__).with_name("toy_kind.py")
BUNDLE = Path(expertize.modeling.__file__).parent

KIND_FILE_HEADER = '''"""A toy ReLU-TopK kind written by the kind checklist (tests/test_kind_checklist_fresh.py)."""

import dataclasses
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from .sparse_base import SparseLayer, linear_bound, uniform_
from .sparse_code import SparseCode
from .sparse_kernels import relu_topk, sparse_rows_sum
from .sparse_spec import SparseSpec, _require_int

'''


def _kind_file() -> str:
    """Checklist item 1: the kind's file, the toy kind's spec and layer (tests/toy_kind.py) with the bundle's own
    single-dot imports, as a kind file of the bundle has them."""
    source = TOY.read_text(encoding="utf-8")
    body = source[source.index('TOY_KIND = "toy_topk"'):source.index("TOY_TINY_FIELDS: dict")]
    return KIND_FILE_HEADER + body


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")


def write_scratch_bundle(root: Path) -> Path:
    """A copy of the bundle as the package `toybundle` with the toy kind added by checklist items 1-5."""
    bundle = root / "toybundle"
    shutil.copytree(BUNDLE, bundle, ignore=shutil.ignore_patterns("__pycache__"))
    (bundle / "toy_topk.py").write_text(_kind_file(), encoding="utf-8")  # 1. the kind's file
    _append(bundle / "sparse_layers.py", '\nfrom .toy_topk import ToyLayer, ToySpec  # noqa: E402\n\n'
            'LAYER_KINDS["toy_topk"] = (ToySpec, ToyLayer)\n')  # 2. the registry row
    _append(bundle / "__init__.py", '\nfrom .toy_topk import ToyLayer, ToySpec  # noqa: E402\n\n'
            '__all__ = [*__all__, "ToyLayer", "ToySpec"]\n')  # 3. the exports
    _append(bundle / "modeling_expertize.py", "\nfrom .toy_topk import ToyLayer  # noqa: E402, F401\n")  # 4.
    _append(bundle / "configuration_expertize.py", "\nfrom .toy_topk import ToySpec  # noqa: E402, F401\n")  # 5.
    return bundle


SAVE = """
import sys
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[1])  # the scratch bundle, imported as a package
from toybundle.configuration_expertize import ExpertizeLlamaConfig
from toybundle.modeling_expertize import ExpertizeLlamaForCausalLM

torch.manual_seed(0)
config = ExpertizeLlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    sparse_layers={1: {"kind": "toy_topk", "d_in": 32, "d_out": 32, "num_latents": 24, "k": 3}},
)
model = ExpertizeLlamaForCausalLM(config).eval()
out = Path(sys.argv[2])
model.save_pretrained(out)
ids = torch.arange(12).view(1, 12) % 64
with torch.no_grad():
    torch.save({"ids": ids, "logits": model(input_ids=ids).logits}, out / "reference.pt")
print(sorted(p.name for p in out.glob("*.py")))
"""

LOAD = """
import json
import sys

import torch
from transformers import AutoModelForCausalLM

folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
saved = torch.load(f"{folder}/reference.pt")
with torch.no_grad():
    logits = model(input_ids=saved["ids"]).logits
generated = model.generate(saved["ids"][:, :4], min_new_tokens=5, max_new_tokens=5, do_sample=False)
print(json.dumps({"mlp": type(model.model.layers[1].mlp).__name__, "dense": type(model.model.layers[0].mlp).__name__,
                  "max_diff": (logits - saved["logits"]).abs().max().item(), "generated": generated.shape[1],
                  "module": type(model).__module__}))
"""


@pytest.mark.slow  # 5-25 s (subprocesses or a whole upcycle): in CI's opt-in run, off the fast suite's 8 minutes
def test_a_kind_added_by_the_checklist_loads_in_a_fresh_process(tmp_path):
    bundle = write_scratch_bundle(tmp_path / "scratch")
    folder = tmp_path / "model"
    saved = run_isolated(SAVE, tmp_path, args=(str(bundle.parent), str(folder)))
    # save_pretrained copied the entry files and everything they import, the checklist's direct imports included.
    assert "toy_topk.py" in saved and "modeling_expertize.py" in saved and "configuration_expertize.py" in saved
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert config["sparse_layers"]["1"]["kind"] == "toy_topk" and "AutoModelForCausalLM" in config["auto_map"]
    loaded = json.loads(run_isolated(LOAD, tmp_path, args=(str(folder),)).strip().splitlines()[-1])
    assert loaded["mlp"] == "ToyLayer" and loaded["dense"] != "ToyLayer"
    assert loaded["module"].startswith("transformers_modules.")  # the folder's own code, not the scratch bundle
    assert loaded["max_diff"] == 0.0 and loaded["generated"] == 9
