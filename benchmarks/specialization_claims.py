"""Each seed paper's specialization claim, read out of benchmarks/specialization.py's rows (RUNS/rows.json).

    python benchmarks/specialization_claims.py RUNS/rows.json        # or: specialization.py --from-rows RUNS/rows.json

The benchmark measures; this module states, per claim, the figure the claim is about, its spread over the seeds,
the goal the issue set for it, and one of three verdicts: "met", "not met" or "cannot tell" (the seeds' interval
straddles the goal). A verdict never rests on one seed's number alone:

- Across seeds, a figure's interval is the 95 % Student-t interval of its mean over the n seeds (n − 1 degrees of
  freedom; with 3 seeds the half-width is 2.48 standard deviations). A difference between two kinds, or between a
  kind and the dense neurons, is paired by seed (the same split, documents and bootstrap draws), then the same
  interval.
- Within a seed: in how many seeds the bootstrap interval over eval documents (conversion/specialization/bootstrap.py)
  lies wholly above the random control's value (directional: below the control counts against the claim).

Claims (issue 22):
1. Monet — ablating a domain's units raises that domain's CE far more than the others' (specificity = mean ΔCE(domain)
   / mean ΔCE(others)), while as many random live units do not. Goal for the best kind: specificity ≥ 10, its random
   control ≈ 1 (here: the control's median over seeds within [0.5, 2]), at spliced ΔCE ≤ 0.01 nats. The ratio is ±inf
   in a seed whenever ΔCE(others) is noise at or below 0, so its verdict reads each seed's bootstrap interval (met
   when every seed's lower bound is ≥ 10), and beside it stands a figure that cannot explode: the selectivity
   ΔCE(domain) − ΔCE(others) in nats, minus the random units' (paired by seed, t-interval).
2. MxD paper — the MxD code's sparse-probe F1 at k = 1 within 0.02 of the transcoder's, and above the dense MLP
   neurons'.
3. Steering — adding a domain unit lowers CE on its domain more than on the others (effect, nats), more than a random
   live unit does, at a stated fluency cost (the CE rise on the other domains).
4. Which kind specializes most: the kinds ranked by masking selectivity over random units, ΔCE beside, the top two
   compared paired by seed.

Dead % and ΔCE are printed beside every kind: a collapsed code cannot specialize, and a specific but unfaithful layer
is not the claim.
"""

import json
import math
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["beyond_control", "claims", "format_value", "seed_interval", "t975", "verdict_above", "verdict_within"]

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
"""Two-sided 95 % Student-t quantiles by degrees of freedom, to 10 (kept here so the benchmarks need no scipy)."""


def t975(df: int) -> float:
    """The two-sided 95 % Student-t quantile for `df` >= 1 degrees of freedom: the table to 10, beyond it the
    Cornish-Fisher expansion about the normal's 1.96 (within 0.001 of the exact quantile from 11 on; the normal's
    1.96 alone would be 5 % narrow at 23, the degrees of freedom of 24 prompts)."""
    if df in T_975:
        return T_975[df]
    z = 1.959964
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))

SPECIFICITY_GOAL, CONTROL_BAND, FAITHFUL_DCE = 10.0, (0.5, 2.0), 0.01
PROBE_TOLERANCE = 0.02


def seed_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % t-interval of the mean over seeds; (nan, nan, nan) without a finite value and
    (mean, -inf, inf) from a single seed (one seed gives no spread)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(finite)
    if len(finite) < 2:
        return mean, -math.inf, math.inf
    half = t975(len(finite) - 1) * statistics.stdev(finite) / math.sqrt(len(finite))
    return mean, mean - half, mean + half


def verdict_above(low: float, high: float, goal: float) -> str:
    """Whether an interval lies above `goal` (met), at or below it (not met), or straddles it (cannot tell)."""
    if math.isnan(low):
        return "cannot tell (no finite value)"
    return "met" if low > goal else "not met" if high <= goal else "cannot tell"


def verdict_within(low: float, high: float, tolerance: float) -> str:
    """Whether a difference's interval lies inside ±tolerance (met), wholly outside it (not met), or neither."""
    if math.isnan(low):
        return "cannot tell (no finite value)"
    if -tolerance <= low and high <= tolerance:
        return "met"
    return "not met" if low > tolerance or high < -tolerance else "cannot tell"


def format_value(value: float | None, fmt: str) -> str:
    """`value` in `fmt`; "n/a" for None or NaN, "inf" / "-inf" whatever `fmt` asks (no "+inf")."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return ("inf" if value > 0 else "-inf") if math.isinf(value) else format(value, fmt)


def _interval_text(values: list[float], fmt: str) -> str:
    mean, low, high = seed_interval(values)
    seeds = ", ".join(format_value(v, fmt) for v in values)
    return f"{format_value(mean, fmt)} [{format_value(low, fmt)}, {format_value(high, fmt)}] (seeds: {seeds})"


def _by_kind(results: list[dict]) -> dict[str, dict[int, dict]]:
    """{kind: {seed: row}} over the seeds that produced the kind's row."""
    out: dict[str, dict[int, dict]] = {}
    for res in results:
        for row in res["rows"]:
            out.setdefault(row["kind"], {})[res["seed"]] = row
    return out


