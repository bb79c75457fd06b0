"""benchmarks/gpu_check.py runs on the CPU at toy sizes (`--device cpu --smoke`), so the GPU check cannot rot: every
pipeline stage of both settings and every row of the layer table is measured and printed with its target."""

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(monkeypatch, capsys, *argv: str) -> str:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check

    assert gpu_check.main(["--device", "cpu", "--smoke", "--repeats", "1", *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.slow  # 5-25 s (subprocesses or a whole upcycle): in CI's opt-in run, off the fast suite's 8 minutes
def test_the_gpu_check_runs_on_the_cpu_at_toy_sizes(monkeypatch, capsys):
    out = _run(monkeypatch, capsys, "--no-compile", "--kinds", "mxd,transcoder,moe_x,monet_hd")
    assert "targets are for one H100 / H200 and are not judged here" in out
    for setting in ("fp32", "bf16"):
        for stage in ("(t) tokenize + pack", "(t) from token cache", "(c) capture forward", "(b) layer math",
                      "(a) pipeline", "(a) / ((b) + (c))", "(c) at 32 seq/forward"):
            assert f"{setting:<10} {stage}" in out, (setting, stage)
        assert f"layer {setting}" in out
    assert ">= 700,000 tok/s" in out and ">= 350,000 tok/s" in out and "<= 1.1x" in out
    for name in ("dense MLP", "mxd", "transcoder", "moe_x", "monet_hd", "mxd (paper code)"):
        assert f"{name} fwd+bwd, T=256" in out, name
    assert "mxd speed-up over the paper code" in out and ">= 3x" in out
    assert "FAIL" not in out and "PASS" not in out  # not judged off a GPU
    assert "nan ms" not in out


@pytest.mark.slow
def test_the_gpu_checks_compiled_row_and_every_kind(monkeypatch, capsys):
    out = _run(monkeypatch, capsys)
    assert "(b) layer math, train.compile" in out
    for name in ("skip_transcoder", "mumoe_cp", "mumoe_tr", "monet_vd", "routed_neurons"):
        assert f"{name} fwd+bwd" in out, name
