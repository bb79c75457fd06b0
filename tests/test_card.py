"""Model cards: Hub metadata that parses, the tables with their formatted numbers, the loading snippet, citations."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import yaml
from expertize.conversion.evaluation.reading import quality_verdict
from expertize.conversion.publishing.card import CardInputs, write_model_card
from expertize.conversion.publishing.formats import format_count, format_number, format_percent
from expertize.conversion.publishing.metrics_schema import Metrics
from expertize.modeling import MxdLayer, MxdSpec, SkipTranscoderSpec, TranscoderSpec
from huggingface_hub import ModelCard

from tests.conftest import D_HIDDEN, D_MODEL, run_isolated, tiny_base_model, write_json

MXD = {"kind": "mxd", "d_in": 768, "d_out": 768, "d_hidden": 3072, "num_experts": 21490, "k": 32,
       "activation": "gelu_new"}
RECIPE = {"training tokens": 480_000_000, "lr": 1e-4, "steps": 117_188, "data": "Skylion007/openwebtext", "seed": 0}
METRICS = {
    "layers": {
        "8": {"nmse_paper": 0.0123456, "relative_mse": 0.0834, "fvu": 0.0912, "mse": 0.000412, "l0": 32.0,
              "dead_units": 17, "dead_fraction": 17 / 21490, "num_units": 21490},
    },
    "ce": {"base": 3.2951234, "spliced": 3.3187654, "delta": 0.023642, "kl_base_spliced": 0.0000871,
           "zero_ablation": 4.123, "mean_ablation": 3.7521,
           "ce_recovered_zero": 0.971404, "ce_recovered_mean": 0.94782},
    "generation": {"match_curve": [1.0, 0.98, 0.96, 0.9, 0.85, 0.8], "match_at_end": 0.8, "n_prompts": 200},
    "eval_tokens": 25600,
}
LM_EVAL = {
    "hellaswag": {"acc,none": {"value": 0.2891, "stderr": 0.0045, "base_value": 0.2892}},
    "lambada_openai": {"perplexity,none": {"value": 40.512, "stderr": 1.48, "base_value": 40.055}},
    "wiki_ppl": {"word_perplexity,none": {"value": 61.2, "base_value": 60.3}},
}
LM_EVAL_DETAILS = {  # as `expertize eval` records them: the Hub dataset a task reads, or local data
    "hellaswag": {"dataset": "Rowan/hellaswag", "local": False},
    "lambada_openai": {"dataset": "EleutherAI/lambada_openai", "local": False},
    "wiki_ppl": {"dataset": None, "local": True},  # made by `expertize tasks` from a local file
}


def front_matter(text: str) -> dict:
    match = re.match(r"^---\n(.*?)\n---\n", text, re.DOTALL)
    assert match, "README.md does not start with a YAML front matter block"
    return yaml.safe_load(match.group(1))


def write(model_dir, **kwargs):
    args = dict(base_model="openai-community/gpt2", layers={8: MXD}, recipe_summary=RECIPE, metrics=METRICS)
    return write_model_card(model_dir, CardInputs(**{**args, **kwargs}))


def test_number_formats():
    assert format_number(3.2951234) == "3.2951"
    assert format_number(0.023642) == "0.0236"
    assert format_number(0.0000871) == "8.710e-05"
    assert format_number(0) == "0"
    assert format_number(None) == "—"
    assert format_number(float("nan")) == "nan"
    assert format_percent(0.971404) == "97.14%"
    assert format_count(21490) == "21,490"
    assert format_count(4.8e8) == "480,000,000"


def test_card_metadata_parses(tmp_path):
    path = write(tmp_path, lm_eval=LM_EVAL, lm_eval_details=LM_EVAL_DETAILS, repo_id="someone/gpt2-mxd-l8",
                 license="llama3.2", datasets=["Skylion007/openwebtext"])
    assert path == tmp_path / "README.md"
    card = ModelCard.load(path)
    assert card.data.base_model == "openai-community/gpt2"
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert {"expertize", "mxd", "sparse-experts", "interpretability"} <= set(card.data.tags)
    assert card.data.model_name == "gpt2-mxd-l8"
    assert card.data.license == "llama3.2" and card.data.datasets == ["Skylion007/openwebtext"]
    # Public tasks by their Hub dataset; the locally made wiki_ppl is not listed as if it were a public benchmark.
    results = {(r.dataset_type, r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert results == {("Rowan/hellaswag", "hellaswag", "acc"): 0.2891,
                       ("EleutherAI/lambada_openai", "lambada_openai", "perplexity"): 40.512}
    assert all(r.source_name == "lm-evaluation-harness" for r in card.data.eval_results)
    meta = front_matter(path.read_text(encoding="utf-8"))
    assert meta["model-index"][0]["name"] == "gpt2-mxd-l8"
    # Only lm-eval results are model-index entries, not ΔCE and friends.
    assert {r["dataset"]["type"] for r in meta["model-index"][0]["results"]} == {"Rowan/hellaswag",
                                                                                 "EleutherAI/lambada_openai"}
    assert "## License" not in path.read_text(encoding="utf-8")


def test_card_without_a_known_license_or_hub_data_says_so(tmp_path):
    """Before: no `license:` and no `datasets:` at all. After: the placeholder `unknown` with a section asking for
    the base model's license; local training text is never listed as a Hub dataset."""
    path = write(tmp_path, recipe_summary={**RECIPE, "data": "local text: tinyshakespeare.txt"})
    card = ModelCard.load(path)
    assert card.data.license == "unknown" and card.data.datasets is None
    text = path.read_text(encoding="utf-8")
    assert "## License" in text and "replace `license: unknown`" in text


