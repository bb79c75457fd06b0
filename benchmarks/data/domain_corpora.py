#!/usr/bin/env python3
"""Write real multi-domain text as one JSON-lines file per domain ({"text": ..., "domain": ...} per document): the
corpora of benchmarks/specialization.py and benchmarks/smollm2_dead_units.yaml.

    python benchmarks/data/domain_corpora.py OUT_DIR [--data DIR] [--max-mb 20] [--site-packages DIR]

Domains (provenance and licences: benchmarks/data/README.md):
  code        Python source files of installed packages (torch, transformers, numpy, ...), one document per file
  docs        package documentation: the long descriptions in installed packages' METADATA (Markdown / reST)
  wiki        WikiText-2 raw, test split, one document per article: DIR/corpora/wikitext2_test.raw, else the Hub's
              Salesforce/wikitext (wikitext-2-raw-v1, test)
  literature  Tiny Shakespeare (shipped with expertize: expertize/assets/tinyshakespeare.txt), blocks of ~2,000 chars
  stories     stories sampled from the stories260K model, one per line: DIR/corpora/stories260k_samples.txt, else
              the Hub's roneneldan/TinyStories validation split (other stories: say so beside any number)

DIR defaults to $EXPERTIZE_DATA (the folder the bundled recipes read); the Hub fallbacks need `datasets` and the
network. Documents are shuffled with a fixed seed and each domain is capped at --max-mb of text. The code and docs
domains depend on the packages installed where torch is (or --site-packages), so report
that alongside any number measured on them. What went into each file is printed. With the same inputs the files are
byte for byte those the results in docs/results/ were measured on.
"""

import argparse
import glob
import importlib.util
import json
import os
import random
import re
import sys
import sysconfig
from pathlib import Path

CODE_PACKAGES = ["torch", "transformers", "numpy", "scipy", "pandas", "sklearn", "matplotlib", "sympy", "networkx",
                 "huggingface_hub", "datasets", "peft", "accelerate", "lm_eval", "yaml", "tqdm", "jinja2", "requests"]
ASSETS = Path(__file__).resolve().parents[2] / "expertize" / "assets"


def blocks(text: str, size: int) -> list[str]:
    """Paragraphs joined into blocks of at least `size` characters (the last one may be shorter)."""
    out, current = [], []
    for paragraph in text.split("\n\n"):
        current.append(paragraph)
        if sum(map(len, current)) >= size:
            out.append("\n\n".join(current))
            current = []
    return out + (["\n\n".join(current)] if current else [])


def code_documents(site: Path) -> list[str]:
    return [text for package in CODE_PACKAGES
            for file in sorted(glob.glob(str(site / package / "**" / "*.py"), recursive=True))
            if 400 < len(text := Path(file).read_text(errors="ignore")) < 200_000]


def docs_documents(site: Path) -> list[str]:
    bodies = (Path(f).read_text(errors="ignore").split("\n\n", 1)[-1]
              for f in sorted(glob.glob(str(site / "*.dist-info" / "METADATA"))))
    return [body for body in bodies if len(body) > 500]


def wiki_documents(data: Path | None) -> tuple[list[str], str]:
    local = data / "corpora" / "wikitext2_test.raw" if data else None
    if local is not None and local.is_file():
        text, source = local.read_text().replace("\r\n", "\n"), str(local)
    else:
        import datasets

        rows = datasets.load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1", split="test")
        text, source = "".join(row["text"] for row in rows), "hub: Salesforce/wikitext wikitext-2-raw-v1 test"
    articles = re.split(r"\n(?= = [^=\n][^\n]* = \n)", text)  # a level-1 heading " = Title = " starts an article
    return [a.strip() for a in articles if len(a.strip()) > 200], source


def story_documents(data: Path | None) -> tuple[list[str], str]:
    local = data / "corpora" / "stories260k_samples.txt" if data else None
    if local is not None and local.is_file():
        return [line for line in local.read_text().splitlines() if line.strip()], str(local)
    import datasets

    rows = datasets.load_dataset("roneneldan/TinyStories", split="validation")
    return [row["text"] for row in rows if row["text"].strip()], "hub: roneneldan/TinyStories validation"


def default_site_packages() -> str:
    """The folder the code packages are installed in (torch's; a virtual environment may take it from the system),
    else this interpreter's site-packages."""
    spec = importlib.util.find_spec("torch")  # finds, does not import
    return str(Path(spec.origin).parents[1]) if spec and spec.origin else sysconfig.get_paths()["purelib"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--data", default=os.environ.get("EXPERTIZE_DATA"),
                   help="folder holding corpora/wikitext2_test.raw and corpora/stories260k_samples.txt "
                   "(default $EXPERTIZE_DATA; missing files come from the Hub)")
    p.add_argument("--max-mb", type=float, default=20.0, help="text per domain, in millions of characters")
    p.add_argument("--site-packages", default=default_site_packages(),
                   help="where the code and docs domains come from (default: the folder torch is installed in)")
    a = p.parse_args(argv)
    site, data = Path(a.site_packages), Path(a.data) if a.data else None
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wiki, wiki_source = wiki_documents(data)
    stories, stories_source = story_documents(data)
    domains = {
        "code": (code_documents(site), f"{site} ({', '.join(CODE_PACKAGES)})"),
        "docs": (docs_documents(site), f"{site}/*.dist-info/METADATA"),
        "wiki": (wiki, wiki_source),
        "literature": (blocks((ASSETS / "tinyshakespeare.txt").read_text(), 2000),
                       "expertize/assets/tinyshakespeare.txt"),
        "stories": (stories, stories_source),
    }
    for name, (texts, source) in domains.items():
        random.Random(0).shuffle(texts)
        kept, chars = [], 0
        for text in texts:
            if chars + len(text) > a.max_mb * 1e6:
                break
            kept.append(text)
            chars += len(text)
        with open(out / f"{name}.jsonl", "w") as f:
            for text in kept:
                f.write(json.dumps({"text": text, "domain": name}) + "\n")
        print(f"{name:<11} {len(kept):>6} documents {chars / 1e6:>7.2f} M characters -> {out / (name + '.jsonl')}"
              f"  (from {source})")
    if not domains["code"][0] or not domains["docs"][0]:
        print(f"error: no code or docs found under {site}; pass --site-packages", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
