"""The text reading of a run, for the commands that read text after it: `inspect`, `specialize`, `export --to
delphi` pack their corpora as the run packed its own (issue 39), or as flags say.

A reading is what the packing inserts into the text: BOS at the start of every sequence (`add_bos`), the token that
marks where documents meet (`document_marker`: EOS after, or BOS before, each document) and, for a base trained on
one raw stream, whole files as documents (`document_separator: file`). A run records it in its folder's
recipe.resolved.yaml (data section); a folder without one (a model saved from Python) reads with the defaults. When
the model pays far more on the inserted tokens than on the text, the command warns as `upcycle` does
(data/separators.py), naming the flags that change the reading.
"""

import dataclasses
import warnings
from pathlib import Path

import torch
import yaml

from ..errors import ExpertizeWarning
from ..recipe.data import DataConfig
from .separators import PROBE_SEQUENCES, SeparatorCost, insertion_place, matches, reading_cost
from .text import inserted_token_id, resolve_add_bos

__all__ = ["TextReading", "warn_if_unread"]

RUN_RECIPE = "recipe.resolved.yaml"  # publishing/run_folder.RESOLVED_RECIPE (data/ sits below publishing/)


@dataclasses.dataclass(frozen=True)
class TextReading:
    """How a command turns a corpus into token sequences beyond the corpus file's own structure."""

    add_bos: str | bool = "auto"
    """BOS first in every packed sequence: "auto" (when the tokenizer has one), true or false (data.add_bos)."""
    document_marker: str = "eos"
    """"eos" after every document or "bos" before it (data.document_marker)."""
    document_separator: str | None = None
    """None: each text corpus's documents are detected from it (lines, or blank-line blocks); else as data.
    document_separator ("file": the file is one raw stream, as the run read its own)."""
    origin: str = "the defaults"
    """Where the reading comes from, for messages: "the run's recipe.resolved.yaml", "the defaults", "flags"."""

    @classmethod
    def of_folder(cls, folder: str | Path) -> "TextReading":
        """The reading `folder`'s run recorded (its recipe.resolved.yaml's data section), else the defaults."""
        path = Path(folder) / RUN_RECIPE
        if not path.is_file():
            return cls()
        data = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("data") or {}
        return cls(add_bos=data.get("add_bos", "auto"), document_marker=data.get("document_marker", "eos"),
                   document_separator="file" if data.get("document_separator") == "file" else None,
                   origin=f"the run's {RUN_RECIPE}")

    def overridden(self, add_bos: str | None = None, document_marker: str | None = None,
                   document_separator: str | None = None) -> "TextReading":
        """This reading with the flags that were given (None: not given) in place of its values."""
        given = {k: v for k, v in (("add_bos", _bos_flag(add_bos)), ("document_marker", document_marker),
                                   ("document_separator", document_separator)) if v is not None}
        if not given:
            return self
        if given.get("document_separator") == "auto":
            given["document_separator"] = None
        return dataclasses.replace(self, **given, origin=f"{self.origin} and flags")

    def apply(self, cfg: DataConfig) -> DataConfig:
        """`cfg` (one corpus's data section) read this way."""
        separator = cfg.document_separator
        if self.document_separator is not None and cfg.source == "text":
            separator = self.document_separator
        return dataclasses.replace(cfg, add_bos=self.add_bos, document_marker=self.document_marker,
                                   document_separator=separator)

    def prompt_bos(self, tokenizer) -> bool:
        """Whether a prompt starts with BOS: as a packed sequence does, or as a document does (marker "bos")."""
        cfg = DataConfig(source="hub", name="prompt", add_bos=self.add_bos, document_marker=self.document_marker)
        return tokenizer.bos_token_id is not None and (resolve_add_bos(cfg, tokenizer) or self.document_marker == "bos")

    def describe(self) -> str:
        bos = {True: "BOS first", False: "no BOS first", "auto": "BOS first when the tokenizer has one"}[self.add_bos]
        files = "; each file one stream" if self.document_separator == "file" else ""
        marker = "EOS after" if self.document_marker == "eos" else "BOS before"
        return f"{bos}, {marker} every document{files} ({self.origin})"


def _bos_flag(value: str | None) -> str | bool | None:
    return {"true": True, "false": False}.get(value, value) if isinstance(value, str) else value


def warn_if_unread(reading: TextReading, cfg: DataConfig, tokenizer, model, sequences: torch.Tensor,
                   where: str) -> SeparatorCost | None:
    """Warn (ExpertizeWarning) when `model` pays far more on the tokens `reading` inserts into `sequences` (S, T),
    packed as `cfg` (one corpus read `reading`'s way) says, than on the text, as `upcycle` warns about its own
    reading; the measured cost (None: nothing is inserted)."""
    probe = sequences[:PROBE_SEQUENCES]
    cost = reading_cost(cfg, tokenizer, model, probe=lambda *_: probe)
    if cost is not None and not matches(cost):
        token = tokenizer.convert_ids_to_tokens(inserted_token_id(cfg.document_marker, tokenizer))
        warnings.warn(
            f"{where}: the model's CE on the {token!r} inserted {insertion_place(cfg)} is {cost.inserted_ce:.1f} nats "
            f"against {cost.other_ce:.2f} on the other tokens ({cost.inserted} and {cost.others} targets of the first "
            f"{len(probe)} sequences): it was not trained on text read this way, so what is measured on these tokens "
            f"is not what it does on its own text. Reading: {reading.describe()}; read the corpus as its base was "
            "trained with --add-bos, --document-marker and --document-separator (one raw stream: --add-bos false "
            "--document-separator file; llama2.c: --document-marker bos --add-bos false)",
            ExpertizeWarning, stacklevel=2,
        )
    return cost
