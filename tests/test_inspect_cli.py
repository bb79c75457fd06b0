"""`expertize inspect` end to end on a saved tiny model: the files it writes, their schema, the explorer, the
per-prompt view, the delphi cache export, and one-line errors (exit 2) for bad folders and empty corpora."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from expertize.conversion.cli import main
from expertize.conversion.inspection import LAYER_SCHEMA, SchemaError, validate
from expertize.conversion.export.delphi import split_ranges
from expertize.conversion.surgery.splice import save_model, splice
from expertize.modeling import MoeXSpec, TranscoderSpec, build_sparse_layer
from tests.conftest import D_MODEL, tiny_base_model, tiny_tokenizer, write_corpus, write_json


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inspect")
    torch.manual_seed(0)
    layers = {0: build_sparse_layer(TranscoderSpec(d_in=D_MODEL, d_out=D_MODEL, num_latents=300, k=2)),
              1: build_sparse_layer(MoeXSpec(d_in=D_MODEL, d_out=D_MODEL, d_expert=4, num_experts=4, k=2))}
    out = save_model(splice(tiny_base_model("llama"), layers), tmp / "model", tiny_tokenizer())
    tiny_base_model("llama").save_pretrained(tmp / "base")  # what the delphi cache names (the base, not the folder)
    tiny_tokenizer().save_pretrained(tmp / "base")
    write_corpus(tmp / "a.txt", 60)
    jsonl = tmp / "b.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": " ".join(f"w{(i * 7 + j) % 90}" for j in range(30))})
                               for i in range(30)), encoding="utf-8")
    return out


def _inspect(model_dir, tmp_path, *extra):
    out = tmp_path / "report"
    corpora = ["--corpus", f"plain={model_dir.parent / 'a.txt'}", "--corpus", f"json={model_dir.parent / 'b.jsonl'}"]
    code = main(["inspect", str(model_dir), *corpora, "--tokens", "400", "--context-length", "16",
                 "--output", str(out), "--top-n", "3", "--no-progress", *extra])
    assert code == 0
    return out


def test_cli_writes_valid_reports_and_a_self_contained_explorer(model_dir, tmp_path, capsys):
    out = _inspect(model_dir, tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "inspect.json", "layer_0.json", "layer_1.json"]
    jsonschema = pytest.importorskip("jsonschema")
    for layer in (0, 1):
        report = json.loads((out / f"layer_{layer}.json").read_text(encoding="utf-8"))
        validate(report, LAYER_SCHEMA)
        jsonschema.validate(report, LAYER_SCHEMA)
        assert report["layer"] == layer and report["domains"] == {"plain": 400, "json": 400}
        assert report["tokens"] == 800 and len(report["units"]) == report["num_units"]
        assert [u["id"] for u in report["units"]] == list(range(report["num_units"]))
        dead = [u for u in report["units"] if u["frequency"] == 0]
        assert len(dead) == report["dead_units"]
        assert all(not u["top_contexts"] and u["max_activation"] == 0 for u in dead)
    transcoder = json.loads((out / "layer_0.json").read_text(encoding="utf-8"))
    assert transcoder["dead_units"] > 0  # 300 latents, K = 2, 800 tokens: dead units are listed with frequency 0
    moe_x = json.loads((out / "layer_1.json").read_text(encoding="utf-8"))
    assert moe_x["routing"]["experts"] == 4 and sum(moe_x["routing"]["load"]) == pytest.approx(1.0)
    html = (out / "index.html").read_text(encoding="utf-8")
    assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html.replace(
        "https://json-schema.org", "")
    assert "<link" not in html and "src=" not in html  # no external stylesheet, script or image
    data = json.loads(html.split('id="expertize-data">')[1].split("</script>")[0].replace("<\\/", "</"))
    assert [layer["layer"] for layer in data["layers"]] == [0, 1]
    assert "layer 0 (transcoder): 300 units" in capsys.readouterr().out


def test_top_contexts_are_one_per_stretch_of_text(model_dir, tmp_path):
    """Non-maximum suppression: no two contexts of a unit share a token of their windows, and no window shows a higher
    activation than its own peak (before: per-token peaks, so neighbouring tokens gave overlapping contexts)."""
    out = _inspect(model_dir, tmp_path, "--left", "3", "--right", "2")
    shown = 0
    for layer in (0, 1):
        report = json.loads((out / f"layer_{layer}.json").read_text())
        for unit in report["units"]:
            contexts = unit["top_contexts"]
            for c in contexts:
                peak = c["activations"][c["peak"]]  # rounded to 4 decimals in the report, max to 5
                assert max(c["activations"]) == peak == pytest.approx(c["max"], abs=1e-4), (layer, unit["id"], c)
            for i, a in enumerate(contexts):
                for b in contexts[i + 1 :]:
                    same = (a["domain"], a["sequence"]) == (b["domain"], b["sequence"])
                    assert not (same and abs(a["position"] - b["position"]) <= 3 + 2), (layer, unit["id"], a, b)
            shown += len(contexts)
    assert shown > 100


def test_validator_rejects_what_the_schema_forbids(model_dir, tmp_path):
    out = _inspect(model_dir, tmp_path)
    report = json.loads((out / "layer_0.json").read_text(encoding="utf-8"))
    validate(report, LAYER_SCHEMA)
    broken = json.loads(json.dumps(report))
    broken["units"][0]["frequency"] = 1.5
    with pytest.raises(SchemaError, match=r"\$\.units\[0\]\.frequency: 1.5 > maximum 1"):
        validate(broken, LAYER_SCHEMA)
    broken = json.loads(json.dumps(report))
    del broken["units"][3]["top_contexts"]
    with pytest.raises(SchemaError, match="missing required key 'top_contexts'"):
        validate(broken, LAYER_SCHEMA)


def test_prompt_view_prints_the_units_of_each_token(model_dir, capsys):
    assert main(["inspect", str(model_dir), "--prompt", "w1 w2 w3", "--per-token", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "layer 0 (transcoder)" in lines[0] and "layer 1 (moe_x)" in lines[0]
    assert len(lines) == 2 + 4  # header, rule, BOS + 3 words
    assert lines[3].split()[:2] == ["1", "w1"]
    assert len(lines[3].split()[2].split(" ")) == 1 and ":" in lines[3].split()[2]


def test_delphi_cache_matches_every_activation(model_dir, tmp_path):
    base = model_dir.parent / "base"
    out = _inspect(model_dir, tmp_path, "--export", "delphi", "--base-model", str(base))
    # Hookpoints as delphi names them on the base model (below its `model`): the MLP's module path there.
    assert sorted(p.name for p in (out / "delphi_cache").iterdir()) == ["layers.0.mlp", "layers.1.mlp"]
    module = out / "delphi_cache" / "layers.0.mlp"
    config = json.loads((module / "config.json").read_text(encoding="utf-8"))
    assert {"dataset_repo", "dataset_split", "dataset_name", "dataset_column", "batch_size", "cache_ctx_len",
            "n_tokens", "n_splits", "model_name"} <= set(config)
    # delphi's LatentDataset loads its tokenizer from model_name: the base model, loadable (it was the folder's
    # leaf name, "model", which loads nothing).
    assert config["model_name"] == str(base)
    assert AutoTokenizer.from_pretrained(config["model_name"]).get_vocab() == tiny_tokenizer().get_vocab()
    # What delphi's TensorBuffer.load does: first latent from the file name, locations as int64, tokens as int64.
    found = []
    for start, end in split_ranges(300, config["n_splits"]):
        data = load_file(str(module / f"{start}_{end}.safetensors"))
        assert data["locations"].dtype == np.uint16 and data["activations"].dtype == np.float16
        locations = data["locations"].astype(np.int64)
        locations[:, 2] += start
        assert ((locations[:, 2] >= start) & (locations[:, 2] <= end)).all()
        found.append((locations, data["activations"], data["tokens"]))
    tokens = found[0][2]
    assert tokens.shape == (2 * 400 // 16, 16)
    locations = np.concatenate([f[0] for f in found])
    # Every token has exactly K = 2 latents listed with a positive weight (ReLU may zero some), none twice.
    per_token = {}
    for s, p, latent in locations.tolist():
        per_token.setdefault((s, p), []).append(latent)
    assert all(len(v) == len(set(v)) <= 2 for v in per_token.values())
    report = json.loads((out / "layer_0.json").read_text(encoding="utf-8"))
    counts = np.bincount(locations[:, 2], minlength=300)
    assert counts.tolist() == [round(u["frequency"] * 800) for u in report["units"]]
    top = report["units"][int(counts.argmax())]["top_contexts"][0]
    assert tokens[top["sequence"], top["position"]] >= 0


def test_errors_are_one_line_with_exit_2(model_dir, tmp_path, capsys):
    (tmp_path / "plain").mkdir()
    tiny_base_model("llama").save_pretrained(tmp_path / "plain")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n", encoding="utf-8")
    capsys.readouterr()  # save_pretrained's progress bar
    cases = [
        (["inspect", str(tmp_path / "plain"), "--corpus", str(empty), "--output", str(tmp_path / "o")],
         "not an expertize model"),
        (["inspect", str(tmp_path / "nowhere"), "--prompt", "w1"], "is not a folder"),
        (["inspect", str(model_dir), "--corpus", f"e={empty}", "--output", str(tmp_path / "o")],
         "corpus 'e' (" + str(empty) + ") is empty"),
        (["inspect", str(model_dir), "--corpus", f"x={tmp_path / 'missing.txt'}", "--output", str(tmp_path / "o")],
         "no such file"),
        (["inspect", str(model_dir), "--corpus", f"x={model_dir}", "--output", str(tmp_path / "o")],
         f"--corpus x: {str(model_dir)!r} is a directory, not a file (it holds "),
        (["inspect", str(model_dir), "--output", str(tmp_path / "o")], "give --corpus NAME=PATH"),
        (["inspect", str(model_dir), "--corpus", str(model_dir.parent / "a.txt"), "--output", str(tmp_path / "o"),
          "--export", "delphi"], "does not name a loadable base model (recorded: none); the tools load the base"),
        (["inspect", str(model_dir), "--corpus", str(model_dir.parent / "a.txt"), "--layers", "5",
          "--output", str(tmp_path / "o")], "layer(s) [5] are not sparse layers"),
    ]
    cases.append((["inspect", str(model_dir), "--corpus", str(empty), "--output", str(tmp_path / "o")],
                  "--context-length 128 is longer than"))
    for argv, message in cases:
        if "longer than" not in message and "--corpus" in argv:
            argv = argv + ["--context-length", "16"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("expertize inspect: error: ") and message in err, err
        assert "\n" not in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # trains the quickstart at its full budget (18 s on 2 CPU cores)
def test_the_prompt_example_of_docs_inspect_md_is_what_the_quickstart_prints(tmp_path, capsys):
    """The page's `--prompt` lines are the command's output on `expertize upcycle quickstart` (they were stale)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "inspect.md").read_text(encoding="utf-8")
    example = re.search(
        r"^\$ expertize inspect runs/quickstart --prompt \"(.*?)\" --per-token (\d+)\n(.*?)\n   \.\.\.", page, re.S | re.M
    )
    prompt, per_token, shown = example[1], example[2], example[3].splitlines()
    out = tmp_path / "quickstart"
    assert main(["upcycle", "quickstart", "--no-progress", "--set", f"output_dir={out}"]) == 0
    # Issue 39: the README's main command prints no warning about its own example (its reading, its dead units).
    said = capsys.readouterr()
    assert not [line for line in (said.out + said.err).splitlines() if re.search(r"WARNING |warning:", line)], said.err
    assert main(["inspect", str(out), "--prompt", prompt, "--per-token", per_token]) == 0
    printed = capsys.readouterr().out.splitlines()[: len(shown)]
    assert printed[:2] == shown[:2]  # the header
    for got, want in zip(printed[2:], shown[2:], strict=True):
        # position and token exactly, and as many unit:activation cells, each a unit of the layer with a positive
        # activation. Which units: the quickstart's training drifts between CPUs (another BLAS kernel's rounding,
        # amplified over its steps: one machine's top unit 25 read 2.69, another's 3.36, with two of four units
        # shared), so the page's units are one machine's run, not a check.
        cells = re.compile(r"\s(\d+):(-?[\d.]+)")
        assert cells.split(got)[0] == cells.split(want)[0], (got, want)
        got_units, want_units = cells.findall(got), cells.findall(want)
        assert len(got_units) == len(want_units) == int(per_token), (got, want)
        assert all(0 <= int(unit) < 3840 and float(value) > 0 for unit, value in got_units), got


