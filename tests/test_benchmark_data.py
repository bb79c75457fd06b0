"""benchmarks/data/: what the benchmarks read is made by scripts of the repository (docs/specialize.md used to send a
user who cloned it to ../shared/tools/, which a clone does not have)."""

import json
import re
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_script_the_docs_run_is_in_the_repository():
    pages = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "benchmarks").rglob("*.yaml")]
    named = {(page.relative_to(REPO), script) for page in pages
             for script in re.findall(r"python3? ((?:\.\./)?[\w./-]+\.py)", page.read_text(encoding="utf-8"))}
    assert named, "no `python SCRIPT.py` found in the docs"
    # exports/<name>/attribute.py is what `expertize export --to circuit-tracer` writes, not a repository file
    missing = [f"{page}: {script}" for page, script in sorted(named)
               if not (REPO / script).is_file() and not (script.startswith("exports/") and script.endswith("/attribute.py"))]
    assert not missing, "the docs run scripts a cloned repository does not have:\n  " + "\n  ".join(missing)


def _site(root: Path) -> Path:
    site = root / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "big.py").write_text("x = 1\n" * 100)  # > 400 characters: a document
    (site / "torch" / "small.py").write_text("x = 1\n")
    (site / "pkg-1.0.dist-info").mkdir()
    (site / "pkg-1.0.dist-info" / "METADATA").write_text("Name: pkg\n\n" + "A long description. " * 40)
    return site


def _run(args: list[str]) -> dict[str, list[dict]]:
    sys.path.insert(0, str(REPO / "benchmarks" / "data"))
    try:
        import domain_corpora
    finally:
        sys.path.pop(0)
    assert domain_corpora.main(args) == 0
    out = Path(args[0])
    return {f.stem: [json.loads(line) for line in f.read_text().splitlines()] for f in sorted(out.glob("*.jsonl"))}


def test_domain_corpora_from_the_data_folder(tmp_path):
    data = tmp_path / "data" / "corpora"
    data.mkdir(parents=True)
    article = "word " * 60
    (data / "wikitext2_test.raw").write_text(f" = First = \n\n{article}\n = Second = \n\n{article}\n")
    (data / "stories260k_samples.txt").write_text("Once upon a time.\n\nThe end.\n")
    files = _run([str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--site-packages", str(_site(tmp_path))])
    assert {name: len(docs) for name, docs in files.items()} == {
        "code": 1, "docs": 1, "literature": 492, "stories": 2, "wiki": 2}
    assert {d["domain"] for docs in files.values() for d in docs} == set(files)
    assert sorted(d["text"] for d in files["wiki"]) == [f"= First = \n\n{article}".strip(),
                                                         f"= Second = \n\n{article}".strip()]


def test_domain_corpora_without_a_data_folder_read_the_hub(tmp_path, monkeypatch):
    asked = []

    def load_dataset(name, config=None, split=None):
        asked.append((name, config, split))
        if name == "Salesforce/wikitext":
            return [{"text": " = Only = \n"}, {"text": "\n"}, {"text": "word " * 60 + "\n"}]
        return [{"text": "A story."}, {"text": " "}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.delenv("EXPERTIZE_DATA", raising=False)
    files = _run([str(tmp_path / "out"), "--site-packages", str(_site(tmp_path))])
    assert asked == [("Salesforce/wikitext", "wikitext-2-raw-v1", "test"), ("roneneldan/TinyStories", None,
                                                                            "validation")]
    assert [d["text"] for d in files["stories"]] == ["A story."] and len(files["wiki"]) == 1
