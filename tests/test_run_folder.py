"""The run folder: checks that write nothing, the claim, --restart, strict JSON, staging + publish (metrics.json last,
relative plot paths), one publishing process; the metrics.json schema; --no-progress for the libraries."""

import json
from pathlib import Path

import pytest

from expertize.conversion.publishing.metrics_schema import Metrics, MetricsError, load_metrics, scalar_metric_paths
from expertize.conversion.publishing.model_folder import write_metrics
from expertize.conversion.publishing.run_folder import (
    METRICS,
    RunFolder,
    RunFolderError,
    RunFolderTaken,
    strict_json,
    write_json,
)
from expertize.conversion.errors import ExpertizeError

RECIPE = {"base_model": "tiny", "layers": [0], "train": {"lr": 1e-3, "seed": 0}, "data": {"paths": ["a.txt"]}}
METRICS_DICT = {
    "layers": {"0": {"nmse_paper": 0.01, "relative_mse": 0.08, "fvu": 0.09, "mse": 0.0004, "l0": 4.0,
                     "dead_units": 3, "dead_fraction": 0.1875, "num_units": 16,
                     "firing_frequency_histogram": "plots/firing_frequency_layer0.png", "usage_entropy": 2.5,
                     "effective_units": 12.2, "fvu_mean_code": 0.9, "code_share": 0.95, "bias_altered": 0.0,
                     "raised_firing": 2,
                     "balance": {"rule": "floor", "floor": 0.3, "anneal": [0.5, 0.8], "units_raised": 4,
                                 "bias_at_end": False},
                     "health": ["dead: 19% of the 16 units never fired"]}},
    "ce": {"base": 3.2, "spliced": 3.3, "delta": 0.1, "kl_base_spliced": 0.05, "zero_ablation": 4.1,
           "mean_ablation": 3.9, "ce_recovered_zero": 0.9, "ce_recovered_mean": 0.85, "predicted_tokens": 4000},
    "generation": {"match_curve": [1.0, 0.5], "match_at_end": 0.5, "n_prompts": 8,
                   "match_curve_plot": "plots/generation_match.png"},
    "eval_tokens": 4096,
    "reconstruction_positions": {"exclude_special_positions": True, "excluded_token_ids": [0, 1], "tokens": 4064,
                                 "excluded_tokens": 32},
    "train": {"steps": 48, "tokens": 12288, "lr": 0.01, "lr_rule": 0.01, "warmup_steps": 5, "warmup_rule": 5,
              "schedule": "cosine", "min_lr_ratio": 0.1, "loss_drop_last_fifth": 0.04,
              "code_share_floor": 0.0},
    "init": {"method": "split", "base": 3.2, "spliced": 3.6, "delta": 0.4},
    "heal": {"steps": 4, "tokens": 512, "objective": "kl", "rest": "frozen", "final": {"step": 4, "loss": 0.1}},
    "stacking": {"base_sparse_layers": {"1": "mxd"}, "original_base_model": "gpt2", "original_ce": 3.0,
                 "delta_original": 0.3},
    "recipe_summary": {"training tokens": 12288, "seed": 0},
    "lm_eval": {"tasks": {"tiny_ppl": {
        "n_shot": 0, "n_samples": 6, "n_documents": 40, "version": 1.0, "limit": 6, "batch_size": 4, "seed": None,
        "lm_eval_version": "0.4.13", "base": "tiny", "dataset": None, "local": True,
        "results_files": {"model": "lm_eval/model/results_x.json"},
        "metrics": {"word_perplexity,none": {"value": 40.5, "stderr": None, "base_value": 40.1, "base_stderr": None,
                                             "delta": 0.4, "higher_is_better": False}}}}},
    "verdict": {"grade": "fair", "reasons": ["layer 0 FVU 0.200 is fair (good < 0.1, poor > 0.3)"]},
    "example_prompt": "ROMEO:",
}


def _strict_loads(text: str):
    def refuse(constant):
        raise AssertionError(f"bare {constant} in JSON")

    return json.loads(text, parse_constant=refuse)


def _tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) if root.exists() else []


# -- claim --------------------------------------------------------------------------------------------------------


def test_checks_write_nothing_and_name_the_fix(tmp_path):
    fresh = RunFolder(tmp_path / "run")
    assert fresh.check_claimable(RECIPE) is False
    assert not (tmp_path / "run").exists()  # a refused or checked start never creates or locks the folder

    file = tmp_path / "file.txt"
    file.write_text("x")
    with pytest.raises(RunFolderError, match=r"output_dir .*file.txt is a file, not a folder; set output_dir"):
        RunFolder(file).check_claimable(RECIPE)
    with pytest.raises(RunFolderError, match=r"its parent .*file.txt is a file"):
        RunFolder(file / "sub").check_claimable(RECIPE)

    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"")
    with pytest.raises(RunFolderTaken, match=r"is not an expertize run folder \(it holds cat.jpg\); choose another"):
        RunFolder(foreign).check_claimable(RECIPE)
    with pytest.raises(FileExistsError):  # today's error type stays catchable as before
        RunFolder(foreign).check_claimable(RECIPE, restart=True)
    assert _tree(foreign) == ["cat.jpg"]