def _paired(a: dict[int, dict], b: dict[int, float], key: str) -> list[float]:
    """Per seed present in both: a[seed][key] - b[seed]."""
    return [a[s][key] - b[s] for s in sorted(a) if s in b and a[s][key] is not None and b[s] is not None]


def beyond_control(rows: Iterable[dict], key: str, control: str) -> tuple[int, int]:
    """In how many rows (seeds) the bootstrap interval of `key` lies wholly above / wholly below its random
    control's value (directional: below the control is significant the other way and does not count for a claim)."""
    above = below = 0
    for r in rows:
        low, high = r.get(f"{key}_ci") or (None, None)
        if r[control] is None or low is None or high is None:
            continue
        above += low > r[control]
        below += high < r[control]
    return above, below


def _ratio_verdict(lows: list, highs: list, goal: float) -> str:
    """Specificity is a ratio that can be ±inf in a seed, so its verdict reads each seed's bootstrap interval over
    documents instead of a t-interval: met when every seed's lower bound clears `goal`, not met when every seed's
    upper bound is below it, cannot tell otherwise."""
    if any(v is None or (isinstance(v, float) and math.isnan(v)) for v in lows) or not lows:
        return "cannot tell (an undefined interval)"
    if all(low >= goal for low in lows):
        return "met"
    if all(high is not None and not math.isnan(high) and high < goal for high in highs):
        return "not met"
    return "cannot tell"


