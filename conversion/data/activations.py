"""Activation batches for distillation: captured (MLP input, MLP output) pairs, shuffled across sequences.

The shuffle buffer works in chunks: chunk c is the next `chunk_sequences` packed sequences; their tokens are
captured in one go and permuted with a generator seeded by (seed, c). The permuted chunks form one token stream
and step s takes its tokens [s * tokens_per_step, (s + 1) * tokens_per_step): a step may span two chunks, so no
token is dropped between chunks and ceil(train_tokens / T) sequences always cover train_tokens // tokens_per_step
steps (what `check_data` counts up front). Because the position in the stream is a pure function of the step, a
resumed run recomputes only the current chunk and continues with exactly the batches an uninterrupted run would
have seen.

Under data parallelism every rank walks the same chunks and keeps the sequences i ≡ rank (mod world size), so a
global step always covers `tokens_per_step` distinct tokens.

Excluded positions (`exclude_token_ids`, the special tokens with data.exclude_special_positions): the stream and its
step boundaries stay those of every position, so the budget and the resume arithmetic do not change; each step's
batch then keeps only the rows of its `tokens_per_step` positions whose token is not excluded (a few fewer rows).

A streamed corpus (data.source: hub) cannot be counted up front; it is checked while streaming: the batches end
with the text, and the trainer raises `RunFailed` if steps are still due.
"""

import itertools
import math
from collections.abc import Callable, Collection, Iterator

import torch

from .capture import MlpCapture, kept_positions

Batch = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (x, y), each (tokens, d_model)


class ActivationBatches:
    def __init__(
        self,
        capture: MlpCapture,
        sequences_from: Callable[[int], Iterator[torch.Tensor]],
        *,
        context_length: int,
        tokens_per_step: int,
        shuffle_buffer_tokens: int,
        capture_batch_sequences: int,
        seed: int,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        exclude_token_ids: Collection[int] = (),
    ) -> None:
        """`sequences_from(n)` yields the packed training sequences (each (T,)) starting at sequence n; the rows of
        positions holding a token of `exclude_token_ids` are left out of the batches (see the module docstring)."""
        if tokens_per_step % world_size:
            raise ValueError(
                f"train.tokens_per_step={tokens_per_step} is not divisible by the {world_size} processes; "
                "choose a multiple of the process count"
            )
        self.capture, self.sequences_from, self.context_length = capture, sequences_from, context_length
        self.local_tokens = tokens_per_step // world_size
        # A chunk holds at least one step and at least the shuffle buffer, in whole sequences per rank.
        per_rank = math.ceil(max(shuffle_buffer_tokens, tokens_per_step) / (context_length * world_size))
        self.chunk_sequences = per_rank * world_size
        self.capture_batch_sequences, self.seed, self.device = capture_batch_sequences, seed, device
        self.rank, self.world_size = rank, world_size
        self.exclude_token_ids = sorted(set(exclude_token_ids))

    def _chunk(self, index: int, stream: Iterator[torch.Tensor]) -> tuple[Batch, torch.Tensor | None] | None:
        """Chunk `index` captured and permuted: (layer -> (x, y), each (tokens, d_model); keep (tokens,) bool or None
        when nothing is excluded); None when the text ended."""
        sequences = list(itertools.islice(stream, self.chunk_sequences))
        # The last chunk may be short (the token budget ends inside it); every rank keeps the same number.
        usable = len(sequences) // self.world_size * self.world_size
        mine = sequences[self.rank : usable : self.world_size]
        if not mine:
            return None
        data, keep = self._rows(mine)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n_tokens = next(iter(data.values()))[0].shape[0]
        order = torch.randperm(n_tokens, generator=gen).to(self.device)
        data = {layer: (x[order], y[order]) for layer, (x, y) in data.items()}
        keep = None if keep is None else keep[order]  # (tokens,), permuted like the rows
        return data, keep

    def _rows(self, mine: list) -> tuple[Batch, torch.Tensor | None]:
        """This rank's sequences of a chunk as rows in stream order, before the shuffle: (layer -> (x, y), each
        (tokens, d_model); keep (tokens,) bool or None). Captured here; the activation cache's reader
        (`data/cache.py`) overrides it to read the same rows from disk, so both share the shuffle above."""
        pieces: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        keeps = []
        for start in range(0, len(mine), self.capture_batch_sequences):
            input_ids = torch.stack(mine[start : start + self.capture_batch_sequences]).to(self.device)  # (B, T)
            for layer, pair in self.capture(input_ids).items():
                pieces.setdefault(layer, []).append(pair)
            keeps.append(kept_positions(input_ids, self.exclude_token_ids))  # (B*T,) or None
        data = {layer: (torch.cat([x for x, _ in ps]), torch.cat([y for _, y in ps])) for layer, ps in pieces.items()}
        return data, None if keeps[0] is None else torch.cat(keeps)

    def batches(self, start_step: int = 0) -> Iterator[Batch]:
        """Per-step batches from `start_step` on, until the text ends (the trainer decides when to stop earlier and
        raises RunFailed when the batches end before its last step: a streamed corpus shorter than the budget)."""
        chunk_tokens = self.chunk_sequences // self.world_size * self.context_length  # per rank, full chunks
        chunk, skip = divmod(start_step * self.local_tokens, chunk_tokens)
        stream = self.sequences_from(chunk * self.chunk_sequences)
        carry = None  # the tokens of the previous chunk that did not fill a step: (data, keep)
        while True:
            captured = self._chunk(chunk, stream)
            if captured is None:  # the text ended; the trainer reports it if steps are still due
                return
            data, keep = captured
            if skip:  # resuming inside this chunk: drop the tokens of the steps already done
                data = {layer: (x[skip:], y[skip:]) for layer, (x, y) in data.items()}
                keep = None if keep is None else keep[skip:]
                skip = 0
            if carry is not None and next(iter(carry[0].values()))[0].shape[0]:  # a step spans two chunks
                data = {layer: (torch.cat([carry[0][layer][0], x]), torch.cat([carry[0][layer][1], y]))
                        for layer, (x, y) in data.items()}
                keep = None if keep is None else torch.cat([carry[1], keep])
            n_tokens = next(iter(data.values()))[0].shape[0]
            steps = n_tokens // self.local_tokens
            for i in range(steps):
                window = slice(i * self.local_tokens, (i + 1) * self.local_tokens)
                if keep is None:
                    yield {layer: (x[window], y[window]) for layer, (x, y) in data.items()}
                else:  # the step's positions minus the excluded ones
                    rows = keep[window]  # (local_tokens,) bool
                    yield {layer: (x[window][rows], y[window][rows]) for layer, (x, y) in data.items()}
            cut = steps * self.local_tokens
            carry = (
                {layer: (x[cut:], y[cut:]) for layer, (x, y) in data.items()},
                None if keep is None else keep[cut:],
            )
            chunk += 1