def test_claim_resume_and_refuse_a_different_recipe(tmp_path):
    folder = RunFolder(tmp_path / "run")
    assert folder.claim(RECIPE) is False and folder.is_resume is False
    assert _tree(tmp_path / "run") == [".expertize.lock", "checkpoint", "checkpoint/recipe.resolved.yaml"]
    folder.unlock()  # the run ends (a kill releases it as well): the lock file goes
    assert _tree(tmp_path / "run") == ["checkpoint", "checkpoint/recipe.resolved.yaml"]
    (folder.train_state).write_bytes(b"state")
    (folder.root / ".final.abc").mkdir()  # a publish interrupted by a kill

    again = RunFolder(tmp_path / "run")
    assert again.check_claimable(RECIPE) is True
    assert again.claim(RECIPE) is True and again.is_resume
    again.unlock()
    assert folder.train_state.read_bytes() == b"state" and not (folder.root / ".final.abc").exists()

    other = {**RECIPE, "train": {"lr": 1e-2, "seed": 0}, "layers": [1]}
    with pytest.raises(RunFolderError, match=r"different recipe \(differs at layers \(the folder's run: \[0\], this "
                                             r"recipe: \[1\]\); train.lr \(the folder's run: 0.001, this recipe: "
                                             r"0.01\)\). To resume it, run with the folder's recipe .* only if that "
                                             r"run is no longer wanted, pass --restart") as err:
        RunFolder(tmp_path / "run").claim(other)
    assert isinstance(err.value, (ValueError, ExpertizeError))
    assert folder.train_state.is_file()  # refused: nothing discarded

    # --restart: the unfinished run is discarded, the new recipe claims the folder.
    (folder.root / "notes.txt").write_text("mine")
    (folder.train_log).write_text('{"step": 1}\n')
    (folder.heal_log).write_text('{"step": 1}\n')
    restarted = RunFolder(tmp_path / "run")
    assert restarted.check_claimable(other, restart=True) is False
    assert restarted.claim(other, restart=True) is False
    restarted.unlock()
    assert _tree(folder.root) == ["checkpoint", "checkpoint/recipe.resolved.yaml", "notes.txt"]
    assert RunFolder(tmp_path / "run").check_claimable(other) is True