def test_card_reads_a_packaged_base_by_name_prompts_with_held_out_text_and_gives_a_verdict(tmp_path):
    """Before: `${EXPERTIZE_ASSETS}/...` as the lm-eval column header, "The capital of France is" for a Shakespeare
    model, no verdict, effective units with 4 decimals."""
    metrics = {**METRICS, "example_prompt": "ROMEO:\nBut soft, what light"}
    metrics["layers"] = {"8": {**METRICS["layers"]["8"], "effective_units": 461.4913}}
    metrics["verdict"] = quality_verdict(Metrics.from_dict(metrics)).to_dict()  # as upcycle records it
    text = write(tmp_path, base_model="${EXPERTIZE_ASSETS}/tiny-gpt2-shakespeare", base_model_is_hub_id=False,
                 metrics=metrics, lm_eval=LM_EVAL, lm_eval_details=LM_EVAL_DETAILS).read_text(encoding="utf-8")
    assert "| task | metric | tiny-gpt2-shakespeare | this model | Δ |" in text
    assert 'inputs = tokenizer("ROMEO:\\nBut soft, what light", return_tensors="pt")' in text
    assert "capital of France" not in text
    assert "| 461.5 |" in text and "461.4913" not in text
    assert "**Verdict: good** (fidelity good) — layer 8 FVU 0.091 is good (good < 0.1, poor > 0.3); KL(base ‖ spliced) " \
        "8.71e-05" in text
    assert "| `wiki_ppl` (local) | `word_perplexity,none` |" in text and "(local): a task made from local text" in text


def test_a_faithful_layer_whose_dense_path_does_the_work_is_not_graded_good_on_its_card(tmp_path):
    """Issue 35: the card's first result line says both axes; a code share of 5 % makes the grade poor whatever the
    fidelity (the card shows metrics.json's verdict, as upcycle recorded it)."""
    metrics = {**METRICS, "layers": {"8": {**METRICS["layers"]["8"], "fvu_mean_code": 0.137, "code_share": 0.05}}}
    metrics["verdict"] = quality_verdict(Metrics.from_dict(metrics)).to_dict()
    text = write(tmp_path, metrics=metrics).read_text(encoding="utf-8")
    assert "**Verdict: poor** (fidelity good, code poor) — layer 8's code carries 5% of what it explains: poor" in text
    assert "Verdict: good" not in text


