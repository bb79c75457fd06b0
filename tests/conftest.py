"""Shared fixtures: tiny random base models per family, a tiny offline tokenizer, and the remote-code subprocess."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from tests.families import FAMILY_NAMES, ROWS, Sizes  # noqa: E402, F401 (FAMILY_NAMES: re-exported for the tests)

VOCAB = 99
D_MODEL = 32
D_HIDDEN = 37


def tiny_base_config(family: str, num_layers: int = 2, **fields):
    """transformers' own tiny-tester sizes (vocab 99, hidden 32, 2 layers, intermediate 37, 2 heads), the family's
    own activation and defaults (tests/families.py); `fields` override config fields."""
    sizes = Sizes(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=D_HIDDEN, num_hidden_layers=num_layers,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return ROWS[family].config(sizes, **{"bos_token_id": 1, "eos_token_id": 2, **fields})


def tiny_base_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_base_config(family)).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over VOCAB entries, built without the Hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(VOCAB - len(specials))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


def run_isolated(code: str, tmp_path: Path, timeout: int = 240, args: tuple[str, ...] = ()) -> str:
    """Run `code` (with `args` as sys.argv[1:]) in a fresh interpreter that must not import expertize, offline, with
    its own modules cache.

    Returns stdout; fails the test with the child's stderr on a non-zero exit.
    """
    guard = textwrap.dedent(
        """
        import sys
        class _NoExpertize:
            def find_spec(self, name, path=None, target=None):
                if name == "expertize" or name.startswith("expertize."):
                    raise ImportError("the remote-code path must not import expertize")
        sys.meta_path.insert(0, _NoExpertize())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
        TOKENIZERS_PARALLELISM="false",
    )
    result = subprocess.run(
        [sys.executable, "-c", guard + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=timeout,
    )
    if result.returncode != 0:
        pytest.fail(f"isolated subprocess failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout


REPO_TEST_DATA = Path(__file__).resolve().parent / "data"
"""The real checkpoints and corpora shipped in the repository (tests/data/README.md)."""


def shared_data_dir() -> Path:
    """The real checkpoints and corpora: EXPERTIZE_TEST_DATA when set (a folder with models/ and corpora/), otherwise
    the repository's own tests/data. Missing data fails the test with the fix; it never skips."""
    value = os.environ.get("EXPERTIZE_TEST_DATA")
    path = Path(value) if value else REPO_TEST_DATA
    if not (path / "models").is_dir() or not (path / "corpora").is_dir():
        where = f"EXPERTIZE_TEST_DATA={value}" if value else f"{path} (the repository's test data)"
        fix = ("point EXPERTIZE_TEST_DATA at a folder with models/ and corpora/, or unset it to use tests/data"
               if value else "restore it from git (`git checkout -- tests/data expertize/assets`); the links in "
               "tests/data need a checkout that keeps symbolic links")
        pytest.fail(f"{where} has no models/ and corpora/ folders: {fix}", pytrace=False)
    return path


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj), encoding="utf-8")


def write_corpus(path: Path, n_docs: int = 300) -> Path:
    """A seeded corpus of `n_docs` lines of random words w0..w89 (all in the tiny tokenizer's vocabulary)."""
    gen = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(n_docs):
        words = torch.randint(0, 90, (int(torch.randint(8, 40, (1,), generator=gen)),), generator=gen)
        lines.append(" ".join(f"w{int(w)}" for w in words))
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


@pytest.fixture
def tiny_run(tmp_path):
    """A tiny Llama base model + tokenizer + corpus on disk, and a recipe tree for it."""
    base = tmp_path / "base"
    tiny_base_model("llama").save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=1000)
    tree = {
        "base_model": str(base),
        "layers": [0, 1],
        "layer": {"kind": "mxd", "k": 4, "num_experts": 64},
        "data": {"source": "text", "paths": [str(corpus)], "context_length": 16, "train_tokens": 12_288,
                 "eval_tokens": 512, "eval_fraction": 0.1},
        "train": {"lr": 3e-3, "warmup_steps": 5, "tokens_per_step": 256, "shuffle_buffer_tokens": 1024,
                  "capture_batch_sequences": 16, "checkpoint_every": 8, "log_every": 4, "seed": 3, "device": "cpu"},
        "eval": {"batch_sequences": 8, "generation_prompts": 4, "prompt_tokens": 3, "continuation_tokens": 5},
        "output_dir": str(tmp_path / "run"),
    }
    return tmp_path, tree


