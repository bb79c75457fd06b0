"""Each tool's own loader on what expertize gives it, in a fresh interpreter: sparsify's `SparseCoder.load_many` on
an export, delphi's `LatentDataset` -> explainer -> scorer on a cache (up to the LLM call), TransformerLens's bridge
with the adapter it finds through its entry points, nnsight's `TransformersModel` editing `code_hook`. Outputs are
compared with expertize's on held-out tokens; the max abs diffs are printed (pytest -s) with their bounds.

Needs the `interop` extra (`pip install 'expertize[interop]'` and `pip install --no-deps eai-delphi`; .ci/run
installs them); a test skips, naming the package, only where its tool is absent. Slow-marked: each starts a fresh
interpreter that imports its tool (5-7 s apiece on 2 CPU cores); CI runs them."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.numpy import load_file

from expertize.conversion.cli import main
from expertize.conversion.surgery.splice import load_expertize_model
from expertize.modeling import FAMILIES
from tests.conftest import run_isolated, write_corpus
from tests.export_helpers import held_out_ids, mlp_inputs_outputs, model_folder, needs, sparse_layer

pytestmark = pytest.mark.slow


def _code_and_ablation(model, input_ids: torch.Tensor, layer: int) -> dict:
    """The expertize model's logits, the code of `layer` (index, weights) and the logits with its three most chosen
    units ablated there (`SparseLayer.intervene`): what each tool must reproduce."""
    sparse = model.sparse_layers()[layer]
    seen = {}
    hook = sparse.code_hook.register_forward_hook(lambda m, a, out: seen.setdefault("code", out))
    with torch.no_grad():
        logits = model(input_ids).logits
        hook.remove()
        units = torch.bincount(seen["code"].top_k_index.flatten()).topk(3).indices.tolist()
        with sparse.intervene(ablate=units):
            ablated = model(input_ids).logits
    return {"ids": input_ids, "logits": logits, "index": seen["code"].top_k_index,
            "weights": seen["code"].top_k_weights, "ablated": ablated, "units": units}


# -- sparsify -------------------------------------------------------------------------------------------------------

SPARSIFY_CHECK = """
import json, sys, torch
from sparsify import SparseCoder
coders = SparseCoder.load_many(sys.argv[1], local=True)
ref = torch.load("reference.pt")
report = {}
with torch.no_grad():
    for hook, coder in coders.items():
        assert coder.cfg.transcode and coder.cfg.activation == "topk", coder.cfg
        x, y = ref[hook]
        report[hook] = {"diff": (coder(x).sae_out - y).abs().max().item(), "k": coder.cfg.k,
                        "skip": coder.W_skip is not None}
