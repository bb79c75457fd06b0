"""Saved folders behave as native transformers models in a fresh process that loads them through remote code and
cannot import expertize (tests/remote_contracts.py): the native forward signature, hidden states and attentions
(equal to the native model's where the layers are the same), batched left-padded generation equal to one-by-one,
`Trainer` with default arguments, every kind under `torch.inference_mode()`, and the support matrix of docs/native.md; plus
lm-eval's `generate_until` at batch sizes 1 and 8."""

import json
from pathlib import Path

import pytest
import torch

from expertize.conversion.surgery.families import attention_projections
from expertize.conversion.surgery.splice import save_model, splice
from expertize.modeling import build_sparse_layer
from tests.conftest import FAMILY_NAMES, run_isolated, tiny_base_model, tiny_tokenizer
from tests.families import REFERENCE_FAMILY, ROWS
from tests.kinds import KINDS, tiny_spec

REMOTE_CONTRACTS = Path(__file__).with_name("remote_contracts.py")


def _random_layer(kind: str, shape, seed: int = 0):
    """A `kind` layer for `shape` with every parameter random (a fresh layer's zero decoders would output a constant)."""
    torch.manual_seed(seed)
    layer = build_sparse_layer(tiny_spec(kind, shape.d_model, shape.d_hidden, shape.activation, shape.glu))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def _folder(base, kind: str, out: Path) -> Path:
    from expertize.modeling import FAMILIES

    shape = FAMILIES[base.config.model_type].config_class(**base.config.to_dict()).mlp_shape()
    save_model(splice(base, {1: _random_layer(kind, shape)}), out, tokenizer=tiny_tokenizer())
    return out


@pytest.mark.slow  # a folder per family and kind, a subprocess (~30 s)
def test_saved_folders_keep_the_native_contracts_through_remote_code(tmp_path):
    plan = {"families": {}, "kinds": {}}
    for family in FAMILY_NAMES:
        base = tiny_base_model(family)
        base.config.pad_token_id = 3
        base_dir = tmp_path / f"{family}-base"
        base.save_pretrained(base_dir)
        plan["families"][family] = {"folder": str(_folder(base, "mxd", tmp_path / family)), "base": str(base_dir),
                                    "native": ROWS[family].native[2].__name__,
                                    "lora": attention_projections(family)}
    reference = tiny_base_model(REFERENCE_FAMILY)
    for kind in KINDS:
        plan["kinds"][kind] = str(_folder(reference, kind, tmp_path / f"{REFERENCE_FAMILY}-{kind}"))
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = run_isolated(REMOTE_CONTRACTS.read_text(), tmp_path, timeout=600, args=(str(tmp_path / "plan.json"),))
    report = json.loads(out.strip().splitlines()[-1])
    failures = [f"{family}.{name}: {value}" for family, checks in report.items() for name, value in checks.items()
                if isinstance(value, str) and value.startswith("FAIL")]
    assert not failures, "\n".join(failures)
    for family in FAMILY_NAMES:
        assert report[family]["signature"] == "native + output_router_logits"
        assert report[family]["trainer"].startswith("1 step")
        assert report[family]["batched_generation"] == "4/4 agree"
        assert report[family]["hidden_states"] == "returned, equal to native"
        sdpa = "ok" if ROWS[family].sdpa else "refused, as by the native class"
        assert report[family]["support"]["attn_implementation=sdpa"] == sdpa
        assert set(report[family]["support"]) == {
            "dtype=bfloat16", "device_map=auto", "low_cpu_mem_usage", "attn_implementation=eager",
            "attn_implementation=sdpa", "sharded save (max_shard_size) + reload", "gradient checkpointing",
            'pipeline("text-generation")', "PEFT LoRA (train, merge)", "resize_token_embeddings",
        }
    assert report["inference_mode"] == {kind: True for kind in KINDS}


LM_EVAL_GENERATE = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
tasks_dir, folders = sys.argv[1], json.loads(sys.argv[2])
report = {}
for name, folder in folders.items():
    texts = {}
    for batch_size in (1, 8):
        results = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={folder},trust_remote_code=True", tasks=["gen_probe"],
            batch_size=batch_size, device="cpu", task_manager=TaskManager(include_path=tasks_dir), log_samples=True,
        )
        samples = sorted(results["samples"]["gen_probe"], key=lambda s: s["doc_id"])
        texts[batch_size] = [s["resps"][0][0] for s in samples]
    report[name] = {"documents": len(texts[1]), "differ": sum(a != b for a, b in zip(texts[1], texts[8]))}
print(json.dumps(report))
"""

GEN_TASK = """task: gen_probe
custom_dataset: !function task_data.load_jsonl
dataset_kwargs:
  data_file: gen_probe.jsonl
test_split: test
output_type: generate_until
doc_to_text: prompt
doc_to_target: target
generation_kwargs:
  until: ["</s>"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
"""


@pytest.mark.slow  # lm-eval runs twice (~50 s)
def test_lm_eval_generate_until_is_the_same_at_batch_sizes_1_and_8(tmp_path):
    """lm-eval batches left-padded prompts of different lengths: an absolute-position family (GPT-2) decodes at
    shifted positions unless `generate` builds position ids from the mask. Native GPT-2 is the control."""
    import shutil

    from expertize.conversion.harness.offline_tasks import bundled_tasks_dir

    base = tiny_base_model("gpt2")
    base.config.pad_token_id = 3
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(bundled_tasks_dir() / "task_data.py", tasks / "task_data.py")
    (tasks / "gen_probe.yaml").write_text(GEN_TASK)
    gen = torch.Generator().manual_seed(11)
    rows = []
    for i in range(24):
        words = torch.randint(4, 90, (int(torch.randint(2, 14, (1,), generator=gen)),), generator=gen)
        rows.append(json.dumps({"prompt": " ".join(f"w{int(w)}" for w in words), "target": "w1"}))
    (tasks / "gen_probe.jsonl").write_text("\n".join(rows))
    native = tmp_path / "native"
    base.save_pretrained(native)
    tiny_tokenizer().save_pretrained(native)
    folders = {"expertize": str(_folder(base, "mxd", tmp_path / "expertize")), "native": str(native)}
    out = run_isolated(LM_EVAL_GENERATE, tmp_path, timeout=600, args=(str(tasks), json.dumps(folders)))
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {"expertize": {"documents": 24, "differ": 0}, "native": {"documents": 24, "differ": 0}}
