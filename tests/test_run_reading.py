"""Issue 39: `inspect`, `specialize` and `export --to delphi` read their corpora the way the folder's run read its
text (its recipe.resolved.yaml: add_bos, document_marker, one raw stream), with flags to override, and warn as
`upcycle` does when the model never saw the tokens a reading inserts (conversion/data/run_reading.py)."""

import shutil
import warnings

import pytest
import torch
import yaml
from safetensors.numpy import load_file
from torch import nn

from expertize.conversion.cli import main
from expertize.conversion.data.run_reading import TextReading, warn_if_unread
from expertize.conversion.errors import ExpertizeWarning
from expertize.conversion.inspection.corpora import corpus_sequences
from expertize.conversion.recipe.data import DataConfig
from expertize.conversion.specialization.splits import pack_with_documents
from expertize.conversion.surgery.splice import save_model, splice
from expertize.modeling import TranscoderSpec, build_sparse_layer
from tests.conftest import D_MODEL, VOCAB, tiny_base_model, tiny_tokenizer, write_corpus

BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A model folder whose run read its text as one raw stream (add_bos: false, document_separator: file), as the
    quickstart now does, and the same folder without a recipe (a model saved from Python)."""
    tmp = tmp_path_factory.mktemp("reading")
    torch.manual_seed(0)
    layers = {0: build_sparse_layer(TranscoderSpec(d_in=D_MODEL, d_out=D_MODEL, num_latents=64, k=2))}
    plain = save_model(splice(tiny_base_model("llama"), layers), tmp / "plain", tiny_tokenizer())
    stream = tmp / "stream"
    shutil.copytree(plain, stream)
    (stream / "recipe.resolved.yaml").write_text(yaml.safe_dump(
        {"base_model": "x", "data": {"add_bos": False, "document_separator": "file", "document_marker": "eos"}}))
    tiny_base_model("llama").save_pretrained(tmp / "base")
    tiny_tokenizer().save_pretrained(tmp / "base")
    write_corpus(tmp / "a.txt", 60)
    return plain, stream


def test_a_folder_reads_as_its_run_recorded_and_flags_override():
    assert TextReading() == TextReading.of_folder("/nonexistent")  # no recipe: the defaults
    reading = TextReading(add_bos=False, document_separator="file", origin="x")
    assert reading.overridden("true", None, "auto") == TextReading(add_bos=True, document_separator=None,
                                                                  origin="x and flags")
    assert reading.overridden() is reading
    assert not reading.prompt_bos(tiny_tokenizer()) and TextReading().prompt_bos(tiny_tokenizer())
    assert TextReading(add_bos=False, document_marker="bos").prompt_bos(tiny_tokenizer())  # a prompt is a document


def test_inspect_corpora_read_as_the_run_read_its_text(run_folder):
    plain, stream = run_folder
    corpus = str(plain.parent / "a.txt")
    default = corpus_sequences("a", corpus, tiny_tokenizer(), 160, 16, TextReading.of_folder(plain))
    assert (default[:, 0] == BOS).all() and (default == EOS).sum() >= 4  # BOS-led, EOS after every line
    raw = corpus_sequences("a", corpus, tiny_tokenizer(), 160, 16, TextReading.of_folder(stream))
    assert not (raw == BOS).any() and not (raw == EOS).any()  # one stream: nothing inserted
    llama2c = corpus_sequences("a", corpus, tiny_tokenizer(), 160, 16,
                               TextReading(add_bos=False, document_marker="bos"))
    assert not (llama2c == EOS).any() and (llama2c == BOS).sum() >= 4


def test_delphi_cache_and_prompt_follow_the_run_reading(run_folder, tmp_path, capsys):
    """Before: every cached sequence of a raw-stream run started with the BOS its base never saw."""
    plain, stream = run_folder
    corpus = f"a={plain.parent / 'a.txt'}"
    for folder, starts_with_bos in ((plain, True), (stream, False)):
        out = tmp_path / folder.name
        assert main(["export", str(folder), "--to", "delphi", str(out), "--corpus", corpus, "--tokens", "160",
                     "--context-length", "16", "--base-model", str(plain.parent / "base"), "--no-progress"]) == 0
        shard = next((out / "layers.0.mlp").glob("*.safetensors"))
        tokens = load_file(str(shard))["tokens"]
        assert bool((tokens[:, 0] == BOS).all()) is starts_with_bos
        assert bool((tokens == EOS).any()) is starts_with_bos
    # The flags override the run's reading.
    out = tmp_path / "flags"
    assert main(["export", str(stream), "--to", "delphi", str(out), "--corpus", corpus, "--tokens", "160",
                 "--context-length", "16", "--base-model", str(plain.parent / "base"), "--no-progress",
                 "--add-bos", "true", "--document-separator", "line"]) == 0
    tokens = load_file(str(next((out / "layers.0.mlp").glob("*.safetensors"))))["tokens"]
    assert (tokens[:, 0] == BOS).all() and (tokens == EOS).any()
    capsys.readouterr()
    for folder, first in ((plain, "<s>"), (stream, "w1")):
        assert main(["inspect", str(folder), "--prompt", "w1 w2", "--per-token", "1"]) == 0
        assert capsys.readouterr().out.splitlines()[2].split()[1] == first


def test_export_refuses_reading_flags_without_text(run_folder, capsys):
    plain, _ = run_folder
    assert main(["export", str(plain), "--to", "sparsify", "/tmp/never", "--add-bos", "false"]) == 2
    assert "--add-bos only applies to --to delphi" in capsys.readouterr().err


def test_specialize_packs_with_the_run_reading():
    docs = ["w5 w6 w7", "w8 w9", "w10 w11 w12 w13"]
    ids, owners = pack_with_documents("d", docs, tiny_tokenizer(), 8, 4, reading=TextReading(add_bos=False,
                                                                                          document_marker="bos"))
    w = {f"w{i}": i + 4 for i in range(20)}  # the tiny tokenizer's ids (4 specials first)
    assert ids.flatten().tolist() == [BOS, w["w5"], w["w6"], w["w7"], BOS, w["w8"], w["w9"], BOS]
    assert owners.flatten().tolist() == [0, 0, 0, 0, 1, 1, 1, 2]
    capped, _ = pack_with_documents("d", docs, tiny_tokenizer(), 8, 4, document_tokens=1,
                                    reading=TextReading(add_bos=False, document_marker="bos"))
    assert capped.flatten().tolist() == [BOS, w["w5"], BOS, w["w8"]]  # each document its BOS and first token
    default, _ = pack_with_documents("d", docs, tiny_tokenizer(), 8, 4)
    assert default.flatten().tolist()[:6] == [BOS, w["w5"], w["w6"], w["w7"], BOS, EOS]  # BOS-led sequences


class _NeverEos(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        logits = torch.zeros(*input_ids.shape, VOCAB)
        logits[..., EOS] = -25.0
        return type("Out", (), {"logits": logits})


def test_a_reading_the_model_never_saw_is_warned_about_with_the_flags_that_change_it(tmp_path):
    corpus = write_corpus(tmp_path / "c.txt", 100)
    reading = TextReading()
    sequences = corpus_sequences("c", str(corpus), tiny_tokenizer(), 128, 16, reading)
    cfg = reading.apply(DataConfig(paths=[str(corpus)]))
    with pytest.warns(ExpertizeWarning, match=r"--corpus c: the model's CE on the '</s>' inserted after every line "
                      r"is 2\d\.\d nats .* --add-bos false --document-separator file"):
        cost = warn_if_unread(reading, cfg, tiny_tokenizer(), _NeverEos(), sequences, "--corpus c")
    assert cost.gap > 20
    raw = TextReading(add_bos=False, document_separator="file")
    sequences = corpus_sequences("c", str(corpus), tiny_tokenizer(), 128, 16, raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_unread(raw, raw.apply(cfg), tiny_tokenizer(), _NeverEos(), sequences, "--corpus c")
