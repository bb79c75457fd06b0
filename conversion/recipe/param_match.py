"""Choose the number of MxD experts N so that an MxD layer has a transcoder's parameter count (MxD paper §3, Table 2).

Two conventions:

- ``"exact"`` (default): the largest N whose `MxdSpec.num_parameters()` does not exceed
  `TranscoderSpec.num_parameters()`, counting every parameter of both layers as this library builds them.
- ``"paper"``: reproduces the paper's Table 2 (N = 21,490 GPT-2; 28,658 Pythia-410m; 57,330 Pythia-1.4b; 86,015
  Llama-3.2-3B). The reference code uses two different formulas: for GELU-MLP encoders it leaves the encoder biases
  out on both sides and rounds, ``N = round((H_TC - H)(I + O) / (I + O + 1))``; for the GLU encoder it counts every
  bias and floors, which coincides with ``"exact"``.
"""

import dataclasses
import math
from typing import Literal

from expertize.modeling.mxd import MxdSpec
from expertize.modeling.transcoder import TranscoderSpec

Convention = Literal["exact", "paper"]


def mxd_experts_for_transcoder(
    d_in: int,
    d_out: int,
    d_hidden: int,
    expansion_factor: float,
    *,
    encoder: Literal["mlp", "glu"] = "mlp",
    encoder_bias: bool = True,
    convention: Convention = "exact",
) -> int:
    """N such that MxD(d_in, d_out, H=d_hidden, N) matches a transcoder with `expansion_factor * d_in` latents."""
    if encoder not in ("mlp", "glu"):
        raise ValueError(f"encoder must be 'mlp' or 'glu', got {encoder!r}")
    if convention not in ("exact", "paper"):
        raise ValueError(f"convention must be 'exact' or 'paper', got {convention!r}")
    num_latents = int(round(expansion_factor * d_in))
    I, O, H = d_in, d_out, d_hidden
    paper = MxdSpec.matched_size(dict(d_in=I, d_out=O, d_hidden=H, encoder=encoder), num_latents, convention)
    if paper is not None:
        return paper
    transcoder = TranscoderSpec(d_in=I, d_out=O, num_latents=num_latents, k=1).num_parameters()
    without_experts = MxdSpec(
        d_in=I, d_out=O, d_hidden=H, num_experts=1, k=1, encoder=encoder, encoder_bias=encoder_bias
    ).num_parameters() - (I + O + 1)
    n = math.floor((transcoder - without_experts) / (I + O + 1))
    if n < 1:
        raise ValueError(
            f"a {expansion_factor}x transcoder ({transcoder:,} parameters) is smaller than MxD's dense part "
            f"({without_experts:,}); raise the expansion factor"
        )
    return n


def match_parameter_count(spec_cls: type, fields: dict, field: str, target: int, *, limit: int = 1 << 24) -> int:
    """The largest value of `fields[field]` whose spec has at most `target` parameters.

    Any spec kind works as long as its `num_parameters()` grows with `field` (experts, rank, ...). The search reads
    the parameter formula without validation (so it can pass values the spec would reject), then steps down to the
    nearest value the spec accepts (e.g. a perfect square for product-key experts).
    """

    def count(value: int) -> int:
        raw = object.__new__(spec_cls)  # formula only: skips __post_init__ validation on purpose
        for f in dataclasses.fields(spec_cls):
            if f.name in fields:
                setattr(raw, f.name, fields[f.name])
            elif f.default is not dataclasses.MISSING:
                setattr(raw, f.name, f.default)
            elif f.default_factory is not dataclasses.MISSING:
                setattr(raw, f.name, f.default_factory())
        setattr(raw, field, value)
        return raw.num_parameters()

    if count(1) > target:
        raise ValueError(
            f"even {field}=1 gives {count(1):,} parameters, more than the target {target:,}; raise the expansion factor"
        )
    lo, hi = 1, 2
    while hi < limit and count(hi) <= target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: count(lo) <= target < count(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= target else (lo, mid)
    first_error = None
    for value in range(lo, max(0, lo - 4096), -1):
        try:
            spec_cls(**{**fields, field: value})
            return value
        except ValueError as e:
            first_error = first_error or e
    raise ValueError(f"no valid {field} <= {lo} fits {target:,} parameters: {first_error}")
