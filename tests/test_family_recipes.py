"""Each family's shipped recipe (tests/families.py's `recipe`, recipes/<name>.yaml) runs end to end through
`expertize upcycle` on a tiny random model of that family: the file as shipped, with only the base model, the data and
the budget overridden (its `layers: all`, kind, K and training settings are the file's). The published folder loads in
a fresh process through remote code (no expertize) with the parent's logits and greedy tokens. That a layer started
from the dense MLP gives the native logits is tests/test_dense_init.py's, for every family."""

import json

import pytest
import torch

from expertize.conversion.cli import main
from expertize.conversion.recipe import load_recipe
from expertize.conversion.surgery.splice import load_expertize_model
from tests.conftest import run_isolated, tiny_base_model, tiny_tokenizer, write_corpus
from tests.families import ROWS

RECIPE_FAMILIES = [family for family, row in ROWS.items() if row.recipe]

TINY_BUDGET = [
    "dtype=float32", "data.source=text", "data.context_length=16", "data.train_tokens=3072", "data.eval_tokens=512",
    "data.eval_fraction=0.1", "train.tokens_per_step=256", "train.warmup_steps=2", "train.checkpoint_every=0",
    "train.log_every=4", "train.precision=fp32", "train.device=cpu", "train.shuffle_buffer_tokens=1024",
    "train.capture_batch_sequences=16", "eval.batch_sequences=8", "eval.generation_prompts=2", "eval.prompt_tokens=3",
    "eval.continuation_tokens=4", "layer.k=4",
]

REMOTE_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
report = {}
for family, (folder, reference) in json.loads(sys.argv[1]).items():
    ref = torch.load(reference)
    model, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        torch.testing.assert_close(model(ref["input_ids"]).logits, ref["logits"], rtol=1e-5, atol=1e-5)
    greedy = model.generate(ref["input_ids"][:1, :3], max_new_tokens=4, do_sample=False)[0].tolist()
    assert greedy == ref["greedy"], (greedy, ref["greedy"])
    report[family] = [type(block.mlp).__name__ for block in model.model.layers]
print(json.dumps(report))
"""


def _size_override(recipe_name: str) -> str:
    """The recipe's own size setting, made tiny (an explicit unit count, or the transcoder it is matched to)."""
    layer = load_recipe(recipe_name).layer
    units = layer.units_field
    return f"layer.{units}=64" if getattr(layer, units) is not None else "layer.match_transcoder=2"


@pytest.mark.slow  # 5-25 s (subprocesses or a whole upcycle): in CI's opt-in run, off the fast suite's 8 minutes
def test_each_family_recipe_upcycles_a_tiny_random_model_and_loads_through_remote_code(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=400)
    plan, expected = {}, {}
    input_ids = torch.randint(4, 99, (2, 6), generator=torch.Generator().manual_seed(0))
    for family in RECIPE_FAMILIES:
        recipe = ROWS[family].recipe
        base = tmp_path / f"{family}-base"
        tiny_base_model(family).save_pretrained(base)
        tiny_tokenizer().save_pretrained(base)
        out = tmp_path / f"{family}-run"
        overrides = [f"base_model={base}", f"data.paths=[{corpus}]", f"output_dir={out}", _size_override(recipe),
                     *TINY_BUDGET]
        code = main(["upcycle", recipe, "--no-progress", *[arg for o in overrides for arg in ("--set", o)]])
        err = capsys.readouterr().err
        assert code == 0, f"{family}: {err[-3000:]}"

        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == f"expertize_{family}"
        assert sorted(config["sparse_layers"]) == ["0", "1"]  # the recipe's `layers: all`
        assert {spec["kind"] for spec in config["sparse_layers"].values()} == {load_recipe(recipe).layer.kind}
        metrics = json.loads((out / "metrics.json").read_text())["layers"]
        assert all(0 <= metrics[i]["fvu"] < float("inf") for i in ("0", "1")), metrics

        model = load_expertize_model(out)
        model.generation_config.eos_token_id = None  # random weights may say EOS early; the check counts 4 tokens
        with torch.no_grad():
            logits = model(input_ids).logits
        greedy = model.generate(input_ids[:1, :3], max_new_tokens=4, do_sample=False)[0].tolist()
        model.generation_config.save_pretrained(out)  # the child generates as the parent did
        torch.save({"input_ids": input_ids, "logits": logits, "greedy": greedy}, tmp_path / f"{family}.pt")
        plan[family] = (str(out), str(tmp_path / f"{family}.pt"))
        expected[family] = [type(layer).__name__ for layer in model.sparse_layers().values()]
    out = run_isolated(REMOTE_LOAD, tmp_path, timeout=600, args=(json.dumps(plan),))
    assert json.loads(out.strip().splitlines()[-1]) == expected
