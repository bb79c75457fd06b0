"""`expertize push`: the Hub calls patched to copy into a local "repo", from which a process without expertize loads
the model; the files chosen; the card's repo id; errors (no token, not an expertize folder, name clash, namespace)."""

import filecmp
import json
import shutil
from pathlib import Path
from unittest import mock

import httpx2
import pytest
import torch
import yaml
from huggingface_hub import HfApi, ModelCard, RepoUrl
from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError

from expertize.conversion.cli import main as cli_main
from expertize.conversion.publishing.model_folder import (
    ModelFolderError, refresh_model_card, render_card_from_folder,
)
from expertize.conversion.publishing.push import PushError, files_to_upload, push_model
from expertize.conversion.surgery.splice import save_model, splice
from expertize.modeling import MxdLayer, MxdSpec
from tests.conftest import D_HIDDEN, D_MODEL, run_isolated, tiny_base_model, tiny_tokenizer

REPO = "alice/tiny-mxd"


@pytest.fixture
def model_dir(tmp_path):
    """A saved tiny spliced model with a card, training leftovers and lm-eval files."""
    spec = MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=16, k=4, activation="gelu_new")
    torch.manual_seed(0)
    folder = save_model(splice(tiny_base_model("gpt2"), {1: MxdLayer(spec)}), tmp_path / "model",
                        tokenizer=tiny_tokenizer())
    (folder / "provenance.json").write_text(json.dumps({"base_model": "openai-community/gpt2"}), encoding="utf-8")
    (folder / "metrics.json").write_text(json.dumps({"ce": {"base": 3.0, "spliced": 3.1}}), encoding="utf-8")
    refresh_model_card(folder)
    (folder / "checkpoint").mkdir()
    (folder / "checkpoint" / "state.pt").write_bytes(b"optimizer state")
    (folder / "lm_eval" / "model").mkdir(parents=True)
    (folder / "lm_eval" / "model" / "results_2026.json").write_text("{}", encoding="utf-8")
    (folder / "lm_eval" / "model" / "samples_tiny_ppl_2026.jsonl").write_text("{}\n", encoding="utf-8")
    (folder / ".README.md.123.tmp").write_text("half a card", encoding="utf-8")
    return folder


def _http_error(cls, status: int, **kwargs):
    response = httpx2.Response(status, request=httpx2.Request("POST", "https://huggingface.co/api/repos/create"))
    return cls(f"{status} error", response=response, **kwargs)


class FakeHub:
    """Stands in for the Hub: create_repo / create_branch record their calls, upload_folder copies the folder."""

    def __init__(self, root: Path, *, create_error: Exception | None = None, existing: dict | None = None):
        self.root, self.create_error, self.existing = root, create_error, existing
        self.calls: list[tuple] = []

    def create_repo(self, api, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        if self.create_error is not None:
            raise self.create_error
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_branch(self, api, repo_id, *, branch, **kwargs):
        self.calls.append(("create_branch", repo_id, branch))

    def list_repo_files(self, api, repo_id, *, revision=None, **kwargs):
        if revision is not None and revision not in self.existing.get("branches", ()):
            raise _http_error(RevisionNotFoundError, 404)
        return list(self.existing["files"])

    def hf_hub_download(self, api, repo_id, filename, *, revision=None, **kwargs):
        path = self.root / "download" / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.existing["config"]), encoding="utf-8")
        return str(path)

    def upload_folder(self, api, *, repo_id, folder_path, revision=None, **kwargs):
        self.calls.append(("upload_folder", repo_id, revision))
        target = self.root / repo_id.replace("/", "--") / (revision or "main")
        shutil.copytree(folder_path, target, dirs_exist_ok=True)
        return mock.Mock(commit_url=f"https://huggingface.co/{repo_id}/commit/abc")

    def __enter__(self):
        self._patches = [
            mock.patch.object(HfApi, name, autospec=True, side_effect=getattr(self, name))
            for name in ("create_repo", "create_branch", "list_repo_files", "hf_hub_download", "upload_folder")
        ]
        self._patches.append(mock.patch("expertize.conversion.publishing.push.get_token", return_value="hf_fake"))
        for p in self._patches:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in self._patches:
            p.stop()