print(json.dumps(report))
"""


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sparsify_loads_the_export_and_computes_each_layer(family, tmp_path, capsys):
    needs("sparsify", "eai-sparsify")
    layers = {0: sparse_layer("transcoder", family), 1: sparse_layer("skip_transcoder", family, seed=1)}
    folder = model_folder(tmp_path, layers, family)
    assert main(["export", str(folder), "--to", "sparsify", str(tmp_path / "sp")]) == 0
    seen = mlp_inputs_outputs(load_expertize_model(folder).eval(), held_out_ids())
    record = json.loads((tmp_path / "sp" / "expertize_export.json").read_text())
    torch.save({record["layers"][str(i)]: xy for i, xy in seen.items()}, tmp_path / "reference.pt")
    report = json.loads(run_isolated(SPARSIFY_CHECK, tmp_path, args=(str(tmp_path / "sp"),)).splitlines()[-1])
    print(f"sparsify ({family}) max abs diff per hookpoint (bound 1e-5): "
          f"{ {h: r['diff'] for h, r in report.items()} }")
    prefix = "layers" if family == "llama" else "h"
    assert sorted(report) == [f"{prefix}.0.mlp", f"{prefix}.1.mlp"]
    assert [report[f"{prefix}.{i}.mlp"]["skip"] for i in (0, 1)] == [False, True]
    assert all(r["k"] == 4 and r["diff"] <= 1e-5 for r in report.values()), report


# -- delphi ---------------------------------------------------------------------------------------------------------

# delphi.clients imports vLLM at import time for its Offline client (eai-delphi requires vllm); with the client of
# your own (below) nothing of vLLM runs, so where it is not installed an empty stand-in lets the package import.
VLLM_STAND_IN = """
import importlib.util, sys, types
if importlib.util.find_spec("vllm") is None:
    for name in ("vllm", "vllm.distributed", "vllm.distributed.parallel_state", "vllm.inputs"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["vllm"].LLM = sys.modules["vllm"].SamplingParams = None
    state = sys.modules["vllm.distributed.parallel_state"]
    state.destroy_distributed_environment = state.destroy_model_parallel = None
    sys.modules["vllm.inputs"].TokensPrompt = None
"""

DELPHI_CHECK = VLLM_STAND_IN + """
import asyncio, json, sys
import torch
from delphi.clients.client import Client, Response
from delphi.config import ConstructorConfig, SamplerConfig
from delphi.explainers import DefaultExplainer
from delphi.latents import LatentDataset
from delphi.scorers import DetectionScorer

cache, hook = sys.argv[1], sys.argv[2]
ref = torch.load("reference.pt")


class Recorder(Client):
    # Your own client: whatever LLM you call goes here. This one answers in the format delphi parses.
    def __init__(self):
        super().__init__("recorder")
        self.prompts = []

    async def generate(self, prompt, **kwargs):
        self.prompts.append(prompt)
        if len(self.prompts) == 1:
            return Response("[EXPLANATION]: the words the latent fires on")
        return Response(json.dumps([1] * self.shown))


dataset = LatentDataset(  # tokenizer=None: delphi loads it from the cache's model_name
    raw_dir=cache, modules=[hook], latents={hook: torch.tensor(ref["latents"])},
    sampler_cfg=SamplerConfig(n_examples_train=4, n_examples_test=4, n_quantiles=2, train_type="top"),
    constructor_cfg=ConstructorConfig(min_examples=1, n_non_activating=2, example_ctx_len=8,
                                      non_activating_source="random"),
)
# Every activation delphi reads back, against the folder's own code at the same (sequence, position, latent).
dense = ref["dense"]  # (S, T, L)
diff, count = 0.0, 0
for buffer in dataset.buffers:
    locations, activations, tokens = buffer.load()
    assert torch.equal(tokens, ref["tokens"])
    expected = dense[locations[:, 0], locations[:, 1], locations[:, 2]]
    diff = max(diff, (activations.float() - expected).abs().max().item())
    count += len(activations)
# delphi 0.1.3 decodes a (T,) window with batch_decode for one string per token; transformers 5 decodes it as one
# sequence (delphi PR #177 fixes it after 0.1.3): decode it as T sequences of one token, as transformers 4 did.
tokenizer = dataset.tokenizer
whole = tokenizer.batch_decode
tokenizer.batch_decode = lambda ids, **kwargs: whole(torch.as_tensor(ids).reshape(-1, 1), **kwargs)
records = list(dataset)
client = Recorder()
explained = asyncio.run(DefaultExplainer(client)(records[0]))
record = explained.record
record.explanation, record.extra_examples = explained.explanation, record.not_active  # as delphi's pipeline does
scorer = DetectionScorer(client, n_examples_shown=2, verbose=False)
client.shown = 2
scored = asyncio.run(scorer(record))
print(json.dumps({
    "diff": diff, "count": count, "records": sorted(r.latent.latent_index for r in records),
    "tokenizer": tokenizer.name_or_path, "explanation": explained.explanation,
    "explainer_prompt": client.prompts[0][-1]["content"], "scorer_prompt": client.prompts[1][-1]["content"],
    "scored": [s.prediction for s in scored.score],
}))
"""


def test_delphi_reads_the_cache_and_runs_explainer_and_scorer_up_to_the_llm(tmp_path, capsys):
    needs("delphi", "eai-delphi (pip install --no-deps eai-delphi)")
    layers = {0: sparse_layer("transcoder"), 1: sparse_layer("mxd", seed=1)}  # any kind: the cache is activations
    folder = model_folder(tmp_path, layers)
    write_corpus(tmp_path / "a.txt", 80)
    assert main(["export", str(folder), "--to", "delphi", str(tmp_path / "cache"), "--corpus",
                 f"a={tmp_path / 'a.txt'}", "--tokens", "512", "--context-length", "16", "--no-progress"]) == 0
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["layers.0.mlp", "layers.1.mlp"]
    tokens = torch.from_numpy(load_file(str(tmp_path / "cache" / "layers.0.mlp" / "0_11.safetensors"))["tokens"])
    model = load_expertize_model(folder).eval()
    layer = model.sparse_layers()[0]
    seen = {}
    hook = layer.code_hook.register_forward_hook(lambda m, a, out: seen.setdefault("code", out))
    with torch.no_grad():
        model(tokens)
    hook.remove()
    code = seen["code"]  # (S, T, K) index and weights
    dense = torch.zeros(*tokens.shape, layer.num_units).scatter_(-1, code.top_k_index, code.top_k_weights)
    latents = (dense > 0).sum((0, 1)).topk(3).indices.tolist()  # three latents that fire
    torch.save({"dense": dense, "tokens": tokens, "latents": latents}, tmp_path / "reference.pt")
    out = run_isolated(DELPHI_CHECK, tmp_path, args=(str(tmp_path / "cache"), "layers.0.mlp"))
    report = json.loads(out.splitlines()[-1])
    bound = dense.abs().max().item() * 2**-10  # float16 storage: half an ulp is 2^-11 relative
    print(f"delphi: max abs diff {report['diff']:.3g} over {report['count']} activations (bound {bound:.3g})")
    assert report["count"] == int((dense[..., latents] > 0).sum()) and report["diff"] <= bound, report
    assert report["records"] == sorted(latents)
    assert report["tokenizer"] == str((tmp_path / "base-llama").resolve())  # from the cache's model_name
    assert report["explanation"] == "the words the latent fires on"
    assert "<<" in report["explainer_prompt"] and "the words the latent fires on" in report["scorer_prompt"]
    # The scorer asked in batches of two examples and read back the client's answers.
    assert report["scored"] and len(report["scored"]) % 2 == 0 and all(report["scored"]), report["scored"]


# -- TransformerLens --------------------------------------------------------------------------------------------------

TRANSFORMER_LENS_CHECK = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.model_bridge.sources import build_bridge_from_module

folder = sys.argv[1]
ref = torch.load("reference.pt")
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation="eager")
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
bridge = build_bridge_from_module(model, model.config.architectures[0], hf_config=model.config, tokenizer=tokenizer)
with torch.no_grad():
    logits, cache = bridge.run_with_cache(ref["ids"])
    seen = {}

    def keep(index, hook):
        seen["index"] = index

    def ablate(weights, hook):
        return weights.masked_fill(torch.isin(seen["index"], torch.tensor(ref["units"])), 0.0)

    edited = bridge.run_with_hooks(ref["ids"], fwd_hooks=[("blocks.0.mlp.code.hook_index", keep),
                                                          ("blocks.0.mlp.code.hook_out", ablate)])
try:
    TransformerBridge.boot_transformers(folder, trust_remote_code=True, device="cpu")
    refusal = None
except ValueError as err:
    refusal = str(err)
print(json.dumps({
    "adapter": f"{type(bridge.adapter).__module__}.{type(bridge.adapter).__name__}",
    "logits": (logits - ref["logits"]).abs().max().item(),
    "index_equal": torch.equal(cache["blocks.0.mlp.code.hook_index"], ref["index"]),
    "weights": (cache["blocks.0.mlp.code.hook_out"] - ref["weights"]).abs().max().item(),
    "ablated": (edited - ref["ablated"]).abs().max().item(),
    "moved": (edited - ref["logits"]).abs().max().item(),
    "code_hooks": sorted(k for k in cache if ".mlp.code." in k),
    "components": [sorted({k.split(".")[3] for k in cache if k.startswith(f"blocks.{i}.mlp.") and k.count(".") == 4})
                   for i in (0, 1)],
    "mlp_hooks": sorted(k for k in cache if k.endswith((".mlp.hook_in", ".mlp.hook_out"))),
    "refusal": refusal,
}))
"""


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_transformer_lens_bridges_a_folder_with_the_code_hooked(family, tmp_path, capsys):
    needs("transformer_lens", "transformer-lens")
    folder = model_folder(tmp_path, {0: sparse_layer("transcoder", family)}, family)  # layer 1 stays dense
    ref = _code_and_ablation(load_expertize_model(folder).eval(), held_out_ids(2, 8), 0)
    torch.save(ref, tmp_path / "reference.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(  # not isolated from expertize: TransformerLens imports the adapter (entry point)
        [sys.executable, "-c", textwrap.dedent(TRANSFORMER_LENS_CHECK), str(folder)], capture_output=True,
        text=True, cwd=tmp_path, env={**env, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "hf")},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    print(f"TransformerLens ({family}): max abs diff logits {report['logits']:.3g}, code {report['weights']:.3g}, "
          f"ablated logits {report['ablated']:.3g} (bound 1e-5); the ablation moved the logits by "
          f"{report['moved']:.3g}")
    causal = {"llama": "Llama", "gpt2": "GPT2", "gpt_neox": "GPTNeoX"}[family]
    assert report["adapter"] == f"expertize.conversion.export.transformer_lens.Expertize{causal}ForCausalLMAdapter"
    assert report["logits"] <= 1e-5 and report["weights"] <= 1e-6 and report["index_equal"], report
    assert report["ablated"] <= 1e-5 and report["moved"] > 1e-3, report
    # Block 0 has the sparse layer's code hooked; block 1 keeps its dense MLP (and its own projection hooks).
    assert report["code_hooks"] == ["blocks.0.mlp.code.hook_index", "blocks.0.mlp.code.hook_out"], report
    assert report["mlp_hooks"] == [f"blocks.{i}.mlp.hook_{w}" for i in (0, 1) for w in ("in", "out")], report
    assert report["components"] == [["code"], ["gate", "in", "out"] if family == "llama" else ["in", "out"]], report
    # TransformerLens 4.3's boot_transformers settles the architecture from its built-in table before it asks the
    # factory that holds registered adapters (docs/export.md#transformerlens): a tripwire for when that changes.
    assert report["refusal"].startswith("Could not determine supported architecture from config.")
    assert f"Config architectures: ['Expertize{causal}ForCausalLM']" in report["refusal"]


# -- nnsight ---------------------------------------------------------------------------------------------------------

NNSIGHT_CHECK = """
import functools, json, sys, torch
from nnsight import TransformersModel

folder, blocks = sys.argv[1], sys.argv[2]
ref = torch.load("reference.pt")
model = TransformersModel(folder, task="text-generation", trust_remote_code=True, dispatch=True)
layer = functools.reduce(getattr, blocks.split("."), model)[0].mlp
units = torch.tensor(ref["units"])
with torch.no_grad():
    with model.trace(ref["ids"]):
        index = layer.code_hook.output.top_k_index.clone().save()
        weights = layer.code_hook.output.top_k_weights.clone().save()
        clean = model.output.logits.save()
    with model.trace(ref["ids"]):
        code = layer.code_hook.output
        code.top_k_weights[torch.isin(code.top_k_index, units)] = 0.0  # nnsight's in-place edit of the module output
        edited = model.output.logits.save()
print(json.dumps({
    "index_equal": torch.equal(index, ref["index"]),
    "weights": (weights - ref["weights"]).abs().max().item(),
    "logits": (clean - ref["logits"]).abs().max().item(),
    "ablated": (edited - ref["ablated"]).abs().max().item(),
    "moved": (edited - clean).abs().max().item(),
}))
"""


def test_nnsight_reads_and_edits_code_hook_of_a_saved_folder(tmp_path, capsys):
    needs("nnsight", "nnsight")
    folder = model_folder(tmp_path, {0: sparse_layer("transcoder"), 1: sparse_layer("moe_x", seed=1)})
    ref = _code_and_ablation(load_expertize_model(folder).eval(), held_out_ids(2, 8), 0)
    torch.save(ref, tmp_path / "reference.pt")
    out = run_isolated(NNSIGHT_CHECK, tmp_path, args=(str(folder), FAMILIES["llama"].blocks_path))
    report = json.loads(out.splitlines()[-1])
    print(f"nnsight: max abs diff code {report['weights']:.3g}, logits {report['logits']:.3g}, ablated logits "
          f"{report['ablated']:.3g} (bound 1e-5); the edit moved the logits by {report['moved']:.3g}")
    assert report["index_equal"] and report["weights"] <= 1e-6 and report["logits"] <= 1e-5, report
    assert report["ablated"] <= 1e-5 and report["moved"] > 1e-3, report
