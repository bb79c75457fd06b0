"""Activation batches for distillation: captured (MLP input, MLP output) pairs, shuffled across sequences.

The shuffle buffer works in chunks: chunk c is the next `chunk_sequences` packed sequences; their tokens are
captured in one go, permuted with a generator seeded by (seed, c), and served as `steps_per_chunk` batches. Because
the position in the stream is a pure function of the step, a resumed run recomputes only the current chunk and
continues with exactly the batches an uninterrupted run would have seen.

Under data parallelism every rank walks the same chunks and keeps the sequences i ≡ rank (mod world size), so a
global step always covers `tokens_per_step` distinct tokens.
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
        self.capture, self.sequences_from = capture, sequences_from
        self.local_tokens = tokens_per_step // world_size
        # A chunk holds at least one step and at least the shuffle buffer, in whole sequences per rank.
        per_rank = math.ceil(max(shuffle_buffer_tokens, tokens_per_step) / (context_length * world_size))
        self.chunk_sequences = per_rank * world_size
        self.steps_per_chunk = per_rank * context_length // self.local_tokens
        self.capture_batch_sequences, self.seed, self.device = capture_batch_sequences, seed, device
        self.rank, self.world_size = rank, world_size

    def _chunk(self, index: int, stream: Iterator[torch.Tensor]) -> Batch:
        sequences = list(itertools.islice(stream, self.chunk_sequences))
        # The last chunk may be short (the token budget ends inside it); it must still fill one step on every rank.
        usable = len(sequences) // self.world_size * self.world_size
        mine = sequences[self.rank : usable : self.world_size]
        if not mine or len(mine) * sequences[0].numel() < self.local_tokens:
            raise ValueError(
                f"the training text ran out after {index} chunks of {self.chunk_sequences} sequences; "
                "lower data.train_tokens or add text"
            )
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
        """Per-step batches from `start_step` on, forever (the trainer decides when to stop)."""
        chunk, offset = divmod(start_step, self.steps_per_chunk)
        stream = self.sequences_from(chunk * self.chunk_sequences)
        while True:
            data = self._chunk(chunk, stream)
            n_tokens = next(iter(data.values()))[0].shape[0]
            for step in range(offset, min(self.steps_per_chunk, n_tokens // self.local_tokens)):
                window = slice(step * self.local_tokens, (step + 1) * self.local_tokens)
                yield {layer: (x[window], y[window]) for layer, (x, y) in data.items()}
            chunk, offset = chunk + 1, 0