def test_card_body_tables(tmp_path):
    text = write(tmp_path, lm_eval=LM_EVAL).read_text(encoding="utf-8")
    # Summary and replaced-layers table (parameters counted from the spec when not given).
    assert "with the MLP of layer 8 replaced by a Mixture of Decoders (MxD) layer (K = 32 of 21,490 experts" in text
    n_params = MxdSpec(d_in=768, d_out=768, d_hidden=3072, num_experts=21490, k=32).num_parameters()
    assert f"| 8 | `mxd` | 768 → 768 | 3,072 | 21,490 | 32 | {n_params:,} | activation=gelu_new |" in text
    # Training recipe.
    assert "| `training tokens` | 480,000,000 |" in text
    assert "| `lr` | 0.0001 |" in text
    assert "| `data` | Skylion007/openwebtext |" in text
    # Intrinsic metrics.
    assert "| 8 | 0.0123 | 0.0834 | 0.0912 | 4.120e-04 | 32.00 | — | — | 17 / 21,490 experts (0.08%) |" in text
    assert "Held-out text, 25,600 tokens." in text
    # CE table.
    for row in (
        "| CE, base model | 3.2951 |",
        "| CE, sparse layers spliced in | 3.3188 |",
        "| ΔCE (spliced − base) | 0.0236 |",
        "| KL(base ‖ spliced) | 8.710e-05 |",
        "| CE, MLPs zero-ablated | 4.1230 |",
        "| CE, MLPs mean-ablated | 3.7521 |",
        "| CE recovered vs zero ablation | 97.14% |",
        "| CE recovered vs mean ablation | 94.78% |",
        "| greedy continuations identical to base (200 prompts × 6 tokens) | 80.00% |",
        "| generated tokens | 1 | 2 | 4 | 6 |",
        "| identical to base | 100.0% | 98.0% | 90.0% | 80.0% |",
    ):
        assert row in text, row
    # lm-eval side by side (a task without recorded details: no "(local)" mark, no metadata).
    assert "| task | metric | openai-community/gpt2 | this model | Δ |" in text
    assert "| `hellaswag` | `acc,none` | 0.2892 | 0.2891 ± 0.0045 | -0.0001 |" in text
    assert "| `lambada_openai` | `perplexity,none` | 40.0550 | 40.5120 ± 1.4800 | +0.4570 |" in text
    # Every table row has as many cells as its header.
    for block in re.findall(r"(?:^\|.*\|\n)+", text, re.MULTILINE):
        widths = {line.count(" | ") for line in block.splitlines() if not line.startswith("|---")}
        assert len(widths) == 1, block


def test_card_loading_snippet_and_citation(tmp_path):
    write_json(tmp_path / "config.json", {"model_type": "expertize_gpt2"})
    text = write(tmp_path, repo_id="someone/gpt2-mxd-l8").read_text(encoding="utf-8")
    assert 'repo = "someone/gpt2-mxd-l8"' in text
    assert "AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)" in text
    assert "AutoTokenizer.from_pretrained(repo, trust_remote_code=True)" in text
    assert "layer = model.transformer.h[8].mlp" in text
    assert "layer.code_hook.register_forward_hook" in text
    assert "layer.encode(x)" in text
    assert "with layer.intervene(steer={unit: 10.0}):" in text
    assert MxdSpec.citation in text
    assert "arXiv:2505.21364" in text and "Oldfield, James" in text
    assert "2406.11944" not in text and "2501.18823" not in text
    assert "Made with expertize" in text


