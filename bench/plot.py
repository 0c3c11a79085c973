"""Latency CDF plots (`--plot F.png`). matplotlib is optional (`pip install xlaserve[plot]`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

MISSING_MATPLOTLIB = (
    "--plot needs matplotlib, which is not installed: pip install matplotlib "
    "(or xlaserve[plot]); no plot written"
)


def plot_latency_cdfs(series_ms: Mapping[str, Sequence[float]], path: str, title: str = "") -> str:
    """One empirical CDF panel per series (name -> values in ms) side by side, saved to `path`.

    Returns a one-line message saying what was written (or why nothing was).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return MISSING_MATPLOTLIB
    import numpy as np

    names = list(series_ms)
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        values = np.sort(np.asarray(series_ms[name], dtype=np.float64))
        if values.size:
            ax.step(values, np.arange(1, values.size + 1) / values.size, where="post")
            for p in (50, 90, 99):
                ax.axvline(np.percentile(values, p), ls=":", lw=0.8, color="gray")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(name)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"latency CDFs written to {path}"
