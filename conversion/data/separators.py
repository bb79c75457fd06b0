"""Does the base model read text the way the data section reads it? The cost of the tokens the reading inserts.

A text corpus is read as documents (lines, blank-line blocks or files), each followed by the tokenizer's EOS (or
preceded by its BOS: data.document_marker), and every packed sequence starts with BOS unless data.add_bos is false
(data/text.py). A base trained on a raw stream never saw an EOS after each line
of a play: it pays many nats on every inserted EOS, so its CE on the held-out text (and every ΔCE / KL measured
against it) is measured on text it does not model. Before training, `separator_cost` runs the base over a few
held-out sequences exactly as the run reads them and compares its CE on the targets that are inserted tokens with
its CE on the others; `separator_warning` says so, with the reading that fixes it, when the gap is large: BOS before
every document where the base reads that as its own (llama2.c), else each file as one raw stream with its end held
out. `inspect`, `specialize` and `export --to delphi` run the same check on the corpora they read.

Shapes: S sequences, T tokens, V vocabulary.
"""

import dataclasses
import itertools
from collections.abc import Callable

import torch
from torch.nn import functional as F

from ..recipe.data import DataConfig
from .text import inserted_token_id, pack_sequences, split_documents

__all__ = ["BOS_READING", "GAP_NATS", "PROBE_SEQUENCES", "SeparatorCost", "check_separators", "insertion_place", "matches",
           "probe_sequences", "reading_cost", "reading_warning", "separator_cost", "separator_warning"]

PROBE_SEQUENCES = 8
"""Held-out sequences the check reads (one forward of the base)."""
GAP_NATS = 3.0
"""The warning's bound: inserted EOS tokens cost this many nats more than the other tokens (about 20x less likely)."""
MIN_INSERTED = 4
"""Fewer inserted tokens than this in the probe tell nothing (a corpus of long documents)."""


@dataclasses.dataclass(frozen=True)
class SeparatorCost:
    """The base's mean CE (nats) on the inserted EOS targets and on every other target of the probe."""

    inserted_ce: float
    other_ce: float
    inserted: int
    """Inserted EOS targets in the probe."""
    others: int

    @property
    def gap(self) -> float:
        return self.inserted_ce - self.other_ce

    @property
    def excess(self) -> float:
        """What the inserted tokens add to the base's mean CE over all targets (nats): the gap, diluted by how rare
        they are (short documents: many)."""
        return self.gap * self.inserted / max(self.inserted + self.others, 1)


