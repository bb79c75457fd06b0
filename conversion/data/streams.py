"""The training stream of a run: packed train split -> the MLPs' (x, y) captured live -> shuffled step batches.

`activation_batches` configures `ActivationBatches` (activations.py) from a recipe: the capture hooks and their
precision (mlp_pairs.py), the token stream (token_cache.py, text.py), how many sequences one forward captures, the
shuffle buffer and the excluded special positions. Its twin for a run that reads an activation cache is
cache.py's `cached_batches` (same arguments after the cache).
"""

import dataclasses
import math

import torch

from .activations import ActivationBatches
from .mlp_pairs import MlpCapture, capture_batch_size, excluded_token_ids
from .text import stream_train_tokens
from .token_cache import train_sequences

__all__ = ["activation_batches"]


def activation_batches(
    recipe, base, tokenizer, layer_ids: list[int], total_steps: int, device: torch.device,
    *, rank: int = 0, world_size: int = 1,
) -> ActivationBatches:
    """The recipe's training stream: packed train split -> captured (x, y) at `layer_ids` -> shuffled step batches."""
    train, data = recipe.train, recipe.data
    # Several processes read a little more, so every rank fills the last step (text.stream_train_tokens).
    data = dataclasses.replace(data, train_tokens=stream_train_tokens(data, world_size))
    # Never buffer beyond the run's budget (the stream ends there).
    shuffle_buffer_tokens = min(train.shuffle_buffer_tokens, total_steps * train.tokens_per_step)
    return ActivationBatches(
        MlpCapture(base, layer_ids, precision=train.capture_precision),
        train_sequences(data, tokenizer),
        context_length=data.context_length,
        tokens_per_step=train.tokens_per_step,
        shuffle_buffer_tokens=shuffle_buffer_tokens,
        capture_batch_sequences=capture_batch_size(
            train.capture_batch_sequences, base.config, data.context_length, device,
            itemsize=next(base.parameters()).element_size(),
            max_sequences=math.ceil(max(shuffle_buffer_tokens, train.tokens_per_step) / data.context_length),
        ),
        seed=train.seed,
        device=device,
        rank=rank,
        world_size=world_size,
        exclude_token_ids=excluded_token_ids(data, tokenizer),
    )
