"""From a model folder and named corpora: split the documents, pack both sides, run `specialize`."""

import os
from collections.abc import Mapping

import torch

from .errors import SpecializationError
from .report import SpecializationReport, SpecializationSettings, specialize
from .splits import pack_documents, pack_with_documents, read_documents, split_documents

__all__ = ["split_corpora", "specialize_folder"]


def split_corpora(
    corpora: Mapping[str, str], tokenizer, fit_tokens: int, eval_tokens: int, context_length: int,
    eval_fraction: float = 0.3, seed: int = 0, eval_corpora: Mapping[str, str] | None = None,
    document_tokens: int | None = None, reading=None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """({domain: (S_fit, T)}, {domain: (S_eval, T)}, {domain: (S_eval, T) document index per token}).

    Each corpus's documents are split by seeded hash (splits.py), or, for a domain named in `eval_corpora`, its
    corpus is all fit and that file all eval (an explicit held-out file; a fit document that also appears verbatim
    in it is dropped). Both sides are packed separately, up to fit_tokens / eval_tokens per domain, each document
    contributing at most `document_tokens` tokens (None: whole documents), read as `reading` says (its BOS and
    document marker; data/run_reading.TextReading, None: the defaults)."""
    eval_corpora = dict(eval_corpora or {})
    if len(corpora) < 2:
        raise SpecializationError("give at least two domain corpora: --corpus NAME=PATH, repeated")
    unknown = [n for n in eval_corpora if n not in corpora]
    if unknown:
        raise SpecializationError(f"--eval-corpus names {', '.join(map(repr, unknown))}, not among the --corpus "
                                  f"domains ({', '.join(corpora)}); name the domain it holds out text for")
    fit, held, documents = {}, {}, {}
    for name, path in corpora.items():
        if name in eval_corpora:
            eval_docs = read_documents(name, eval_corpora[name], "--eval-corpus")
            seen = set(eval_docs)
            fit_docs = [d for d in read_documents(name, path) if d not in seen]
        else:
            fit_docs, eval_docs = split_documents(read_documents(name, path), seed, eval_fraction)
        fit[name] = pack_documents(name, fit_docs, tokenizer, fit_tokens, context_length, document_tokens, reading)
        held[name], documents[name] = pack_with_documents(name, eval_docs, tokenizer, eval_tokens, context_length,
                                                          document_tokens, reading)
    return fit, held, documents


def specialize_folder(
    model_dir: str | os.PathLike, corpora: Mapping[str, str], settings: SpecializationSettings | None = None, *,
    layer: int | None = None, fit_tokens: int = 32_768, eval_tokens: int = 8_192, context_length: int = 128,
    eval_fraction: float = 0.3, base: str | os.PathLike | None = None, device: "str | torch.device" = "cpu",
    progress: bool = False, eval_corpora: Mapping[str, str] | None = None, document_tokens: int | None = None,
    reading=None,
) -> SpecializationReport:
    """Load an expertize model folder (and the dense `base` model for the probing baseline, when given) and measure
    how its sparse layer specializes over the named corpora {domain: path} (`eval_corpora` {domain: path}: explicit
    held-out files, see `split_corpora`); `progress`: a bar over its stages. `reading`: the BOS and document marker
    of the packing (data/run_reading.TextReading); default: as the folder's run read its text, with a warning when
    the model never saw the tokens it inserts."""
    from ..checks import resolve_device
    from ..surgery.families import check_context_length
    from ..inspection.from_folder import _load_model, checked_folder
    from ..data.run_reading import TextReading, warn_if_unread
    from ..progress import stage_bar
    from ..recipe.data import DataConfig
    from ..surgery.splice import load_base_model
    from .report import STAGES

    settings = settings or SpecializationSettings()
    sizes = (("--tokens", fit_tokens), ("--eval-tokens", eval_tokens), ("--context-length", context_length))
    for name, value in sizes:
        if value < 2:
            raise SpecializationError(f"{name} must be at least 2, got {value}")
    if document_tokens is not None and document_tokens < 1:
        raise SpecializationError(f"--document-tokens must be at least 1, got {document_tokens}")
    device = resolve_device(device, "--device")
    config, tokenizer = checked_folder(model_dir)
    check_context_length(context_length, config, setting="--context-length", model=str(model_dir))
    with stage_bar("specialize", len(STAGES) - (base is None), enabled=progress) as stage:
        reading = reading or TextReading.of_folder(model_dir)
        fit, held, documents = split_corpora(corpora, tokenizer, fit_tokens, eval_tokens, context_length,
                                             eval_fraction, settings.seed, eval_corpora, document_tokens, reading)
        model = _load_model(model_dir, device)
        first = next(iter(held))
        packed_as = reading.apply(DataConfig(source="hub", name=first))  # the hub form pack_with_documents reads
        warn_if_unread(reading, packed_as, tokenizer, model, held[first], f"--corpus {first}")
        base_model = None if base is None else load_base_model(str(base)).to(device).eval()
        special = [i for i in tokenizer.all_special_ids if i is not None]
        return specialize(model, fit, held, special, settings, layer=layer, base_model=base_model, stage=stage,
                          held_documents=documents)
