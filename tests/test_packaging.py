"""The package as a user gets it: a built wheel (not the editable checkout) holds every subpackage, the lm-eval task
files and the quickstart's assets, and, installed into a fresh virtualenv, runs `expertize upcycle quickstart`
offline from an empty directory with no environment variable pointing at data."""

import os
import shutil
import site
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from .conftest import shared_data_dir

REPO = Path(__file__).resolve().parents[1]
# What pyproject.toml builds from (its [tool.setuptools.package-dir]), plus the files the build metadata reads.
PACKAGE_DIRS = {"expertize": "expertize", "conversion": "expertize/conversion", "modeling": "expertize/modeling",
                "recipes": "expertize/recipes", "model_cards": "expertize/model_cards"}
BUILD_FILES = ("pyproject.toml", "README.md")
ASSETS = REPO / "expertize" / "assets"
MIN_SETUPTOOLS = 77  # the SPDX `license = "Apache-2.0"` string of pyproject.toml (PEP 639)
# Small budgets: the test checks that the installed package runs the quickstart, not the quickstart's quality.
QUICKSTART_OVERRIDES = ["data.train_tokens=16384", "train.warmup_steps=4", "data.eval_tokens=4096",
                        "eval.generation_prompts=4"]


def _source_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built offline, without build isolation, from a copy of the package sources (no build/ or egg-info
    written into the checkout, which other runs share)."""
    setuptools_major = int(version("setuptools").split(".")[0])
    if setuptools_major < MIN_SETUPTOOLS:
        pytest.fail(f"setuptools {version('setuptools')} cannot build this pyproject.toml; install "
                    f"'setuptools>={MIN_SETUPTOOLS}' into this environment (.ci/run does)")
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_FILES:
        shutil.copy2(REPO / name, src / name)
    for folder in PACKAGE_DIRS:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"pip wheel failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    (built,) = out.glob("expertize-*.whl")
    return built


def test_wheel_holds_every_subpackage_the_lm_eval_tasks_and_the_assets(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in _source_files(REPO / folder):
            rel = path.relative_to(REPO / folder).as_posix()
            if path.suffix in (".py", ".yaml", ".md", ".jsonl") or folder == "expertize":
                expected[f"{package}/{rel}"] = path
    # The checks below are what a plain install needs, named so that a failure says which part went missing.
    subpackages = {p.split("/")[2] for p in expected if p.startswith("expertize/conversion/") and p.count("/") == 3
                   and p.endswith("/__init__.py")}
    assert {"recipe", "data", "surgery", "training", "evaluation", "harness", "publishing"} <= subpackages
    tasks = [p for p in expected if "/harness/lm_eval_tasks/" in p]
    assert any(p.endswith(".yaml") for p in tasks) and any(p.endswith(".jsonl") for p in tasks)
    assets = [p for p in expected if p.startswith("expertize/assets/")]
    assert "expertize/assets/tiny-gpt2-shakespeare/model.safetensors" in assets
    assert "expertize/assets/tinyshakespeare.txt" in assets
    assert {"expertize/assets/stories260k/model.safetensors", "expertize/assets/stories260k_samples.txt"} <= set(assets)
    assert "expertize/recipes/quickstart.yaml" in expected
    missing = sorted(set(expected) - names)
    assert not missing, f"the wheel lacks {missing}: declare them in pyproject.toml (packages / package-data)"
    with zipfile.ZipFile(wheel) as z:  # and byte for byte (a truncated or LFS-pointer asset would fail here)
        for name in assets:
            assert z.read(name) == expected[name].read_bytes(), name


SHIPPED_DATA = {  # tests/data path -> the asset it is
    "corpora/tinyshakespeare.txt": "tinyshakespeare.txt",
    "corpora/stories260k_samples.txt": "stories260k_samples.txt",
    "models/tiny-gpt2-shakespeare": "tiny-gpt2-shakespeare",
    "models/stories260k": "stories260k",
}


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in _source_files(path)} if path.is_dir() else {path.name: path.read_bytes()}


def test_shipped_assets_are_the_test_datas_models_and_text():
    """The shipped recipes read the same models and text from the package as the tests read from tests/data (its
    links point into the assets: one copy in the repository) and, where EXPERTIZE_TEST_DATA names the project's
    shared data, byte for byte the same files as there."""
    data = shared_data_dir()
    for rel, asset in SHIPPED_DATA.items():
        assert (REPO / "tests" / "data" / rel).resolve() == (ASSETS / asset).resolve(), rel
        assert _files(data / rel) == _files(ASSETS / asset), rel


def _fresh_venv(root: Path) -> Path:
    """A virtualenv that reuses this environment's dependencies (torch, transformers, ...) but not its expertize."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    if sys.prefix != sys.base_prefix:
        # Running inside a virtualenv (.ci/run): --system-site-packages reaches the base interpreter's packages,
        # not this environment's; add this environment's site-packages after the new venv's own.
        venv_site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        lines = [f"import site; site.addsitedir({p!r})" for p in site.getsitepackages()]
        Path(venv_site, "zz_parent_environment.pth").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return venv


@pytest.mark.slow  # a venv, a wheel install and the quickstart (~25 s)
def test_wheel_in_a_fresh_venv_runs_the_quickstart_offline_from_an_empty_directory(wheel, tmp_path):
    venv = _fresh_venv(tmp_path)
    python = venv / "bin" / "python"
    # --ignore-installed: the editable expertize of this environment is visible to the venv; install beside it.
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    workdir = tmp_path / "empty"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("EXPERTIZE_DATA", "EXPERTIZE_TEST_DATA", "EXPERTIZE_ASSETS", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    where = subprocess.run(
        [str(python), "-c", "import expertize, expertize.conversion.cli as c; print(expertize.__file__); "
                            "print(c.__file__)"],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=120,
    )
    assert where.returncode == 0, where.stderr[-3000:]
    for path in where.stdout.split():  # the wheel's copy, not the editable checkout's (whose finder is visible)
        assert Path(path).resolve().is_relative_to(venv.resolve()), f"{path} is not inside {venv}"

    overrides = [arg for value in ["output_dir=out", *QUICKSTART_OVERRIDES] for arg in ("--set", value)]
    run = subprocess.run(
        [str(venv / "bin" / "expertize"), "upcycle", "quickstart", "--no-progress", *overrides],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    out = workdir / "out"
    for name in ("config.json", "model.safetensors", "metrics.json"):
        assert (out / name).is_file(), f"{name} missing from {sorted(p.name for p in out.iterdir())}"
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    logits = model(input_ids=torch.tensor([[0, 5, 17, 3]])).logits  # (1, 4, vocab)
    assert logits.shape == (1, 4, 2048) and torch.isfinite(logits).all()
