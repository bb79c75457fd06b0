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

Throughput: reading, tokenizing and packing the next chunk's sequences runs in a background thread while the current
chunk trains (`_ChunkPrefetch`; the same sequences in the same order). Nothing here waits for the device: the token
ids and the shuffle order go to it from pinned memory without blocking, and which rows a step keeps is decided on
the host (the excluded positions are known from the token ids), so a step's batch is gathered with host-made indices
instead of a boolean mask (whose result size the host would have to wait for). The batches are the same either way.
"""

import math
import queue
import threading
from collections.abc import Callable, Collection, Iterator

import torch

from .mlp_pairs import MlpCapture, kept_positions

Batch = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (x, y), each (tokens, d_model)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the CPU) on `device`. To a GPU through pinned memory without blocking: a plain copy from pageable
    memory makes the host wait until the GPU has finished all queued work, every time."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class _ChunkPrefetch:
    """The items of `stream` in lists of `size` (the last one shorter), read one list ahead in a background thread:
    the next chunk's sequences are tokenized and packed while the current chunk trains. `next()` returns [] once
    the stream has ended; an error of the stream is raised by the `next()` that reaches it; `close()` stops the
    thread (it checks between items) and waits for it."""

    def __init__(self, stream: Iterator, size: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._size = size
        self._stop = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._fill, args=(stream, size), name="expertize-sequences", daemon=True)
        self._thread.start()

    def _fill(self, stream: Iterator, size: int) -> None:
        try:
            while True:
                part = []
                for item in stream:
                    part.append(item)
                    if self._stop.is_set():
                        return
                    if len(part) == size:
                        break
                if not self._put(part) or len(part) < size:
                    return
        except BaseException as error:  # handed to the consumer, raised there
            self._put(error)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> list:
        if self._ended:
            return []
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        self._ended = len(item) < self._size  # the thread has stopped after a short list
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


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

    prefetch_sequences = True
    """Read the next chunk's sequences in a background thread (off for the activation cache, whose stream is only
    sequence indices)."""

    def _chunk(self, index: int, sequences: list) -> tuple[Batch, torch.Tensor | None] | None:
        """Chunk `index` (its `sequences`, all ranks') captured and permuted: (layer -> (x, y), each
        (tokens, d_model), on the device; keep (tokens,) bool on the host, or None when nothing is excluded); None
        when the text ended."""
        # The last chunk may be short (the token budget ends inside it); every rank keeps the same number.
        usable = len(sequences) // self.world_size * self.world_size
        mine = sequences[self.rank : usable : self.world_size]
        if not mine:
            return None
        data, keep = self._rows(mine)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n_tokens = next(iter(data.values()))[0].shape[0]
        order = torch.randperm(n_tokens, generator=gen)  # (tokens,), on the host
        on_device = to_device(order, self.device)
        data = {layer: (x[on_device], y[on_device]) for layer, (x, y) in data.items()}
        keep = None if keep is None else keep[order]  # (tokens,), permuted like the rows
        return data, keep

    def _rows(self, mine: list) -> tuple[Batch, torch.Tensor | None]:
        """This rank's sequences of a chunk as rows in stream order, before the shuffle: (layer -> (x, y), each
        (tokens, d_model), on the device; keep (tokens,) bool on the host, or None). Captured here; the activation
        cache's reader (`data/cache.py`) overrides it to read the same rows from disk, so both share the shuffle
        above."""
        pieces: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        keeps = []
        for start in range(0, len(mine), self.capture_batch_sequences):
            input_ids = torch.stack(mine[start : start + self.capture_batch_sequences])  # (B, T), on the host
            keeps.append(kept_positions(input_ids, self.exclude_token_ids))  # (B*T,) or None
            for layer, pair in self.capture(to_device(input_ids, self.device)).items():
                pieces.setdefault(layer, []).append(pair)
        data = {layer: (torch.cat([x for x, _ in ps]), torch.cat([y for _, y in ps])) for layer, ps in pieces.items()}
        return data, None if keeps[0] is None else torch.cat(keeps)

    def batches(self, start_step: int = 0) -> Iterator[Batch]:
        """Per-step batches from `start_step` on, until the text ends (the trainer decides when to stop earlier and
        raises RunFailed when the batches end before its last step: a streamed corpus shorter than the budget)."""
        chunk_tokens = self.chunk_sequences // self.world_size * self.context_length  # per rank, full chunks
        chunk, skip = divmod(start_step * self.local_tokens, chunk_tokens)
        stream = self.sequences_from(chunk * self.chunk_sequences)
        prefetch = _ChunkPrefetch(stream, self.chunk_sequences) if self.prefetch_sequences else None
        next_sequences = prefetch.next if prefetch else lambda: _take(stream, self.chunk_sequences)
        try:
            yield from self._steps(chunk, skip, next_sequences)
        finally:
            if prefetch is not None:
                prefetch.close()

    def _steps(self, chunk: int, skip: int, next_sequences: Callable[[], list]) -> Iterator[Batch]:
        """The step batches from token `skip` of chunk `chunk` on; `next_sequences()` gives each chunk's sequences."""
        carry = None  # the tokens of the previous chunk that did not fill a step: (data, keep)
        while True:
            captured = self._chunk(chunk, next_sequences())
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
                else:  # the step's positions minus the excluded ones, as indices made on the host
                    rows = to_device(keep[window].nonzero().squeeze(1), self.device)  # (kept,) int64
                    yield {layer: (x[window].index_select(0, rows), y[window].index_select(0, rows))
                           for layer, (x, y) in data.items()}
            cut = steps * self.local_tokens
            carry = (
                {layer: (x[cut:], y[cut:]) for layer, (x, y) in data.items()},
                None if keep is None else keep[cut:],
            )
            chunk += 1


def _take(stream: Iterator, n: int) -> list:
    """The next `n` items of `stream` (fewer at its end)."""
    out = []
    for item in stream:
        out.append(item)
        if len(out) == n:
            break
    return out