def test_the_summary_reads_the_units_beside_how_much_of_the_layer_their_code_carries(model_dir, tmp_path, capsys):
    """Issue 35: inspect's summary says, per layer, the code share the run measured and the run's verdict on both
    axes (from the folder's metrics.json), so a unit report of a layer whose dense path does the work says so."""
    import shutil

    from expertize.conversion.evaluation.reading import quality_verdict
    from expertize.conversion.publishing.metrics_schema import Metrics

    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    metrics = {"layers": {"0": {"fvu": 0.02, "code_share": 0.05}, "1": {"fvu": 0.05, "code_share": 0.9}},
               "ce": {"base": 3.0, "spliced": 3.01, "delta": 0.01, "kl_base_spliced": 0.005}}
    metrics["verdict"] = quality_verdict(Metrics.from_dict(metrics)).to_dict()
    write_json(folder / "metrics.json", metrics)
    (tmp_path / "a.txt").write_text((model_dir.parent / "a.txt").read_text())
    (tmp_path / "b.jsonl").write_text((model_dir.parent / "b.jsonl").read_text())
    capsys.readouterr()
    _inspect(folder, tmp_path)
    out = capsys.readouterr().out
    assert "layer 0 (transcoder): 300 units" in out and "the code carries 5% of what the layer explains: poor" in out
    assert "the code carries 90% of what the layer explains: good" in out
    assert "verdict: poor (fidelity good, code poor;" in out