@torch.no_grad()
def separator_cost(base, sequences: torch.Tensor, inserted_id: int | None, batch_sequences: int = 8) -> SeparatorCost:
    """CE of `base` on `sequences` (S, T), split into targets that are `inserted_id` (the EOS packing puts after
    every document, or the BOS before it) and the others; position 0 (BOS or the first token) is never a target."""
    device = next(base.parameters()).device
    sums, counts = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.long)
    for lo in range(0, sequences.shape[0], batch_sequences):
        ids = sequences[lo : lo + batch_sequences].to(device)  # (B, T)
        logits = base(input_ids=ids, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
        targets = ids[:, 1:]  # (B, T-1)
        ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").double().cpu()  # (B, T-1)
        inserted = (targets == inserted_id).cpu() if inserted_id is not None else torch.zeros_like(ce, dtype=torch.bool)
        sums += torch.stack([ce[inserted].sum(), ce[~inserted].sum()])
        counts += torch.stack([inserted.sum(), (~inserted).sum()])
    mean = (sums / counts.clamp_min(1)).tolist()
    return SeparatorCost(mean[0], mean[1], int(counts[0]), int(counts[1]))


def probe_sequences(cfg: DataConfig, tokenizer, count: int = PROBE_SEQUENCES) -> torch.Tensor:
    """The first `count` held-out sequences (S, T), packed as the run packs them."""
    packed = itertools.islice(pack_sequences(split_documents(cfg).eval(), tokenizer, cfg, "eval"), count)
    return torch.stack(list(packed))


def matches(cost: SeparatorCost) -> bool:
    """The base reads the inserted tokens as its own: too few to tell, or within `GAP_NATS` of the rest."""
    return cost.inserted < MIN_INSERTED or cost.gap < GAP_NATS


BOS_READING = {"document_marker": "bos", "add_bos": False}
"""llama2.c's reading: BOS before every document, no EOS, no extra BOS at each sequence's start."""
STREAM_FIX = ("data.add_bos: false, data.document_separator: file and data.eval_split: tail (each file one stream, "
              "its end held out; or give held-out files in data.eval_paths)")


def insertion_place(cfg: DataConfig) -> str:
    """Where the reading inserts its token, for messages: "after every line", "before every document", ..."""
    unit = {"line": "line", "blank_line": "blank-line block", "file": "file"}.get(cfg.document_separator, "document")
    return f"{'before' if cfg.document_marker == 'bos' else 'after'} every {unit}"


def separator_warning(cost: SeparatorCost, cfg: DataConfig, token: str, bos_reading: SeparatorCost | None = None
                      ) -> str | None:
    """One line when the inserted tokens cost the base `GAP_NATS` more than the rest (None otherwise): what it means
    and the reading that gives the base its own text. `bos_reading`: the same probe read with BOS before every
    document (`BOS_READING`); recommended when the base reads that as its own."""
    if matches(cost):
        return None
    measured = bos_reading is not None and bos_reading.inserted >= MIN_INSERTED
    if measured and bos_reading.gap < GAP_NATS:
        fix = (f"its documents start with BOS and no EOS (llama2.c's reading: {bos_reading.inserted_ce:.2f} nats on "
               "those BOS tokens): set data.document_marker: bos and data.add_bos: false")
    else:
        tried = (f"BOS before every document instead (llama2.c's reading) costs it {bos_reading.inserted_ce:.1f} "
                 "nats, above the bound too; " if measured else "")
        stream = STREAM_FIX if cfg.document_separator != "file" else "data.add_bos: false"
        bos = "" if cfg.document_marker == "bos" or measured else (
            "; if it marks documents with BOS, set data.document_marker: bos and data.add_bos: false")
        fix = (f"{tried}if it was trained on the raw file, read it as one stream: {stream}{bos}; documents cut off "
               "mid-text (samples of a fixed length) cost this under any reading")
    return (
        f"warning: data: the base model's CE on the {token!r} inserted {insertion_place(cfg)} is "
        f"{cost.inserted_ce:.1f} nats against {cost.other_ce:.2f} on the other tokens ({cost.inserted} and "
        f"{cost.others} targets of {PROBE_SEQUENCES} held-out sequences; they add {cost.excess:.2f} nats to its mean "
        f"CE): it was not trained on text read this way, so its CE and every ΔCE / KL measure text it does not "
        f"model. The reading that matches it: {fix}"
    )


Probe = Callable[[DataConfig, object], torch.Tensor]
"""(data section, tokenizer) -> the sequences (S, T) the check reads, packed as that data section reads them."""


def reading_cost(cfg: DataConfig, tokenizer, base, probe: Probe = probe_sequences) -> SeparatorCost | None:
    """The base's cost of the tokens `cfg`'s reading inserts, on the `probe`'s sequences (default: the first
    held-out ones); None when the reading inserts nothing."""
    inserted = inserted_token_id(cfg.document_marker, tokenizer)
    if inserted is None:
        return None
    return separator_cost(base, probe(cfg, tokenizer), inserted)


def reading_warning(cfg: DataConfig, tokenizer, base, probe: Probe = probe_sequences,
                    cost: SeparatorCost | None = None) -> str | None:
    """`separator_warning` for `cfg`'s reading (its `cost` when already measured), having tried llama2.c's reading
    where the tokenizer has a BOS of its own (one more forward of the probe, only when the reading is off)."""
    cost = cost or reading_cost(cfg, tokenizer, base, probe)
    if cost is None or matches(cost):
        return None
    bos_cost = None
    if cfg.document_marker == "eos" and tokenizer.bos_token_id not in (None, tokenizer.eos_token_id):
        bos_cost = reading_cost(dataclasses.replace(cfg, **BOS_READING), tokenizer, base, probe)
    token = tokenizer.convert_ids_to_tokens(inserted_token_id(cfg.document_marker, tokenizer))
    return separator_warning(cost, cfg, token, bos_cost)


def check_separators(cfg: DataConfig, tokenizer, base, say) -> SeparatorCost | None:
    """Measure the inserted tokens' cost on the run's held-out text and `say` the warning when there is one; None
    when the reading inserts nothing."""
    cost = reading_cost(cfg, tokenizer, base)
    if cost is None:
        return None
    warning = reading_warning(cfg, tokenizer, base, cost=cost)
    if warning is not None:
        say(warning)
    return cost
