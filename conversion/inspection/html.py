"""The offline explorer: one self-contained index.html (inline CSS, JS and data; no network) over the layer reports.

The template is `explorer.html` next to this file (package data). The reports are embedded compactly: every token
string once, in a table, and contexts / promoted tokens refer to it by position.
"""

import json
import os
from importlib import resources
from pathlib import Path

from ..publishing.run_folder import write_text

__all__ = ["explorer_data", "render_explorer", "write_explorer"]

DATA_MARK = "/*__EXPERTIZE_DATA__*/null"


def explorer_data(reports: list[dict]) -> dict:
    """The reports with token strings replaced by indices into one shared table `strings`."""
    strings: list[str] = []
    index: dict[str, int] = {}

    def ref(text: str) -> int:
        if text not in index:
            index[text] = len(strings)
            strings.append(text)
        return index[text]

    layers = []
    for report in reports:
        domains = list(report["domains"])
        units = []
        for u in report["units"]:
            units.append({
                "id": u["id"],
                "f": u["frequency"],
                "mean": u["mean_activation"],
                "max": u["max_activation"],
                "dom": [u["domains"][d] for d in domains],
                "sel": u["selectivity"],
                "top": -1 if u["top_domain"] is None else domains.index(u["top_domain"]),
                "ctx": [
                    [[ref(t) for t in c["tokens"]], c["activations"], c["peak"], domains.index(c["domain"])]
                    for c in u["top_contexts"]
                ],
                "pro": [[ref(t["token"]), t["logit"]] for t in u["promoted_tokens"]],
                "sup": [[ref(t["token"]), t["logit"]] for t in u["suppressed_tokens"]],
            })
        meta = {k: v for k, v in report.items() if k != "units"}
        layers.append({**meta, "units": units})
    return {"model": reports[0]["model"] if reports else "", "strings": strings, "layers": layers}


def render_explorer(reports: list[dict]) -> str:
    template = resources.files(__package__).joinpath("explorer.html").read_text(encoding="utf-8")
    payload = json.dumps(explorer_data(reports), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    # Inside <script>, "</" could close the tag early; "<\/" is the same JSON string.
    payload = payload.replace("</", "<\\/")
    if DATA_MARK not in template:
        raise RuntimeError("explorer.html lost its data placeholder")
    return template.replace(DATA_MARK, payload)


def write_explorer(reports: list[dict], path: str | os.PathLike) -> Path:
    return write_text(Path(path), render_explorer(reports))