@pytest.mark.slow  # a subprocess (~8 s)
def test_push_uploads_a_folder_that_loads_without_expertize(model_dir, tmp_path):
    hub_root = tmp_path / "hub"
    with FakeHub(hub_root) as hub:
        assert cli_main(["push", str(model_dir), "--repo-id", REPO, "--private"]) == 0
    assert hub.calls[0] == ("create_repo", REPO, {"private": True, "exist_ok": False, "repo_type": "model"})
    assert hub.calls[-1] == ("upload_folder", REPO, None)
    repo = hub_root / "alice--tiny-mxd" / "main"
    uploaded = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file())
    assert uploaded == files_to_upload(model_dir)
    assert "lm_eval/model/results_2026.json" in uploaded and "metrics.json" in uploaded
    assert not any(name.startswith(("checkpoint/", ".")) or "samples_" in name for name in uploaded)
    assert not list(model_dir.glob(".push.*"))  # the staging folder is gone

    # The uploaded card names the real repo; the local one is untouched.
    text = (repo / "README.md").read_text(encoding="utf-8")
    assert f'repo = "{REPO}"' in text and ModelCard.load(repo / "README.md").data.model_name == "tiny-mxd"
    assert '"<user>/' in (model_dir / "README.md").read_text(encoding="utf-8")

    # From the "Hub" copy, a process that cannot import expertize loads the model through remote code.
    torch.manual_seed(0)
    ids = torch.randint(0, 99, (1, 7))
    from expertize.conversion.surgery.splice import load_expertize_model

    expected = load_expertize_model(model_dir)(ids).logits[0, -1, :5].tolist()
    out = run_isolated(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained({str(repo)!r}, trust_remote_code=True)
        AutoTokenizer.from_pretrained({str(repo)!r}, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        print(json.dumps(model(torch.tensor({ids.tolist()})).logits[0, -1, :5].tolist()))
        """,
        tmp_path,
    )
    assert json.loads(out.strip().splitlines()[-1]) == pytest.approx(expected, abs=1e-6)


def test_push_include_samples_and_revision(model_dir, tmp_path):
    assert "lm_eval/model/samples_tiny_ppl_2026.jsonl" in files_to_upload(model_dir, include_samples=True)
    existing = {"files": [".gitattributes", "README.md", "config.json"], "config": {"model_type": "expertize_gpt2"}}
    conflict = _http_error(HfHubHTTPError, 409)
    with FakeHub(tmp_path / "hub", create_error=conflict, existing=existing) as hub:
        url = push_model(model_dir, REPO, revision="k8", include_samples=True)
    assert url == f"https://huggingface.co/{REPO}/commit/abc"
    assert ("create_branch", REPO, "k8") in hub.calls and hub.calls[-1] == ("upload_folder", REPO, "k8")
    assert (tmp_path / "hub" / "alice--tiny-mxd" / "k8" / "lm_eval/model/samples_tiny_ppl_2026.jsonl").is_file()


def test_push_updates_an_existing_expertize_repo(model_dir, tmp_path):
    existing = {"files": ["README.md", "config.json", "model.safetensors"], "config": {"model_type": "expertize_gpt2"}}
    with FakeHub(tmp_path / "hub", create_error=_http_error(HfHubHTTPError, 409), existing=existing) as hub:
        push_model(model_dir, REPO)
    assert hub.calls[-1] == ("upload_folder", REPO, None)


def test_push_refuses_a_repo_holding_another_model(model_dir, tmp_path, capsys):
    existing = {"files": ["README.md", "config.json", "model.safetensors"], "config": {"model_type": "llama"}}
    with FakeHub(tmp_path / "hub", create_error=_http_error(HfHubHTTPError, 409), existing=existing) as hub:
        assert cli_main(["push", str(model_dir), "--repo-id", REPO]) == 2
        err = capsys.readouterr().err
        assert f"{REPO} already exists and holds a 'llama' model, not an expertize model" in err
        assert "another --repo-id" in err and "--revision NAME" in err
        assert not [c for c in hub.calls if c[0] == "upload_folder"]
        # The suggested fix: a new branch of that repo.
        assert cli_main(["push", str(model_dir), "--repo-id", REPO, "--revision", "expertize"]) == 0
    assert hub.calls[-1] == ("upload_folder", REPO, "expertize")


def test_push_refuses_a_namespace_it_cannot_write(model_dir, tmp_path):
    with FakeHub(tmp_path / "hub", create_error=_http_error(HfHubHTTPError, 403)):
        with pytest.raises(PushError, match="cannot write to namespace 'alice'"):
            push_model(model_dir, REPO)


def test_push_without_a_token_stops_before_the_network(model_dir, tmp_path, capsys):
    with FakeHub(tmp_path / "hub") as hub, mock.patch("expertize.conversion.publishing.push.get_token", return_value=None):
        assert cli_main(["push", str(model_dir), "--repo-id", REPO]) == 2
    err = capsys.readouterr().err
    assert "expertize push: error: no Hugging Face token" in err and "hf auth login" in err and "--token" in err
    assert hub.calls == []


def test_push_refuses_folders_that_are_not_expertize_models(tmp_path):
    base = tmp_path / "plain"
    tiny_base_model("gpt2").save_pretrained(base)
    with FakeHub(tmp_path / "hub") as hub:
        with pytest.raises(ModelFolderError, match="holds a 'gpt2' model, not an expertize model"):
            push_model(base, REPO)
        with pytest.raises(ValueError, match="has no config.json"):
            push_model(tmp_path, REPO)
        spec = MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=16, k=4, activation="gelu_new")
        folder = save_model(splice(tiny_base_model("gpt2"), {1: MxdLayer(spec)}), tmp_path / "m", tokenizer=False)
        (folder / "model.safetensors").unlink()
        with pytest.raises(ValueError, match="has no weights"):
            push_model(folder, REPO)
        with pytest.raises(PushError, match="expected USER/NAME"):
            push_model(folder, "tiny-mxd")
    assert hub.calls == []


def test_push_keeps_a_card_the_user_wrote_and_renders_a_missing_one(model_dir, tmp_path):
    (model_dir / "README.md").write_text("---\nlicense: mit\n---\n# My own card\n", encoding="utf-8")
    with FakeHub(tmp_path / "hub"):
        push_model(model_dir, REPO)
    repo = tmp_path / "hub" / "alice--tiny-mxd" / "main"
    assert (repo / "README.md").read_text(encoding="utf-8") == "---\nlicense: mit\n---\n# My own card\n"

    (model_dir / "README.md").unlink()
    with FakeHub(tmp_path / "hub2"):
        push_model(model_dir, REPO)
    card = ModelCard.load(tmp_path / "hub2" / "alice--tiny-mxd" / "main" / "README.md")
    assert card.data.base_model == "openai-community/gpt2" and f'repo = "{REPO}"' in card.text
    assert not (model_dir / "README.md").exists()


def test_push_while_offline_is_a_clear_error(model_dir, tmp_path, capsys):
    """HF_HUB_OFFLINE (set for the whole test session) with a token: one line saying so, no traceback."""
    assert cli_main(["push", str(model_dir), "--repo-id", REPO, "--token", "hf_fake"]) == 2
    err = capsys.readouterr().err
    assert "expertize push: error: cannot push to alice/tiny-mxd: offline mode is on (HF_HUB_OFFLINE is set)" in err
    assert "unset HF_HUB_OFFLINE" in err and "Traceback" not in err
    assert not list(model_dir.glob(".push.*"))


def test_pushed_records_hold_no_local_paths(model_dir, tmp_path):
    """A local base: the card names it by its folder name (no base_model metadata), and the uploaded provenance,
    recipe, metrics and lm-eval files carry `<local>/NAME` instead of paths; the local files keep the real ones."""
    base = tmp_path / "bases" / "tiny-gpt2"
    provenance = {"base_model": str(base), "base_model_hub_id": None, "seed": 0}
    recipe = {"base_model": str(base), "output_dir": str(model_dir), "data": {"paths": [str(tmp_path / "c.txt")]}}
    metrics = {"ce": {"base": 3.0, "spliced": 3.1}, "generation": {"match_curve": [1.0], "match_at_end": 1.0,
               "match_curve_plot": "plots/generation_match.png"},
               "lm_eval": {"tasks": {"tiny_ppl": {"base": str(base), "metrics": {"ppl,none": {"value": 3.0}}}}}}
    (model_dir / "provenance.json").write_text(json.dumps(provenance), encoding="utf-8")
    (model_dir / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    (model_dir / "metrics.json").write_text(json.dumps(metrics), encoding="utf-8")
    (model_dir / "lm_eval" / "comparison.md").write_text(f"model: `{model_dir}`\n", encoding="utf-8")
    (model_dir / "lm_eval" / "model" / "results_2026.json").write_text(
        json.dumps({"config": {"model_args": f"pretrained={model_dir},dtype=float32"}}), encoding="utf-8")
    refresh_model_card(model_dir)
    assert f"`{base}` with the MLP of layer 1" in (model_dir / "README.md").read_text()  # the local, truthful card
    public = render_card_from_folder(model_dir)
    assert public.data.base_model is None and "`tiny-gpt2` with the MLP of layer 1" in public.text
    assert str(tmp_path) not in public.text

    with FakeHub(tmp_path / "hub"):
        push_model(model_dir, REPO)
    repo = tmp_path / "hub" / "alice--tiny-mxd" / "main"
    pushed_card = ModelCard.load(repo / "README.md")
    assert pushed_card.data.base_model is None and "`tiny-gpt2` with the MLP of layer 1" in pushed_card.text
    for path in repo.rglob("*"):
        if path.suffix in (".json", ".yaml", ".md"):
            assert str(tmp_path) not in path.read_text(encoding="utf-8"), path
    assert json.loads((repo / "provenance.json").read_text())["base_model"] == "<local>/tiny-gpt2"
    pushed_recipe = yaml.safe_load((repo / "recipe.resolved.yaml").read_text())
    assert pushed_recipe == {"base_model": "<local>/tiny-gpt2", "output_dir": "<local>/model",
                             "data": {"paths": ["<local>/c.txt"]}}
    pushed_metrics = json.loads((repo / "metrics.json").read_text())
    assert pushed_metrics["lm_eval"]["tasks"]["tiny_ppl"]["base"] == "<local>/tiny-gpt2"
    assert pushed_metrics["generation"]["match_curve_plot"] == "plots/generation_match.png"
    assert "pretrained=<local>/model,dtype=float32" in (repo / "lm_eval/model/results_2026.json").read_text()
    # The local folder's own records stay truthful (eval finds the base through them).
    assert json.loads((model_dir / "provenance.json").read_text()) == provenance
    assert yaml.safe_load((model_dir / "recipe.resolved.yaml").read_text()) == recipe
    assert filecmp.cmp(model_dir / "tokenizer.json", repo / "tokenizer.json", shallow=False)


def test_card_names_a_hub_base_by_its_id(model_dir, tmp_path):
    """A base from the Hub cache (a local snapshot path) is recorded, linked and pushed as its Hub id."""
    snapshot = tmp_path / "hub-cache" / "models--openai-community--gpt2" / "snapshots" / "abc123"
    provenance = {"base_model": str(snapshot), "base_model_hub_id": "openai-community/gpt2"}
    (model_dir / "provenance.json").write_text(json.dumps(provenance), encoding="utf-8")
    card = ModelCard.load(refresh_model_card(model_dir))
    assert card.data.base_model == "openai-community/gpt2"
    assert "[openai-community/gpt2](https://huggingface.co/openai-community/gpt2) with" in card.text
    with FakeHub(tmp_path / "hub"):
        push_model(model_dir, REPO)
    pushed = json.loads((tmp_path / "hub" / "alice--tiny-mxd" / "main" / "provenance.json").read_text())
    assert pushed["base_model"] == "openai-community/gpt2"


def _add_reports(folder: Path) -> dict[str, int]:
    """What a user writes into a model folder besides the model: `inspect --output MODEL_DIR` (layer_<i>.json,
    index.html), `specialize --json MODEL_DIR/spec.json`, an inspect/ subfolder and a note; name -> bytes."""
    reports = {"layer_1.json": '{"units": []}', "index.html": "<html></html>", "spec.json": "{}", "notes.txt": "mine",
               "inspect/layer_1.json": "{}"}
    for rel, text in reports.items():
        (folder / rel).parent.mkdir(exist_ok=True)
        (folder / rel).write_text(text, encoding="utf-8")
    return {"layer_1.json": 13, "index.html": 13, "spec.json": 2, "notes.txt": 4, "inspect/": 2}


def test_dry_run_lists_exactly_what_push_uploads_and_leaves_reports_out(model_dir, tmp_path, capsys):
    """Before: reports at the folder's top level (inspect --output MODEL_DIR, specialize --json MODEL_DIR/spec.json)
    were uploaded, and nothing listed the upload beforehand. After: an allow-list of the model folder's files, and
    `push --dry-run` (offline, no token) lists exactly the files the push then uploads."""
    reports = _add_reports(model_dir)
    with mock.patch("expertize.conversion.publishing.push.get_token", return_value=None):  # no token needed
        assert cli_main(["push", str(model_dir), "--dry-run", "--repo-id", REPO]) == 0
    captured = capsys.readouterr()
    listed = [line.split()[0] for line in captured.out.splitlines() if line.startswith("  ")]
    assert not list(model_dir.glob(".push.*"))  # the dry run's staging folder is gone
    with FakeHub(tmp_path / "hub") as hub:
        assert cli_main(["push", str(model_dir), "--repo-id", REPO]) == 0
    assert hub.calls[-1] == ("upload_folder", REPO, None)
    repo = tmp_path / "hub" / "alice--tiny-mxd" / "main"
    uploaded = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file())
    assert listed == uploaded
    assert f"would upload {len(uploaded)} files" in captured.out
    assert not set(uploaded) & {"layer_1.json", "index.html", "spec.json", "notes.txt", "inspect/layer_1.json"}
    assert {"config.json", "model.safetensors", "modeling_expertize.py", "tokenizer.json", "metrics.json",
            "README.md", "lm_eval/model/results_2026.json"} <= set(uploaded)
    for name in reports:
        assert name in captured.err  # named as left out
    from expertize.conversion.publishing.push import left_out

    assert left_out(model_dir) == reports
    assert "layer_1.json" in files_to_upload(model_dir, include_reports=True)


def test_push_warns_while_the_license_is_unknown_and_keeps_one_the_user_set(model_dir, tmp_path, capsys):
    readme = model_dir / "README.md"
    assert ModelCard.load(readme).data.license == "unknown" and "## License" in readme.read_text(encoding="utf-8")
    assert cli_main(["push", str(model_dir), "--dry-run"]) == 0
    assert "warning: the model card's license is unknown" in capsys.readouterr().err
    readme.write_text(readme.read_text(encoding="utf-8").replace("license: unknown", "license: mit"), encoding="utf-8")
    refresh_model_card(model_dir)  # e.g. after `expertize eval`: the card is rebuilt from the records
    assert ModelCard.load(readme).data.license == "mit" and "## License" not in readme.read_text(encoding="utf-8")
    with FakeHub(tmp_path / "hub"):
        assert cli_main(["push", str(model_dir), "--repo-id", REPO]) == 0
    assert "license" not in capsys.readouterr().err
    assert ModelCard.load(tmp_path / "hub" / "alice--tiny-mxd" / "main" / "README.md").data.license == "mit"


def test_push_without_repo_id_is_refused_unless_dry_run(model_dir, capsys):
    assert cli_main(["push", str(model_dir)]) == 2
    assert "--repo-id USER/NAME is required (only --dry-run works without it)" in capsys.readouterr().err
