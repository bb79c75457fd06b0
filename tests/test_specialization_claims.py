"""benchmarks/specialization_claims.py: the seeds' claims read out of the benchmark's rows, with verdicts that follow
the seeds' interval (met / not met / cannot tell), checked on rows built so the answer is known."""

import importlib.util
import math
import statistics
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "specialization_claims.py"
_SPEC = importlib.util.spec_from_file_location("specialization_claims", _PATH)
_claims = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_claims)
claims, seed_interval, verdict_above, verdict_within = (_claims.claims, _claims.seed_interval, _claims.verdict_above,
                                                        _claims.verdict_within)


def test_seed_interval_is_students_t_over_the_seeds():
    mean, low, high = seed_interval([1.0, 2.0, 3.0])
    # mean 2, sd 1, n 3: half-width t(0.975, 2) · 1 / sqrt(3) = 4.303 / 1.732
    assert mean == 2.0 and high - mean == pytest.approx(4.303 / math.sqrt(3), rel=1e-6) and low == 4.0 - high
    assert seed_interval([5.0])[1:] == (-math.inf, math.inf)  # one seed has no spread: nothing can be "met"
    assert all(math.isnan(v) for v in seed_interval([math.nan, math.inf]))  # no finite value


@pytest.mark.parametrize("df, exact", [(11, 2.201), (23, 2.069), (47, 2.012), (200, 1.972)])
def test_t_quantile_beyond_the_table(df, exact):
    """Past the table's 10 degrees of freedom (24 held-out prompts have 23), Student's t, not the normal's 1.96."""
    assert _claims.t975(df) == pytest.approx(exact, abs=0.001)
    values = [float(i % 5) for i in range(df + 1)]
    mean, low, high = seed_interval(values)
    assert high - mean == pytest.approx(_claims.t975(df) * statistics.stdev(values) / math.sqrt(df + 1), rel=1e-9)


@pytest.mark.parametrize("low, high, expected", [(0.1, 0.3, "met"), (-0.2, -0.1, "not met"),
                                                 (-0.1, 0.1, "cannot tell"), (-0.1, 0.0, "not met")])
def test_verdict_above(low, high, expected):
    assert verdict_above(low, high, 0.0) == expected


@pytest.mark.parametrize("low, high, expected", [(-0.01, 0.015, "met"), (0.03, 0.05, "not met"),
                                                 (-0.06, -0.03, "not met"), (-0.01, 0.04, "cannot tell")])
def test_verdict_within(low, high, expected):
    assert verdict_within(low, high, 0.02) == expected


def _row(kind, seed, *, spec, control, f1, effect, random_effect, target=0.02, dce=0.005, dead=2.0):
    jitter = 0.001 * seed
    return {
        "kind": kind, "layer": 1, "delta_ce": dce + jitter / 10, "fvu": 0.3, "dead_pct": dead,
        "specificity": spec + seed, "specificity_ci": [spec + seed - 2, spec + seed + 2],
        "random_specificity": control, "random_specificity_ci": [control - 0.3, control + 0.3],
        "mask_delta_target": target + jitter / 10, "mask_delta_others": 0.001,
        "random_mask_delta_target": 0.002, "random_mask_delta_others": 0.002,
        "probe_f1_k1": f1 + jitter, "random_probe_f1_k1": 0.5,
        "steering_effect": effect + jitter, "steering_effect_ci": [effect + jitter - 0.001, effect + jitter + 0.001],
        "random_steering_effect": random_effect, "steering_drop_others": -0.002, "random_steering_drop_others": -0.001,
    }


def test_claims_give_the_verdict_the_rows_imply():
    results = [{"seed": s, "rows": [
        _row("monetish", s, spec=20.0, control=1.0, f1=0.80, effect=0.03, random_effect=0.0),
        _row("mxd", s, spec=4.0, control=1.1, f1=0.90, effect=-0.01, random_effect=0.0, target=0.005, dce=0.02),
        _row("transcoder", s, spec=3.0, control=5.0, f1=0.895, effect=0.0, random_effect=0.0, target=0.003),
    ], "dense": {"probe_f1_k1": {"value": 0.85 - 0.01 * s, "ci": [0.8, 0.9]}}} for s in (0, 1, 2)]
    text = "\n".join(claims(results))
    masking = {line.split(":")[0]: line for line in text.splitlines() if "specificity (seeds)" in line}
    # 1. specificity 20-22 (every seed's document interval above 10) with control 1 at ΔCE 0.005: met; MxD's 4-6 is
    # below 10 in every seed and its ΔCE 0.02 > 0.01; the transcoder's control (5) is not ≈ 1.
    assert "→ **met** (specificity ≥ 10: met; control ≈ 1: met; ΔCE ≤ 0.01: met)" in masking["- monetish"]
    assert "seeds whose document interval lies above the control: 3/3" in masking["- monetish"]
    assert "→ **not met** (specificity ≥ 10: not met; control ≈ 1: met; ΔCE ≤ 0.01: not met)" in masking["- mxd"]
    assert "control ≈ 1: not met" in masking["- transcoder"]
    assert masking["- monetish"].endswith("more than random units: **met**")
    # 2. MxD − transcoder = +0.005 in every seed: within ±0.02; MxD above the dense neurons in every seed.
    assert "MxD − transcoder: +0.005" in text and "within ±0.02: **met**" in text
    mxd_probe = next(line for line in text.splitlines() if line.startswith("- mxd: F1 k=1"))
    assert mxd_probe.endswith("above dense: **met**")
    # 3. steering: monetish beats its random unit in 3/3 seeds; mxd's effect lies below its random unit's.
    steer = {line.split(":")[0]: line for line in text.splitlines() if "fluency cost" in line}
    assert "lies above the random unit's: 3/3) → beats random: **met**" in steer["- monetish"]
    assert "lies above the random unit's: 0/3) → beats random: **not met**" in steer["- mxd"]
    assert "fluency cost +0.0020" in steer["- mxd"]  # the CE rise on the other domains, sign turned
    # 4. ranking by selectivity over random units: monetish (+0.019) clearly above mxd (+0.004) in every seed.
    assert "ranked by masking selectivity over random units (nats, mean over seeds): monetish +0.0191" in text
    assert "- monetish − mxd: +0.0150" in text and "monetish is the more domain-specific" in text


def test_claims_say_the_data_cannot_tell_when_the_seeds_disagree():
    results = [{"seed": s, "rows": [
        _row("a", s, spec=[12.0, 2.0, 25.0][s], control=1.0, f1=[0.9, 0.7, 0.95][s], effect=0.0, random_effect=0.0,
             target=[0.02, 0.0, 0.03][s]),
        _row("b", s, spec=[10.0, 9.0, 6.0][s], control=1.0, f1=0.85, effect=0.0, random_effect=0.0,
             target=[0.01, 0.012, 0.008][s]),
    ], "dense": {"probe_f1_k1": {"value": 0.85, "ci": [0.8, 0.9]}}} for s in (0, 1, 2)]
    text = "\n".join(claims(results))
    assert "specificity ≥ 10: cannot tell" in text
    assert "the data cannot tell them apart" in text
