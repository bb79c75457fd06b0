"""What `expertize upcycle` prints around a run, as a user reads it: expertize's own warnings as one
`expertize: warning: ...` line (never Python's `path:line: UserWarning` and source line), and a headline that
gives no ratio over a near-zero denominator without its caveat (evaluation/headline.py)."""

import json

import yaml

from expertize.conversion.cli import main as cli_main
from expertize.conversion.evaluation.headline import VARIANCE_FLOOR
from expertize.conversion.upcycle import upcycle_summary


def test_a_short_eval_split_warns_in_one_line_and_an_unjudgeable_ce_recovered_is_not_a_percentage(tiny_run, capsys):
    tmp_path, tree = tiny_run
    # A tiny random model on more eval text than its held-out split holds: the split runs short (a warning), and
    # removing its MLPs barely moves the CE (their outputs are ~1e-3), so CE recovered divides by almost nothing.
    tree["layers"] = [0]
    tree["data"].update(train_tokens=2048, eval_tokens=1_000_000)
    tree["eval"].update(generation_prompts=1, continuation_tokens=2)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tree), encoding="utf-8")
    assert cli_main(["upcycle", str(recipe), "--no-progress"]) == 0
    said = capsys.readouterr()

    # Before: "/.../conversion/upcycle.py:324: UserWarning: the eval documents give only ..." and the source line.
    short = [line for line in said.err.splitlines() if "eval documents give only" in line]
    assert len(short) == 1, said.err
    assert short[0].startswith("expertize: warning: the eval documents give only ")
    assert short[0].endswith("add text, lower data.eval_tokens, or change data.eval_fraction")
    assert "UserWarning" not in said.err and "load_eval_sequences(" not in said.err

    # Before: "CE recovered vs mean ablation 438.98%" on the summary's first line; only the verdict said "cannot
    # judge".
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text(encoding="utf-8"))["ce"]
    assert abs(metrics["mean_ablation"] - metrics["base"]) < 0.05
    first = said.out.splitlines()[0]
    assert first.startswith("expertize: CE ") and "%" not in first, first
    assert first.endswith(
        f"CE recovered vs mean ablation n/a (cannot judge: removing the MLP barely changes the CE on this text, mean "
        f"ablation {metrics['mean_ablation'] - metrics['base']:+.2g} nats, under 0.05)"
    )
    assert "verdict: cannot judge" in said.out or "verdict: poor" in said.out


def _folder(tmp_path, ce: dict, layers: dict):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "metrics.json").write_text(json.dumps({"ce": ce, "layers": layers}), encoding="utf-8")
    return tmp_path


def test_fvu_over_a_near_zero_output_variance_names_the_variance(tmp_path):
    # The tiny random OLMo-2: the MLP's output varies by ~1e-11 per element, FVU 33279.551.
    tiny = {"fvu": 33279.551, "mse": 33279.551 * 1.2e-11, "nmse_paper": 2e-4, "l0": 8.0, "dead_fraction": 0.0}
    real = {"fvu": 0.22, "mse": 0.22 * 3e-3, "nmse_paper": 0.05, "l0": 16.0, "dead_fraction": 0.19}
    ce = {"base": 3.0, "spliced": 3.1, "delta": 0.1, "zero_ablation": 5.0, "mean_ablation": 4.0,
          "ce_recovered_zero": 0.95, "ce_recovered_mean": 0.9}
    lines = upcycle_summary(_folder(tmp_path / "a", ce, {"0": tiny, "1": real})).splitlines()
    assert lines[1] == (
        "expertize: layer 0: FVU 33279.5510 (not a grade: the MLP's output barely varies on this text, variance "
        f"1.2e-11 per element, under {VARIANCE_FLOOR:g}), NMSE 2.000e-04, L0 8.00, dead 0.00%"
    )
    assert lines[2] == "expertize: layer 1: FVU 0.2200, NMSE 0.0500, L0 16.00, dead 19.00%"  # as it was
    # Ablations that raise the CE by ≥ 0.05 nats: CE recovered is a percentage, as before.
    assert lines[0].endswith("CE recovered vs mean ablation 90.00%")
    # Mean ablation lowers the CE (the case): no percentage, whatever the ratio came to.
    lowered = dict(ce, mean_ablation=2.9995, zero_ablation=3.01, ce_recovered_mean=13.9668)
    first = upcycle_summary(_folder(tmp_path / "b", lowered, {"0": real})).splitlines()[0]
    assert "1396.68%" not in first and "CE recovered vs mean ablation n/a (cannot judge: " in first
    assert "mean ablation -0.0005 nats, under 0.05)" in first
