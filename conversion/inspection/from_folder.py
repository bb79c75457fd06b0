"""Inspection from a model folder: check it (config, weights, sparse kinds: publishing/model_folder.py), load it with
its tokenizer, read the corpora, run the pass."""

import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ..checks import resolve_device
from ..surgery.families import check_context_length
from ..publishing.model_folder import check_model_folder
from ..data.run_reading import TextReading, warn_if_unread
from .corpora import InspectionError, _data_config, corpus_sequences
from .output import model_identity
from .stats import InspectionSettings, InspectionStats, collect_stats

__all__ = ["inspect_folder", "load_for_inspection", "report_bytes", "token_texts"]

UNIT_JSON_BYTES = 150
"""The smallest entry of a unit in layer_<i>.json (its keys and numbers, no contexts): report_bytes' lower bound."""


def load_for_inspection(model_dir: str | os.PathLike, device: "str | torch.device" = "cpu"):
    """(model, tokenizer) of an expertize model folder, in eval mode on `device`; clear errors for anything else."""
    device = resolve_device(device, "--device")
    _, tokenizer = checked_folder(model_dir)
    return _load_model(model_dir, device), tokenizer


def checked_folder(model_dir: str | os.PathLike) -> tuple[dict, object]:
    """(config.json as a dict, tokenizer) of a folder checked to be a whole expertize model with sparse layers."""
    from transformers import AutoTokenizer

    config = check_model_folder(model_dir)  # ModelFolderError (an ExpertizeError) naming what is missing or damaged
    if not config.get("sparse_layers"):
        raise InspectionError(f"{model_dir} has no sparse layers in its config.json; there is nothing to inspect")
    try:
        return config, AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)  # as `expertize eval`
    except (OSError, ValueError) as e:
        raise InspectionError(
            f"{model_dir} has no loadable tokenizer ({e}); save the tokenizer next to the model "
            "(save_model(model, dir, tokenizer))"
        ) from None


def _load_model(model_dir: str | os.PathLike, device: "str | torch.device"):
    from ..surgery.splice import load_expertize_model

    return load_expertize_model(model_dir).to(device).eval()


def report_bytes(model_dir: str | os.PathLike, settings: InspectionSettings) -> int:
    """A lower bound of what `InspectionStats.write` writes (so that a refusal for lack of space is never a false
    alarm): every unit of every inspected layer listed in layer_<i>.json and again in index.html."""
    from expertize.modeling.sparse_layers import spec_from_dict

    config, _ = checked_folder(model_dir)
    units = 0
    for index, spec in config["sparse_layers"].items():
        if settings.layers is None or int(index) in settings.layers:
            spec = spec_from_dict(spec)
            units += int(getattr(spec, spec.units_field))  # a lower bound: MoE-X lists experts x their units
    return 2 * units * UNIT_JSON_BYTES


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
    device: "str | torch.device" = "cpu",
    progress: Callable[[int, int], None] | None = None,
    reading: TextReading | None = None,
) -> InspectionStats:
    """Load an expertize model folder and measure its sparse layers over the named corpora {name: path}, read as
    `reading` says (default: as the folder's run read its text; a warning when the model never saw the tokens the
    reading inserts)."""
    settings = settings or InspectionSettings()
    if not corpora:
        raise InspectionError("give at least one corpus: --corpus NAME=PATH (a .txt or .jsonl file)")
    # Everything that can be refused is checked before the weights are loaded.
    device = resolve_device(device, "--device")
    config, tokenizer = checked_folder(model_dir)
    check_context_length(settings.context_length, config, setting="--context-length", model=str(model_dir))
    layers = sorted(int(i) for i in config["sparse_layers"])
    if settings.layers is not None:
        missing = sorted(set(settings.layers) - set(layers))
        if missing:
            raise InspectionError(f"layer(s) {missing} are not sparse layers of {model_dir}; choose from {layers}")
    reading = reading or TextReading.of_folder(model_dir)
    sequences = {
        name: corpus_sequences(name, str(path), tokenizer, settings.tokens, settings.context_length, reading)
        for name, path in corpora.items()
    }
    model = _load_model(model_dir, device)
    for name, path in corpora.items():
        cfg = reading.apply(_data_config(str(path), settings.context_length))
        warn_if_unread(reading, cfg, tokenizer, model, sequences[name], f"--corpus {name}")
    stats = collect_stats(
        model, sequences, settings, token_texts(tokenizer), model_name=Path(model_dir).name, progress=progress
    )
    stats.model_source = model_identity(model_dir)
    return stats


def prompt_ids(
    tokenizer, prompt: str, max_positions: int | None = None, log: Callable[[str], None] | None = None,
    bos: bool | None = None,
) -> torch.LongTensor:
    """(1, T) ids of a prompt, with BOS when `bos` (None: when the tokenizer has one; the inspect command passes its
    run's reading, `TextReading.prompt_bos`, as packed training sequences start); cut to the model's `max_positions`
    (its position embedding has no row beyond them), saying so through `log`."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if bos is None:
        bos = tokenizer.bos_token_id is not None
    if bos and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    if not ids:
        raise InspectionError("--prompt gives no tokens; give some text")
    if max_positions is not None and len(ids) > max_positions:
        if log is not None:
            log(f"note: the prompt has {len(ids):,} tokens but the model reads at most {max_positions:,} positions; "
                f"showing the first {max_positions:,} (give the rest as a prompt of its own to see it)")
        ids = ids[:max_positions]
    return torch.tensor([ids])
