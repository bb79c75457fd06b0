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

A streamed corpus (data.source: hub) cannot be counted up front; it is checked while streaming: the batches end
with the text, and the trainer raises `RunFailed` if steps are still due.
"""

import itertools
import math
from collections.abc import Callable, Iterator

import torch

from .capture import MlpCapture

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
    ) -> None:
        """`sequences_from(n)` yields the packed training sequences (each (T,)) starting at sequence n."""
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

    def _chunk(self, index: int, stream: Iterator[torch.Tensor]) -> Batch | None:
        """Chunk `index` captured and permuted: layer -> (x, y), each (tokens, d_model); None when the text ended."""
        sequences = list(itertools.islice(stream, self.chunk_sequences))
        # The last chunk may be short (the token budget ends inside it); every rank keeps the same number.
        usable = len(sequences) // self.world_size * self.world_size
        mine = sequences[self.rank : usable : self.world_size]
        if not mine:
            return None
        pieces: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for start in range(0, len(mine), self.capture_batch_sequences):
            input_ids = torch.stack(mine[start : start + self.capture_batch_sequences]).to(self.device)  # (B, T)
            for layer, pair in self.capture(input_ids).items():
                pieces.setdefault(layer, []).append(pair)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n_tokens = len(mine) * mine[0].numel()
        order = torch.randperm(n_tokens, generator=gen).to(self.device)
        return {
            layer: (torch.cat([x for x, _ in pairs])[order], torch.cat([y for _, y in pairs])[order])
            for layer, pairs in pieces.items()
        }

    def batches(self, start_step: int = 0) -> Iterator[Batch]:
        """Per-step batches from `start_step` on, until the text ends (the trainer decides when to stop earlier and
        raises RunFailed when the batches end before its last step: a streamed corpus shorter than the budget)."""
        chunk_tokens = self.chunk_sequences // self.world_size * self.context_length  # per rank, full chunks
        chunk, skip = divmod(start_step * self.local_tokens, chunk_tokens)
        stream = self.sequences_from(chunk * self.chunk_sequences)
        carry = None  # carry: the tokens of the previous chunk that did not fill a step
        while True:
            data = self._chunk(chunk, stream)
            if data is None:  # the text ended; the trainer reports it if steps are still due
                return
            if skip:  # resuming inside this chunk: drop the tokens of the steps already done
                data = {layer: (x[skip:], y[skip:]) for layer, (x, y) in data.items()}
                skip = 0
            if carry is not None and next(iter(carry.values()))[0].shape[0]:  # a step spans two chunks
                data = {layer: (torch.cat([carry[layer][0], x]), torch.cat([carry[layer][1], y]))
                        for layer, (x, y) in data.items()}
            n_tokens = next(iter(data.values()))[0].shape[0]
            steps = n_tokens // self.local_tokens
            for i in range(steps):
                window = slice(i * self.local_tokens, (i + 1) * self.local_tokens)
                yield {layer: (x[window], y[window]) for layer, (x, y) in data.items()}
            cut = steps * self.local_tokens
            carry = {layer: (x[cut:], y[cut:]) for layer, (x, y) in data.items()}
            chunk += 1