def test_restart_discards_only_an_unfinished_runs_files(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.claim(RECIPE)
    folder.unlock()
    folder.train_state.write_bytes(b"s")
    folder.heal_state.write_bytes(b"h")
    folder.train_log.write_text("{}\n")
    (folder.root / ".final.x1").mkdir()
    (folder.root / "keep.md").write_text("user file")
    assert folder.restart() == [".final.x1", "checkpoint", "train_log.jsonl"]
    assert _tree(folder.root) == ["keep.md"]

    # Leftovers without a recorded recipe: refused unless --restart.
    (folder.root / "keep.md").unlink()
    folder.train_log.write_text("{}\n")
    with pytest.raises(RunFolderError, match=r"leftovers of an unfinished run \(train_log.jsonl\) .* pass --restart"):
        RunFolder(folder.root).check_claimable(RECIPE)
    again = RunFolder(folder.root)
    assert again.claim(RECIPE, restart=True) is False
    again.unlock()

    folder.metrics_path.write_text("{}")
    with pytest.raises(RunFolderTaken, match="already holds a finished run .*--restart only discards unfinished"):
        RunFolder(folder.root).check_claimable(RECIPE, restart=True)
    with pytest.raises(RunFolderTaken, match="--restart only discards unfinished runs"):
        folder.restart()
    assert folder.metrics_path.is_file() and folder.claimed_recipe_path.is_file()


# -- staging and publish ------------------------------------------------------------------------------------------


def test_publish_moves_metrics_last_with_relative_plot_paths(tmp_path, monkeypatch):
    folder = RunFolder(tmp_path / "run")
    folder.claim(RECIPE)
    folder.unlock()
    folder.train_state.write_bytes(b"s")
    moved = []
    original = Path.replace

    def record(self, target):
        moved.append(Path(target).name)
        return original(self, target)

    with folder.staging() as stage:
        assert stage.path.parent == folder.root and stage.path.name.startswith(".final.")
        stage.plots_dir.mkdir()
        plot = stage.plots_dir / "generation_match.png"
        plot.write_bytes(b"png")
        (stage.path / "config.json").write_text("{}")
        stage.write_yaml("recipe.resolved.yaml", RECIPE)
        nulled = stage.write_metrics({"generation": {"match_curve_plot": str(plot)}, "ce": {"spliced": float("nan")}})
        assert nulled == ["ce.spliced"]
        monkeypatch.setattr(Path, "replace", record)
        folder.publish(stage)
        monkeypatch.undo()
    assert moved[-1] == METRICS and set(moved) == {"config.json", "plots", "recipe.resolved.yaml", METRICS}
    assert _tree(folder.root) == ["config.json", "metrics.json", "plots", "plots/generation_match.png",
                                  "recipe.resolved.yaml"]  # checkpoint/ and the staging folder are gone
    metrics = _strict_loads(folder.metrics_path.read_text())
    assert metrics == {"generation": {"match_curve_plot": "plots/generation_match.png"}, "ce": {"spliced": None}}
    assert (folder.root / metrics["generation"]["match_curve_plot"]).read_bytes() == b"png"
    assert folder.is_finished


def test_only_the_main_process_writes(tmp_path):
    main, other = RunFolder(tmp_path / "run"), RunFolder(tmp_path / "run", is_main_process=False)
    assert other.claim(RECIPE) is False and not (tmp_path / "run").exists()
    main.claim(RECIPE)
    main.unlock()
    assert other.check_claimable(RECIPE) is True and other.claim(RECIPE) is True  # reads the main process's claim
    before = _tree(main.root)
    with other.staging() as stage:
        assert not stage.path.is_relative_to(main.root)
        (stage.path / "config.json").write_text("{}")
        stage.write_metrics({"ce": {"base": 1.0}})
        other.publish(stage)  # nothing, and no failure
    assert other.restart() == [] and other.write_json(METRICS, {}) == []
    other.write_text("x.txt", "x")
    assert _tree(main.root) == before and not main.is_finished


# -- strict JSON and the metrics schema ---------------------------------------------------------------------------


def test_non_finite_values_are_written_as_null(tmp_path):
    data = {"ce": {"base": float("nan"), "spliced": 3.0}, "curve": [1.0, float("inf"), (float("-inf"), 2)]}
    clean, nulled = strict_json(data)
    assert clean == {"ce": {"base": None, "spliced": 3.0}, "curve": [1.0, None, [None, 2]]}
    assert nulled == ["ce.base", "curve[1]", "curve[2][0]"]
    assert write_json(tmp_path / "m.json", data) == nulled
    assert _strict_loads((tmp_path / "m.json").read_text()) == clean
    # model_folder.write_metrics (used by `expertize eval`) is strict too, and leaves no temporary file.
    write_metrics(tmp_path, {"layers": {"0": {"fvu": float("nan")}}})
    assert _strict_loads((tmp_path / METRICS).read_text()) == {"layers": {"0": {"fvu": None}}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", METRICS]


def test_metrics_schema_round_trip(tmp_path):
    metrics = Metrics.from_dict(METRICS_DICT)
    assert metrics.to_dict() == METRICS_DICT
    assert metrics.ce.ce_recovered_mean == 0.85 and metrics.layers["0"].dead_units == 3
    assert metrics.lm_eval.tasks["tiny_ppl"].metrics["word_perplexity,none"].base_value == 40.1
    write_metrics(tmp_path, metrics)
    assert _strict_loads((tmp_path / METRICS).read_text()) == METRICS_DICT
    assert load_metrics(tmp_path) == metrics
    assert load_metrics(tmp_path / "nowhere") == Metrics()

    # Keys from a newer expertize are kept, in every section, and written back.
    newer = {**METRICS_DICT, "energy": {"joules": 3}, "ce": {**METRICS_DICT["ce"], "ce_bits": 4.6}}
    again = Metrics.from_dict(newer)
    assert again.extra == {"energy": {"joules": 3}} and again.ce.extra == {"ce_bits": 4.6}
    assert again.to_dict() == newer

    # A partial file reads with None for the missing keys; a wrong type names its key.
    partial = Metrics.from_dict({"layers": {8: {"fvu": 1}}})
    assert partial.layers["8"].fvu == 1.0 and partial.ce is None and not Metrics().evaluated and partial.evaluated
    with pytest.raises(MetricsError, match=r"at 'layers.8.l0': expected float, got 'many'"):
        Metrics.from_dict({"layers": {"8": {"l0": "many"}}})
    assert {"ce.spliced", "ce.delta", "generation.match_at_end", "eval_tokens", "train.steps"} <= set(
        scalar_metric_paths())
    assert any("ΔCE 0.1000" in line for line in metrics.summary_lines())
    assert any("ΔCE 0.3000 against the original dense model gpt2" in line for line in metrics.summary_lines())


# -- --no-progress ------------------------------------------------------------------------------------------------


def test_quiet_library_progress_switches_the_libraries_off_and_back():
    import logging

    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    from expertize.conversion.progress import quiet_library_progress, quiet_lm_eval

    assert hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    with quiet_library_progress(enabled=False):
        assert hf_logging.is_progress_bar_enabled()
    with quiet_library_progress():
        assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.get_verbosity() == logging.ERROR
        assert hub_utils.are_progress_bars_disabled()
        with quiet_lm_eval():
            import lm_eval.models.huggingface as hf_lm

            assert hf_lm.tqdm(range(2), disable=False).disable  # lm-eval's explicit disable=False is overridden
    assert hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == verbosity
    assert not hub_utils.are_progress_bars_disabled()
    assert not hf_lm.tqdm(range(2), disable=False).disable
