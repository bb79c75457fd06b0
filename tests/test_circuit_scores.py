"""Graph scores (issue 48): the export's attribute.py refuses a prompts file it could not score before loading anything,
and benchmarks/circuit_scores.py pairs the CLT with the JumpReLU set prompt by prompt with Student-t intervals
(benchmarks/specialization_claims.py's, whose quantile tests/test_specialization_claims.py checks).
circuit-tracer's own compute_graph_scores is checked against attribute.py's --scores in tests/test_circuit_tracer_e2e.py
(its venv)."""

import math
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "PROMPTS", "--out", "o"], "give --scores SCORES.json"),
    (["--prompts", "EMPTY", "--scores", "s.json", "--out", "o"], "no prompt in it"),
    (["--prompt", "x", "--prompts", "PROMPTS", "--out", "o"], "not allowed with argument"),
])
def test_attribute_refuses_a_prompts_file_it_cannot_score_before_any_work(argv, message, tmp_path, capsys,
                                                                          monkeypatch):
    (tmp_path / "PROMPTS").write_text("Once upon a time\n")
    (tmp_path / "EMPTY").write_text("\n  \n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["attribute.py", *argv])
    from expertize import circuit_tracer_attribute

    with pytest.raises(SystemExit) as exit_:
        circuit_tracer_attribute.main()
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "s.json").exists()  # nothing half-written


def _circuit_scores(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import circuit_scores

    return circuit_scores


def _row(kind: str, seed: int, replacement: list[float]) -> dict:
    return {"model": "m", "seed": seed, "kind": kind, "max_feature_nodes": 8192,
            "prompts": [{"prompt": f"p{i}", "tokens": 9, "replacement": r, "completeness": r + 0.1,
                         "active_features": 100, "selected_features": 100, "seconds": 1.0}
                        for i, r in enumerate(replacement)]}


def test_scores_table_pairs_the_clt_with_the_set_prompt_by_prompt(monkeypatch):
    scores = _circuit_scores(monkeypatch)
    clt, jump = [0.70, 0.74, 0.71], [0.69, 0.70, 0.71]
    rows = [_row("jumprelu_transcoder", 0, jump), _row("clt", 0, clt), _row("jumprelu_transcoder", 1, jump),
            _row("clt", 1, jump)]
    text = scores.scores_table(rows)
    diffs = [c - j for c, j in zip(clt, jump)]
    half = 4.303 * statistics.stdev(diffs) / math.sqrt(3)  # two degrees of freedom: the table's 4.303
    mean = statistics.fmean(diffs)
    clt_line = next(line for line in text.splitlines() if "| 0 | clt |" in line)
    assert f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]" in clt_line
    assert clt_line.count("[") == 4  # replacement, completeness, and both paired differences
    set_line = next(line for line in text.splitlines() if "| 0 | jumprelu_transcoder |" in line)
    assert set_line.rstrip().endswith("|  |  |")  # the set is the reference: no difference of its own
    pooled = next(line for line in text.splitlines() if "| all | clt |" in line)  # both seeds' prompts pooled
    assert "| 6 |" in pooled and f"{statistics.fmean(diffs + [0, 0, 0]):+.3f} [" in pooled
    assert "| all |" not in scores.scores_table(rows[:2])  # one seed: nothing to pool
