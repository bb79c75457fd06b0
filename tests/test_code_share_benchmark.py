"""benchmarks/code_share.py's choice of the default MxD from its rows: the lowest KL / transcoder among variants whose
code carries the layer in every cell measured (issue 35's rule), on hand-made rows whose answer is known."""

import math
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _row(model, budget, variant, seed, share, kl, k=32):
    return {"model": model, "budget": budget, "k": k, "variant": variant, "seed": seed, "share": share, "kl": kl}


@pytest.fixture
def code_share(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import code_share

    return code_share


def test_the_default_is_the_lowest_kl_whose_code_carries_the_layer_everywhere(code_share):
    rows = []
    for model, budget in (("tiny-gpt2-shakespeare", 20_480), ("stories260k", 20_480)):
        for seed in (0, 1):
            rows += [_row(model, budget, "transcoder", seed, 1.0, 0.10),
                     # the most faithful, but its code carries 40 % on stories260k: not eligible
                     _row(model, budget, "mxd", seed, 0.9 if model.startswith("tiny") else 0.4, 0.09),
                     _row(model, budget, "mxd-h2", seed, 0.6, 0.12),
                     _row(model, budget, "mxd-h4", seed, 0.9, 0.13)]
    # measured on one model only: never a candidate, however good
    rows += [_row("tiny-gpt2-shakespeare", 20_480, "mxd-h16", seed, 1.0, 0.05) for seed in (0, 1)]
    text, chosen = code_share.default_choice(rows)
    assert chosen == {32: "mxd-h2"}
    assert "| 32 | mxd | 2 | 0.40 | 0.90 [0.90, 0.90] | no |" in text
    assert "| 32 | mxd-h2 | 2 | 0.60 | 1.20 [1.20, 1.20] | **chosen** |" in text
    assert "| 32 | mxd-h4 | 2 | 0.90 | 1.30 [1.30, 1.30] | yes |" in text
    assert "| 32 | mxd-h16 | 1 of 2 | – | – | not a candidate: no reading in 1 cell(s) |" in text


def test_no_variant_reaches_the_share(code_share):
    rows = [_row("stories260k", 20_480, "transcoder", 0, 1.0, 0.1), _row("stories260k", 20_480, "mxd", 0, 0.2, 0.05)]
    text, chosen = code_share.default_choice(rows)
    assert chosen == {32: None} and "| 32 | mxd | 1 | 0.20 | 0.50 [0.50, 0.50] | no |" in text
    assert math.isclose(code_share.SHARE_TARGET, 0.5)


def test_the_benchmarks_default_variant_is_what_a_recipe_gets(code_share):
    from expertize.modeling import MlpShape, MxdSpec

    kind, _, divisor, train = code_share.VARIANTS[code_share.DEFAULT_MXD]
    for model, width in code_share.MLP_WIDTH.items():
        shape = MlpShape(d_model=64, d_hidden=width, activation="gelu", glu=False)
        assert MxdSpec.mlp_defaults(shape)["d_hidden"] == width // divisor, model
    assert (kind, train) == ("mxd", {})


def test_the_comparison_pairs_each_variant_with_the_transcoder_of_its_seed(code_share):
    rows = [_row("stories260k", 20_480, "transcoder", s, 1.0, kl) for s, kl in ((0, 0.10), (1, 0.20))]
    rows += [_row("stories260k", 20_480, "mxd-h2", s, share, kl) for s, share, kl in ((0, 0.6, 0.12), (1, 0.8, 0.24))]
    line = code_share.comparison(rows).splitlines()[2]
    # the default's KL is 1.2x its own seed's transcoder in both seeds; the paper's MxD and the skip transcoder: not run
    assert line.startswith("| stories260k | 32 | 20,480 | 2 | 0.70 ± ") and "| 1.20 [1.20, 1.20] | – | – | – | – |" in line
