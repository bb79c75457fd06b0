"""Does the base model read text the way the data section reads it? The cost of the tokens the reading inserts.

A text corpus is read as documents (lines, blank-line blocks or files), each followed by the tokenizer's EOS, and
every packed sequence starts with BOS (data/text.py). A base trained on a raw stream never saw an EOS after each line
of a play: it pays many nats on every inserted EOS, so its CE on the held-out text (and every ΔCE / KL measured
against it) is measured on text it does not model. Before training, `separator_cost` runs the base over a few
held-out sequences exactly as the run reads them and compares its CE on the targets that are inserted EOS tokens with
its CE on the others; `separator_warning` says so, with the reading that fixes it, when the gap is large.

Shapes: S sequences, T tokens, V vocabulary.
"""

import dataclasses
import itertools

import torch
from torch.nn import functional as F

from ..recipe.data import DataConfig
from .text import pack_sequences, split_documents

__all__ = ["GAP_NATS", "PROBE_SEQUENCES", "SeparatorCost", "check_separators", "probe_sequences", "separator_cost",
           "separator_warning"]

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
def separator_cost(base, sequences: torch.Tensor, eos_id: int | None, batch_sequences: int = 8) -> SeparatorCost:
    """CE of `base` on `sequences` (S, T), split into targets that are `eos_id` (the EOS packing puts after every
    document) and the others; position 0 (BOS or the first token) is never a target."""
    device = next(base.parameters()).device
    sums, counts = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.long)
    for lo in range(0, sequences.shape[0], batch_sequences):
        ids = sequences[lo : lo + batch_sequences].to(device)  # (B, T)
        logits = base(input_ids=ids, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
        targets = ids[:, 1:]  # (B, T-1)
        ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").double().cpu()  # (B, T-1)
        inserted = (targets == eos_id).cpu() if eos_id is not None else torch.zeros_like(ce, dtype=torch.bool)
        sums += torch.stack([ce[inserted].sum(), ce[~inserted].sum()])
        counts += torch.stack([inserted.sum(), (~inserted).sum()])
    mean = (sums / counts.clamp_min(1)).tolist()
    return SeparatorCost(mean[0], mean[1], int(counts[0]), int(counts[1]))


def probe_sequences(cfg: DataConfig, tokenizer, count: int = PROBE_SEQUENCES) -> torch.Tensor:
    """The first `count` held-out sequences (S, T), packed as the run packs them."""
    packed = itertools.islice(pack_sequences(split_documents(cfg).eval(), tokenizer, cfg, "eval"), count)
    return torch.stack(list(packed))


def separator_warning(cost: SeparatorCost, cfg: DataConfig, eos_token: str) -> str | None:
    """One line when the inserted EOS tokens cost the base `GAP_NATS` more than the rest (None otherwise): what it
    means and the reading that gives the base its own stream."""
    if cost.inserted < MIN_INSERTED or cost.gap < GAP_NATS:
        return None
    unit = {"line": "line", "blank_line": "blank-line block", "file": "file"}.get(cfg.document_separator, "document")
    fix = ("data.add_bos: false, and data.document_separator: file (each file one stream; hold text out with "
           "data.eval_paths)" if cfg.document_separator != "file" else "data.add_bos: false")
    return (
        f"warning: data: the base model's CE on the {eos_token!r} inserted after every {unit} is "
        f"{cost.inserted_ce:.1f} nats against {cost.other_ce:.2f} on the other tokens ({cost.inserted} and "
        f"{cost.others} targets of {PROBE_SEQUENCES} held-out sequences; they add {cost.excess:.2f} nats to its mean "
        f"CE): it was not trained on text read this way, so its CE and every ΔCE / KL measure text it does not "
        f"model. If it was trained on the raw file, read it as one stream: {fix}. If it marks documents another way "
        f"(llama2.c's models start each with BOS and never saw EOS), no reading matches it yet and this cost is in "
        f"every number"
    )


def check_separators(cfg: DataConfig, tokenizer, base, say) -> SeparatorCost | None:
    """Measure the inserted tokens' cost on the run's held-out text and `say` the warning when there is one; None
    when the tokenizer inserts no EOS."""
    if tokenizer.eos_token_id is None:
        return None
    cost = separator_cost(base, probe_sequences(cfg, tokenizer), tokenizer.eos_token_id)
    warning = separator_warning(cost, cfg, tokenizer.eos_token)
    if warning is not None:
        say(warning)
    return cost
