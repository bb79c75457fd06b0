"""Inspection from a model folder: check it, load it with its tokenizer, read the corpora, run the pass."""

import functools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ..publishing.model_folder import check_model_folder
from .corpora import InspectionError, corpus_sequences
from .stats import InspectionSettings, InspectionStats, collect_stats

__all__ = ["inspect_folder", "load_for_inspection", "token_texts"]


def load_for_inspection(model_dir: str | os.PathLike, device: str = "cpu"):
    """(model, tokenizer) of an expertize model folder, in eval mode on `device`; clear errors for anything else."""
    tokenizer = _checked_tokenizer(model_dir)
    return _load_model(model_dir, device), tokenizer


def _checked_tokenizer(model_dir: str | os.PathLike):
    """The folder's tokenizer, after checking that the folder is an expertize model with sparse layers."""
    from transformers import AutoTokenizer

    config = check_model_folder(model_dir)  # ModelFolderError (an ExpertizeError) naming what is missing
    if not config.get("sparse_layers"):
        raise InspectionError(f"{model_dir} has no sparse layers in its config.json; there is nothing to inspect")
    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)  # as `expertize eval`
    except (OSError, ValueError) as e:
        raise InspectionError(
            f"{model_dir} has no loadable tokenizer ({e}); save the tokenizer next to the model "
            "(save_model(model, dir, tokenizer))"
        ) from None


def _load_model(model_dir: str | os.PathLike, device: str):
    from ..surgery.splice import load_expertize_model

    return load_expertize_model(model_dir).to(device).eval()


def token_texts(tokenizer) -> Callable[[int], str]:
    """Display text of one token id (the tokenizer's decoding of it alone; "" for padding -1), cached."""

    @functools.lru_cache(maxsize=None)
    def text(token_id: int) -> str:
        if token_id < 0:
            return ""
        return tokenizer.decode([token_id], clean_up_tokenization_spaces=False)

    return text


def inspect_folder(
    model_dir: str | os.PathLike,
    corpora: Mapping[str, str],
    settings: InspectionSettings | None = None,
    device: str = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> InspectionStats:
    """Load an expertize model folder and measure its sparse layers over the named corpora {name: path}."""
    settings = settings or InspectionSettings()
    if not corpora:
        raise InspectionError("give at least one corpus: --corpus NAME=PATH (a .txt or .jsonl file)")
    # Everything that can be refused is checked before the weights are loaded.
    tokenizer = _checked_tokenizer(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    max_positions = config.get("max_position_embeddings") or config.get("n_positions")
    if max_positions and settings.context_length > max_positions:
        raise InspectionError(
            f"--context-length {settings.context_length} exceeds the model's {max_positions} positions; lower it"
        )
    layers = sorted(int(i) for i in config["sparse_layers"])
    if settings.layers is not None:
        missing = sorted(set(settings.layers) - set(layers))
        if missing:
            raise InspectionError(f"layer(s) {missing} are not sparse layers of {model_dir}; choose from {layers}")
    sequences = {
        name: corpus_sequences(name, str(path), tokenizer, settings.tokens, settings.context_length)
        for name, path in corpora.items()
    }
    model = _load_model(model_dir, device)
    return collect_stats(
        model, sequences, settings, token_texts(tokenizer), model_name=Path(model_dir).name, progress=progress
    )


def prompt_ids(tokenizer, prompt: str) -> torch.LongTensor:
    """(1, T) ids of a prompt, with BOS when the tokenizer has one (as packed training sequences start)."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    if not ids:
        raise InspectionError("--prompt gives no tokens; give some text")
    return torch.tensor([ids])