def claims(results: list[dict]) -> list[str]:
    """Markdown lines: the four claims' readings (see the module docstring) from the benchmark's per-seed results."""
    kinds = _by_kind(results)
    n = len(results)
    lines = [f"### Each claim, read out ({n} seeds; intervals: 95 % t over seeds, paired by seed for differences)", ""]
    lines += ["Beside every kind: ΔCE (nats) and dead % (mean over seeds).", ""]
    mean = {kind: {key: seed_interval([r[key] for r in rows.values()])[0] for key in ("delta_ce", "dead_pct", "fvu")}
            for kind, rows in kinds.items()}
    for kind, m in mean.items():
        lines.append(f"- {kind}: ΔCE {format_value(m['delta_ce'], '+.4f')}, dead {format_value(m['dead_pct'], '.1f')}"
                     f" %, FVU {format_value(m['fvu'], '.3f')}")
    lines += ["", f"**1. Masking specificity (Monet)** — goal for the best kind: ≥ {SPECIFICITY_GOAL:g} with its "
              "random "
              f"control in [{CONTROL_BAND[0]:g}, {CONTROL_BAND[1]:g}], at ΔCE ≤ {FAITHFUL_DCE:g}:", ""]
    ranking = []
    for kind, rows in kinds.items():
        seeds = sorted(rows)
        spec = [rows[s]["specificity"] for s in seeds]
        control = [rows[s]["random_specificity"] for s in seeds]
        sig = beyond_control(rows.values(), "specificity", "random_specificity")[0]
        lows = [(rows[s].get("specificity_ci") or [None, None])[0] for s in seeds]
        highs = [(rows[s].get("specificity_ci") or [None, None])[1] for s in seeds]
        finite_control = [c for c in control if c is not None and not math.isnan(c)]
        control_median = statistics.median(finite_control) if finite_control else math.nan
        parts = {"specificity ≥ 10": _ratio_verdict(lows, highs, SPECIFICITY_GOAL),
                 "control ≈ 1": ("cannot tell (no finite value)" if math.isnan(control_median) else
                                 "met" if CONTROL_BAND[0] <= control_median <= CONTROL_BAND[1] else "not met"),
                 "ΔCE ≤ 0.01": "met" if mean[kind]["delta_ce"] <= FAITHFUL_DCE else "not met"}
        overall = ("met" if all(v == "met" for v in parts.values()) else
                   "not met" if any(v == "not met" for v in parts.values()) else "cannot tell")
        # The ratio explodes (to ±inf) when ΔCE(others) is noise around 0; the difference in nats does not.
        selectivity = [rows[s]["mask_delta_target"] - rows[s]["mask_delta_others"] for s in seeds]
        random_sel = {s: rows[s]["random_mask_delta_target"] - rows[s]["random_mask_delta_others"] for s in seeds}
        over_random = [sel - random_sel[s] for sel, s in zip(selectivity, seeds)]
        excess, low, high = seed_interval(over_random)
        lines.append(
            f"- {kind}: specificity (seeds) {', '.join(format_value(v, '.2f') for v in spec)}, document-interval lows "
            f"{', '.join(format_value(v, '.2f') for v in lows)}; random control {', '.join(format_value(v, '.2f') for v in control)}"
            f" (median {format_value(control_median, '.2f')}); seeds whose document interval lies above the control: "
            f"{sig}/{len(rows)} → **{overall}** (" + "; ".join(f"{k}: {v}" for k, v in parts.items()) + "). "
            f"Selectivity ΔCE(domain) − ΔCE(others): {_interval_text(selectivity, '+.4f')} nats; its excess over "
            f"the random units' selectivity (paired by seed) {_interval_text(over_random, '+.4f')} → masking hits "
            f"its domain more than random units: "
            f"**{verdict_above(low, high, 0.0)}**")
        ranking.append((excess, kind, over_random))
    lines += ["", f"**2. Sparse probing (MxD paper)** — MxD's F1 at k = 1 within {PROBE_TOLERANCE:g} of the "
              "transcoder's and above the dense neurons':", ""]
    dense = {res["seed"]: res["dense"]["probe_f1_k1"]["value"] for res in results if res.get("dense")}
    for kind, rows in kinds.items():
        f1 = [rows[s]["probe_f1_k1"] for s in sorted(rows)]
        random_f1 = [rows[s]["random_probe_f1_k1"] for s in sorted(rows)]
        minus_dense = _paired(rows, dense, "probe_f1_k1")
        _, low, high = seed_interval(minus_dense)
        lines.append(f"- {kind}: F1 k=1 {_interval_text(f1, '.3f')} (random units {_interval_text(random_f1, '.3f')});"
                     f" minus dense {_interval_text(minus_dense, '+.3f')} → above dense: "
                     f"**{verdict_above(low, high, 0.0)}**")
    lines.append(f"- dense MLP neurons: F1 k=1 {_interval_text([dense[s] for s in sorted(dense)], '.3f')}")
    if "mxd" in kinds and "transcoder" in kinds:
        transcoder = {s: r["probe_f1_k1"] for s, r in kinds["transcoder"].items()}
        diff = _paired(kinds["mxd"], transcoder, "probe_f1_k1")
        _, low, high = seed_interval(diff)
        lines.append(f"- MxD − transcoder: {_interval_text(diff, '+.3f')} → within ±{PROBE_TOLERANCE:g}: "
                     f"**{verdict_within(low, high, PROBE_TOLERANCE)}**")
    lines += ["", "**3. Steering** — the domain unit's effect (CE drop on its domain minus the mean drop on the "
              "others) "
              "against a random live unit's, and its fluency cost (CE rise on the other domains, nats):", ""]
    for kind, rows in kinds.items():
        effect = [rows[s]["steering_effect"] for s in sorted(rows)]
        random_effect = {s: rows[s]["random_steering_effect"] for s in rows}
        over_random = _paired(rows, random_effect, "steering_effect")
        cost = [-rows[s]["steering_drop_others"] for s in sorted(rows)]
        random_cost = [-rows[s]["random_steering_drop_others"] for s in sorted(rows)]
        sig = beyond_control(rows.values(), "steering_effect", "random_steering_effect")[0]
        _, low, high = seed_interval(over_random)
        lines.append(f"- {kind}: effect {_interval_text(effect, '+.4f')}, minus random "
                     f"{_interval_text(over_random, '+.4f')} (seeds whose document interval lies above the random "
                     f"unit's: {sig}/{len(rows)})"
                     f" → beats random: **{verdict_above(low, high, 0.0)}**; "
                     f"fluency cost {_interval_text(cost, '+.4f')} (random unit "
                     f"{_interval_text(random_cost, '+.4f')})")
    lines += ["", "**4. Which kind specializes most at equal faithfulness:**", ""]
    ranking = sorted((r for r in ranking if not math.isnan(r[0])), key=lambda r: r[0], reverse=True)
    if len(ranking) < 2:
        lines.append("- fewer than two kinds with a finite selectivity: the data cannot rank them")
    else:
        lines.append("- ranked by masking selectivity over random units (nats, mean over seeds): " + ", ".join(
            f"{kind} {format_value(excess, '+.4f')} (ΔCE {format_value(mean[kind]['delta_ce'], '+.4f')})"
            for excess, kind, _ in ranking))
        (_, best, best_values), (_, second, second_values) = ranking[0], ranking[1]
        diff = [a - b for a, b in zip(best_values, second_values)]
        _, low, high = seed_interval(diff)
        tell = (f"{best} is the more domain-specific (the seeds' paired interval excludes 0)" if low > 0 else
                "the data cannot tell them apart (the seeds' paired interval holds 0)")
        lines.append(f"- {best} − {second}: {_interval_text(diff, '+.4f')}: {tell}")
    lines.append("- at equal faithfulness: compare within a ΔCE band; a kind that is more specific but less faithful "
                 "does not settle the claim")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("usage: python benchmarks/specialization_claims.py RUNS/rows.json (written by "
              "benchmarks/specialization.py --runs-dir RUNS)", file=sys.stderr)
        return 2
    results = json.loads(Path(argv[0]).read_text(encoding="utf-8"))["seeds"]
    print("\n".join(claims(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
