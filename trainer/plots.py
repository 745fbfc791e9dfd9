"""PNG plots written beside a run: curves people would rather see than read."""

from __future__ import annotations

from pathlib import Path


def plot_curves(
    series: dict[str, list[tuple[int, float]]],
    path: str | Path,
    *,
    title: str = "",
    xlabel: str = "optimizer step",
    ylabel: str = "value",
    log_y: bool = False,
) -> Path:
    """One line per named series of (step, value) points; empty series are skipped."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, points in series.items():
        if not points:
            continue
        steps, values = zip(*points)
        axes.plot(steps, values, label=name, marker="o" if len(points) < 30 else None, markersize=3)
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    if log_y:
        axes.set_yscale("log")
    if title:
        axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".tmp-{path.name}")
    figure.savefig(temporary, format="png")
    plt.close(figure)
    temporary.replace(path)
    return path
