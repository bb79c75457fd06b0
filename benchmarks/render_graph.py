"""Draw a circuit-tracer graph.json (what an export's attribute.py writes) as a static picture: one column per prompt
token, one row per layer (embeddings at the bottom, the predicted logits on top), the pruned graph's nodes and its
strongest links (blue: positive, red: negative; width ∝ |weight|). circuit-tracer's own viewer is a web app; this is
for the docs.

    python benchmarks/render_graph.py graphs/graph.json docs/results/attribution_graph.png [--links 120]
"""

import argparse
import json
import sys
from pathlib import Path

COLORS = {"embedding": "#9e9e9e", "logit": "#2e7d32", "mlp reconstruction error": "#ff8f00"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("graph", help="graph.json written by circuit-tracer's create_graph_files")
    parser.add_argument("png")
    parser.add_argument("--links", type=int, default=120, help="draw the strongest N links")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graph = json.loads(Path(args.graph).read_text(encoding="utf-8"))
    tokens = graph["metadata"]["prompt_tokens"]
    logit_rows = {int(n["layer"]) for n in graph["nodes"] if n["feature_type"] == "logit"}
    rows = sorted({-1 if n["layer"] == "E" else int(n["layer"]) for n in graph["nodes"]})

    def row(node) -> float:
        return -1.0 if node["layer"] == "E" else float(node["layer"])

    place, per_cell = {}, {}
    for node in graph["nodes"]:  # spread the nodes that share a (layer, position) cell
        cell = (row(node), node["ctx_idx"])
        per_cell.setdefault(cell, []).append(node["node_id"])
    for (y, x), ids in per_cell.items():
        for j, node_id in enumerate(ids):
            place[node_id] = (x + (j - (len(ids) - 1) / 2) * min(0.8 / max(len(ids), 1), 0.15), y)
    kinds = {n["node_id"]: n["feature_type"] for n in graph["nodes"]}

    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(tokens)), 6))
    links = sorted(graph["links"], key=lambda link: -abs(link["weight"]))[: args.links]
    strongest = max((abs(link["weight"]) for link in links), default=1.0) or 1.0
    for link in links:
        (x0, y0), (x1, y1) = place[link["source"]], place[link["target"]]
        ax.plot([x0, x1], [y0, y1], color="#1565c0" if link["weight"] > 0 else "#c62828",
                linewidth=0.3 + 2.5 * abs(link["weight"]) / strongest, alpha=0.5, zorder=1)
    for node_id, (x, y) in place.items():
        kind = kinds[node_id]
        ax.scatter([x], [y], s=30 if kind != "logit" else 60, zorder=2, edgecolors="black", linewidths=0.3,
                   color=COLORS.get(kind, "#6a1b9a"), marker="s" if kind == "logit" else "o")
    logits = [n for n in graph["nodes"] if n["feature_type"] == "logit"]
    for j, node in enumerate(logits):  # staggered: the predicted tokens sit side by side at the last position
        x, y = place[node["node_id"]]
        ax.annotate(node.get("clerp", ""), (x, y), textcoords="offset points", xytext=(-60, 8 + 10 * j), fontsize=7)
    ax.set_xticks(range(len(tokens)), [repr(t)[1:-1] for t in tokens], rotation=30, fontsize=8)
    ax.set_yticks(rows, ["emb" if y == -1 else "logit" if y in logit_rows else f"L{y}" for y in rows])
    ax.set_title(f"attribution graph: {graph['metadata'].get('scan', '')} — {graph['metadata']['prompt']!r}"[:110],
                 fontsize=9)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=c, label=k)
               for k, c in {**COLORS, "latent (transcoder / CLT)": "#6a1b9a"}.items()]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(args.png, dpi=130)
    print(f"wrote {args.png}: {len(place)} nodes, {len(links)} of {len(graph['links'])} links")
    return 0


if __name__ == "__main__":
    sys.exit(main())