REMOTE_CHECK = """
import json, sys, torch
from transformers import AutoModel, AutoModelForCausalLM
folder = sys.argv[1] if len(sys.argv) > 1 else "model"
ref = torch.load("reference.pt")
model, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
with torch.no_grad():
    logits = model(ref["input_ids"]).logits
torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-5)
out = model.generate(ref["input_ids"][:1, :3], max_new_tokens=4, do_sample=False)
assert out.shape == (1, 7), out.shape
assert out[0].tolist() == ref["greedy"], (out[0].tolist(), ref["greedy"])
base, info = AutoModel.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
assert type(base).__module__.startswith("transformers_modules")
# The headless model has no LM head: that checkpoint key is the only one left over (as for native models).
assert not info["missing_keys"] and not info["mismatched_keys"], info
assert info["unexpected_keys"] <= {"lm_head.weight", "embed_out.weight"}, info
with torch.no_grad():
    hidden = base(ref["input_ids"]).last_hidden_state
    torch.testing.assert_close(hidden, ref["hidden"], rtol=1e-5, atol=1e-5)
sparse = [type(b.mlp).__name__ for b in model.%(blocks)s]
try:
    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
except ValueError as err:
    assert "trust_remote_code" in str(err), err
else:
    raise AssertionError("trust_remote_code=False loaded custom code")
print(json.dumps({"sparse": sparse, "class": type(model).__name__}))
"""


def check_remote_roundtrip(model, tmp_path: Path, blocks: str, tokenizer=None) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Save `model` to tmp_path/model and reload it in an isolated interpreter through remote code (REMOTE_CHECK):
    same logits and greedy tokens, no stray keys, refused without trust_remote_code. `blocks` is the attribute path
    of the decoder blocks. Returns (the child's report, input_ids, the parent's logits)."""
    from expertize.conversion.surgery.splice import save_model

    input_ids = torch.randint(4, 99, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids).logits
        hidden = model.base_model(input_ids).last_hidden_state  # what the headless AutoModel must give
    greedy = model.generate(input_ids[:1, :3], max_new_tokens=4, do_sample=False)[0].tolist()
    save_model(model, tmp_path / "model", tokenizer=tokenizer or tiny_tokenizer())
    torch.save({"input_ids": input_ids, "logits": logits, "hidden": hidden, "greedy": greedy},
               tmp_path / "reference.pt")
    out = run_isolated(REMOTE_CHECK % {"blocks": blocks}, tmp_path)
    return json.loads(out.strip().splitlines()[-1]), input_ids, logits


# -- the default run and the opt-in runs ------------------------------------------------------------------------------
#
# `python -m pytest` runs the fast suite: it leaves out the tests marked `slow` (the MLP's contracts on the rest of
# transformers' family x kind product, and the longest end-to-end tests; .ci/run runs them with `-m slow`) and those
# marked `full_matrix` (the rest of the product's battery and the native controls; outside CI). Any `-m` expression
# chooses by itself (`-m slow`: CI's opt-in run; `-m full_matrix`: the full matrix; `-m "slow or not slow"`:
# everything CI runs; `-m "full_matrix or not full_matrix"`: everything), and a test named by its node id
# (`tests/test_x.py::test_y`) runs whatever its marks.

OPT_IN = "slow"
OPT_IN_MARKS = (OPT_IN, "full_matrix")
"""The marks a run without `-m` leaves out."""


def named_on_the_command_line(config) -> list[tuple[Path, str]]:
    """(path, node id part) of every argument that names tests by node id (`path::name...`)."""
    named = []
    for arg in config.args:
        path, sep, rest = str(arg).partition("::")
        if sep:
            named.append(((config.invocation_params.dir / path).resolve(), rest))
    return named


def opted_out(item, markexpr: str, named: list[tuple[Path, str]]) -> bool:
    """Whether the default selection leaves `item` out: it has a mark of OPT_IN_MARKS, no `-m` expression was given,
    and the command line does not name it."""
    if markexpr or all(item.get_closest_marker(mark) is None for mark in OPT_IN_MARKS):
        return False
    part = item.nodeid.partition("::")[2]
    return not any(Path(item.path).resolve() == path and (part == rest or part.startswith((rest + "::", rest + "[")))
                   for path, rest in named)


def pytest_collection_modifyitems(config, items):
    markexpr = config.getoption("markexpr", "") or ""
    named = named_on_the_command_line(config)
    dropped = [item for item in items if opted_out(item, markexpr, named)]
    if dropped:
        keep = set(map(id, dropped))
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) not in keep]


def pytest_report_header(config):
    if not (config.getoption("markexpr", "") or ""):
        return [f"the fast suite: tests marked {' or '.join(OPT_IN_MARKS)} are deselected (opt in: -m {OPT_IN}, "
                "-m full_matrix; README.md#tests)"]
    return []