def test_mixed_kinds(tmp_path):
    layers = {
        "3": {"kind": "skip_transcoder", "d_in": 64, "d_out": 64, "num_latents": 2048, "k": 16, "num_parameters": 99},
        1: {"kind": "transcoder", "d_in": 64, "d_out": 64, "num_latents": 2048, "k": 16},
        2: {"kind": "transcoder", "d_in": 64, "d_out": 64, "num_latents": 2048, "k": 16},
    }
    inputs = CardInputs(base_model="/models/tiny", layers=layers, recipe_summary={}, metrics=None)
    path = write_model_card(tmp_path, inputs)
    card = ModelCard.load(path)
    assert {"transcoder", "skip_transcoder"} <= set(card.data.tags)
    text = path.read_text(encoding="utf-8")
    assert "`/models/tiny` with the MLPs of layers 1 and 2 replaced by TopK transcoder layers" in text
    assert "the MLP of layer 3 replaced by a skip transcoder layer (K = 16 of 2,048 latents" in text
    n_params = TranscoderSpec(d_in=64, d_out=64, num_latents=2048, k=16).num_parameters()
    assert f"| 1 | `transcoder` | 64 → 64 | 2,048 | 16 | {n_params:,} | — |" in text
    assert "| 3 | `skip_transcoder` | 64 → 64 | 2,048 | 16 | 99 | — |" in text
    assert TranscoderSpec.citation in text and SkipTranscoderSpec.citation in text
    assert "2505.21364" not in text
    assert "layer = model.transformer_blocks()[1].mlp" in text  # no config.json: the family-agnostic accessor


def test_without_metrics(tmp_path):
    path = write(tmp_path, metrics=None, recipe_summary={})
    card = ModelCard.load(path)
    assert card.data.eval_results is None
    text = path.read_text(encoding="utf-8")
    assert "model-index" not in front_matter(text)
    assert "Evaluation was not run for this model." in text
    assert "### Reconstruction" not in text and "CE, base model" not in text and "| setting | value |" not in text


def test_partial_metrics(tmp_path):
    metrics = {"layers": {"8": {"fvu": 0.25}}, "ce": {"base": 3.0, "spliced": 3.5}}
    text = write(tmp_path, metrics=metrics).read_text(encoding="utf-8")
    assert "| 8 | — | — | 0.2500 | — | — | — |" in text
    assert "| CE, sparse layers spliced in | 3.5000 |" in text
    assert "| ΔCE (spliced − base) | — |" in text
    assert "Held-out text" not in text and "generated tokens" not in text


def test_regeneration_overwrites(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n# stale card\n", encoding="utf-8")
    write(tmp_path, model_name="gpt2-mxd")
    first = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "stale card" not in first and front_matter(first)["license"] == "unknown"  # the placeholder, not mit
    assert "model-index" not in front_matter(first)

    path = write(tmp_path, model_name="gpt2-mxd", lm_eval=LM_EVAL, lm_eval_details=LM_EVAL_DETAILS)
    second = path.read_text(encoding="utf-8")
    assert second.count("## Evaluation") == 1 and second.count("# gpt2-mxd\n") == 1
    assert len(ModelCard.load(path).data.eval_results) == 2
    assert second.startswith(first.split("---\n")[0] + "---\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]  # no temporary file left behind
    # Same inputs, same card.
    assert write(tmp_path, model_name="gpt2-mxd", lm_eval=LM_EVAL, lm_eval_details=LM_EVAL_DETAILS).read_text(
        encoding="utf-8") == second


def test_bad_layers(tmp_path):
    with pytest.raises(ValueError, match="layers is empty"):
        write(tmp_path, layers={})
    with pytest.raises(ValueError, match="no 'kind'"):
        write(tmp_path, layers={8: {"k": 32}})


@pytest.mark.slow  # 5-25 s (subprocesses or a whole upcycle): in CI's opt-in run, off the fast suite's 8 minutes
def test_card_snippets_run_on_a_saved_model(tmp_path, tokenizer):
    """The card's Python snippets, pointed at a saved tiny model, run without expertize installed."""
    from expertize.conversion.surgery.splice import save_model, splice

    spec = MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=16, k=4, activation="gelu_new")
    model = splice(tiny_base_model("gpt2"), {1: MxdLayer(spec)})
    model_dir = save_model(model, tmp_path / "model", tokenizer=tokenizer)
    inputs = CardInputs(base_model="tiny-gpt2", layers={1: spec.to_dict()}, recipe_summary={}, metrics=None)
    path = write_model_card(model_dir, inputs)
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.DOTALL)
    assert len(blocks) == 2
    code = "\n".join(blocks).replace('repo = "<user>/tiny-gpt2-mxd-l1"', f"repo = {str(model_dir)!r}")
    assert str(model_dir) in code
    out = run_isolated(code + "\nprint('top_k', tuple(code.top_k_index.shape))\n", tmp_path)
    assert "top_k (" in out and ", 4)" in out


