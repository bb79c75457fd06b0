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

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

VOCAB = 99
D_MODEL = 32
D_HIDDEN = 37


def tiny_base_config(family: str):
    """transformers' own tiny-tester sizes (vocab 99, hidden 32, 2 layers, intermediate 37)."""
    llama_like = dict(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=D_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {
        "gpt2": lambda: GPT2Config(
            vocab_size=VOCAB, n_embd=D_MODEL, n_layer=2, n_head=2, n_inner=D_HIDDEN, n_positions=64, bos_token_id=1,
            eos_token_id=2,
        ),
        "gpt_neox": lambda: GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=D_MODEL,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=D_HIDDEN,
            max_position_embeddings=64,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "llama": lambda: LlamaConfig(**llama_like),
        "mistral": lambda: MistralConfig(**llama_like),
        "qwen2": lambda: Qwen2Config(**llama_like),
    }[family]()


FAMILY_NAMES = ["gpt2", "gpt_neox", "llama", "mistral", "qwen2"]


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


def run_isolated(code: str, tmp_path: Path, timeout: int = 240) -> str:
    """Run `code` in a fresh interpreter that must not import expertize, offline, with its own modules cache.

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
        [sys.executable, "-c", guard + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=timeout,
    )
    if result.returncode != 0:
        pytest.fail(f"isolated subprocess failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout


def shared_data_dir() -> Path:
    """The real checkpoints and corpora (../shared/data), located by EXPERTIZE_TEST_DATA, set by .ci/run."""
    value = os.environ.get("EXPERTIZE_TEST_DATA")
    if not value:
        pytest.skip("EXPERTIZE_TEST_DATA is not set (point it at shared/data to run the real-checkpoint tests)")
    path = Path(value)
    if not (path / "models").is_dir():
        raise RuntimeError(f"EXPERTIZE_TEST_DATA={value} does not contain models/; point it at shared/data")
    return path


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj), encoding="utf-8")
