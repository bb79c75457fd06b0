"""The evaluation's PNGs: the firing-frequency histogram of a sparse layer and the generation match curve.

matplotlib's Agg canvas directly: no pyplot, no global backend change.
"""

from pathlib import Path

import torch


def _new_figure():
    """A matplotlib figure on the Agg canvas (no pyplot, no global backend switch) and its axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def plot_firing_frequency(counts: torch.Tensor, tokens: int, path: Path, layer: int | None = None) -> Path:
    """Histogram of log10(firing frequency) of the units that fired; dead units are counted in the title."""
    counts = counts.double()
    live = counts[counts > 0]
    dead = counts.numel() - live.numel()
    fig, ax = _new_figure()
    if live.numel():
        ax.hist(torch.log10(live / tokens).numpy(), bins=50)
    where = "" if layer is None else f"layer {layer}: "
    ax.set_title(f"{where}{counts.numel():,} units over {tokens:,} tokens; {dead:,} dead (never fired)")
    ax.set_xlabel("log10 firing frequency (fraction of tokens)")
    ax.set_ylabel("units")
    return _save_figure(fig, path)


def plot_match_curve(curve: list[float], path: Path) -> Path:
    """% of prompts whose greedy continuation is identical to the base model's up to n tokens (paper Figs. 6-7)."""
    fig, ax = _new_figure()
    ax.plot(range(1, len(curve) + 1), [100 * v for v in curve], marker=".")
    ax.set_ylim(0, 100)
    ax.set_xlabel("generated tokens n")
    ax.set_ylabel("% of prompts identical to base up to n")
    ax.set_title("greedy continuations: spliced vs base")
    return _save_figure(fig, path)