def test_lm_eval_base_stderr_and_settings_notes(tmp_path):
    lm_eval = {"st_cloze": {"acc,none": {"value": 0.41, "stderr": 0.07, "base_value": 0.43, "base_stderr": 0.071}}}
    details = {"st_cloze": {"n_shot": 0, "n_samples": 48, "n_documents": 48, "limit": None},
               "st_ppl": {"n_shot": 0, "n_samples": 8, "n_documents": 48, "limit": 8}}
    text = write(tmp_path, metrics=None, lm_eval=lm_eval, lm_eval_details=details).read_text(encoding="utf-8")
    assert "| `st_cloze` | `acc,none` | 0.4300 ± 0.0710 | 0.4100 ± 0.0700 | -0.0200 |" in text
    assert "- `st_cloze`: 0-shot, 48 documents\n" in text
    assert "- `st_ppl`: 0-shot, 8 of 48 documents, limit 8: a smoke test, not a benchmark\n" in text
    # lm-eval results without the intrinsic metrics: the card does not claim that nothing was evaluated.
    assert "Evaluation was not run" not in text and "### Reconstruction" not in text


def test_card_rebuilt_from_a_saved_folder(tmp_path, tokenizer):
    """refresh_model_card reads config.json (layers), metrics.json (metrics, training rows, lm-eval) and
    provenance.json (base), and is what `expertize upcycle` and `expertize eval` write."""
    from expertize.conversion.publishing.model_folder import ModelFolderError, refresh_model_card
    from expertize.conversion.surgery.splice import save_model, splice

    spec = MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=16, k=4, activation="gelu_new")
    folder = save_model(splice(tiny_base_model("gpt2"), {1: MxdLayer(spec)}), tmp_path / "m", tokenizer=tokenizer)
    with pytest.raises(ModelFolderError, match="records no base model"):
        refresh_model_card(folder)
    lm_eval = {"tasks": {"hellaswag": {"n_shot": 0, "n_samples": 100, "n_documents": 10042, "limit": 100,
                                       "dataset": "Rowan/hellaswag", "local": False, "metrics": LM_EVAL["hellaswag"]}}}
    write_json(folder / "metrics.json", {**METRICS, "recipe_summary": RECIPE, "lm_eval": lm_eval})
    write_json(folder / "provenance.json", {"base_model": "openai-community/gpt2"})
    card = ModelCard.load(refresh_model_card(folder))
    assert card.data.base_model == "openai-community/gpt2"
    assert [(r.dataset_type, r.metric_type, r.metric_value) for r in card.data.eval_results] == [
        ("Rowan/hellaswag", "acc", 0.2891)]
    text = card.text
    n_params = spec.num_parameters()
    assert f"| 1 | `mxd` | 32 → 32 | 37 | 16 | 4 | {n_params:,} |" in text
    assert "| `training tokens` | 480,000,000 |" in text and "| CE, base model | 3.2951 |" in text
    assert "| `hellaswag` | `acc,none` | 0.2892 | 0.2891 ± 0.0045 | -0.0001 |" in text
    assert "- `hellaswag`: 0-shot, 100 of 10,042 documents, limit 100" in text
    assert "recipe_summary" not in text and "layer = model.transformer.h[1].mlp" in text


