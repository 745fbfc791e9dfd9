"""PNG plots of a run's metrics against step, and the metric,step,value CSV files they are drawn from."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from models.files.atomic import write_atomically, write_file_atomically

Series = dict[str, list[tuple[int, float]]]
CSV_HEADER = ("metric", "step", "value")


def metrics_csv_rows(rows: list[tuple[str, int, float]]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    return buffer.getvalue()


def write_metrics_csv(series: Series, path: str | Path) -> Path:
    """The whole history as metric,step,value rows, replacing ``path`` atomically (never truncated)."""
    rows = [(name, step, value) for name, points in series.items() for step, value in points]
    return write_atomically(path, metrics_csv_rows([CSV_HEADER, *rows]), what="metrics file")


def complete_csv_lines(path: str | Path) -> list[str]:
    """The lines of a CSV that a writer appends to: a last line without its newline was torn by a kill and
    is dropped."""
    return Path(path).read_text().split("\n")[:-1]


def read_csv_rows(path: str | Path) -> list[dict[str, str]]:
    """Rows of any headed CSV (Lightning's CSVLogger metrics, say) as dicts, without a torn last line."""
    return list(csv.DictReader(complete_csv_lines(path)))


def read_metrics_csv(path: str | Path) -> Series:
    """{metric: [(step, value), ...]} from a metric,step,value CSV. The file is appended to while a run goes,
    a row per write: a last line without its newline was torn by a kill and is dropped (its value may be
    cut short), as is any other malformed row."""
    complete_lines = complete_csv_lines(path)
    series: Series = {}
    if not complete_lines or next(csv.reader(complete_lines[:1])) != list(CSV_HEADER):
        return series  # another kind of CSV
    for row in csv.reader(complete_lines[1:]):
        if len(row) != 3:
            continue
        try:
            point = (int(row[1]), float(row[2]))
        except ValueError:
            continue
        series.setdefault(row[0], []).append(point)
    return series


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
    # Deferred (about a third of a second) and in this order: the Agg backend must be chosen before pyplot
    # is first imported, and runs that never plot (every rank but 0) never pay for it.
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, points in series.items():
        if not points:
            continue
        steps, values = zip(*points)
        axes.plot(steps, values, label=name, marker="o" if len(points) < 30 else None, markersize=3)
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
    try:  # not fsynced: a lost plot is redrawn from its CSV
        return write_file_atomically(path, lambda temporary: figure.savefig(temporary, format="png"), durable=False)
    finally:
        plt.close(figure)