def test_local_base_has_no_base_model_metadata(tmp_path):
    """The Hub's base_model metadata takes repository ids only: a local base is named in the text, not linked."""
    path = write(tmp_path, base_model="tiny-gpt2-shakespeare", base_model_is_hub_id=False, lm_eval=LM_EVAL)
    card = ModelCard.load(path)
    assert card.data.base_model is None and "base_model" not in front_matter(path.read_text(encoding="utf-8"))
    assert card.text.count("`tiny-gpt2-shakespeare` with the MLP of layer 8") == 1
    assert "huggingface.co/tiny-gpt2-shakespeare" not in card.text
    assert "| task | metric | tiny-gpt2-shakespeare | this model | Δ |" in card.text
    # A Metrics object renders the same card as its dict.
    from expertize.conversion.publishing.metrics_schema import Metrics

    assert write(tmp_path, metrics=Metrics.from_dict(METRICS)).read_text(encoding="utf-8") == write(
        tmp_path).read_text(encoding="utf-8")


def test_kind_facts_are_read_from_the_spec_classes():
    """Titles, unit names and citations are declared once, on each kind's spec class, and read when a card renders."""
    from expertize.conversion.publishing.card import KindInfo, _citation, _kind_info
    from expertize.modeling import LAYER_KINDS

    for kind, (spec_cls, _) in LAYER_KINDS.items():
        assert _citation(kind) == spec_cls.citation and spec_cls.citation
        assert _kind_info(kind) == KindInfo(spec_cls.title, spec_cls.unit_name, spec_cls.units_field,
                                            spec_cls.code_unit())
    assert _kind_info("mxd") == KindInfo("Mixture of Decoders (MxD)", "expert", "num_experts", "expert")
    assert _kind_info("skip_transcoder") == KindInfo("skip transcoder", "latent", "num_latents", "latent")
    assert _kind_info("moe_x") == KindInfo("MoE-X", "expert", "num_experts", "hidden unit")
    assert "oldfield2025mxd" in _citation("mxd") and "eprint        = {2505.21364}" in _citation("mxd")


@pytest.mark.slow  # 5-25 s (subprocesses or a whole upcycle): in CI's opt-in run, off the fast suite's 8 minutes
def test_a_folder_tokenizer_without_trust_remote_code_answers_no_at_once_with_stdin_closed(tmp_path, tokenizer):
    """docs/native.md: `AutoTokenizer.from_pretrained(folder)` without the flag (lm-eval, scripts) asks transformers'
    remote-code question, answered "no" at once when stdin is closed, and loads the stock tokenizer; the stock class
    loads it with no question at all. Both give the ids the flagged load gives (a fresh process without expertize)."""
    from expertize.conversion.surgery.splice import save_model, splice

    spec = MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=16, k=4, activation="gelu_new")
    model = splice(tiny_base_model("gpt2"), {1: MxdLayer(spec)})
    model_dir = save_model(model, tmp_path / "model", tokenizer=tokenizer)
    code = textwrap.dedent(f"""
        import sys, time
        sys.modules["expertize"] = None  # the loads below must not need it
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        folder, text = {str(model_dir)!r}, "To be, or not to be"
        start = time.perf_counter()
        plain = AutoTokenizer.from_pretrained(folder)
        seconds = time.perf_counter() - start
        stock = PreTrainedTokenizerFast.from_pretrained(folder)
        flagged = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        assert plain(text).input_ids == stock(text).input_ids == flagged(text).input_ids
        print(f"seconds={{seconds:.2f}}")
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
    done = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split("seconds=")[1]) < 5.0  # no 15 s wait for an answer
