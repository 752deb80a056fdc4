"""`ninfer logs plot`: one figure of a run over time, from the request log.

Three panels sharing the time axis (seconds since the first record): requests
running and waiting (reconstructed per request from its start and terminal
records, so exact rather than sampled; waiting means not yet scheduled by the
engine: the admission queue plus the engine's own queue for prefill), admitted
and rejected per second, and latency percentiles (p50/p95 of total time and
time to first token of the requests completing in each bin). matplotlib is
imported only here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from ninfer.tools._logtools import LogRead, RequestSpan, percentile, request_spans

__all__ = ["plot_log"]


def _level(events: list[tuple[float, int]], t0: float) -> tuple[list[float], list[int]]:
    """A step function from (+1/-1) events: x in seconds since t0."""
    xs, ys = [0.0], [0]
    level = 0
    for t, delta in sorted(events):
        level += delta
        xs.append(t - t0)
        ys.append(level)
    return xs, ys


def _bins(span_s: float, requested: float | None) -> float:
    if requested:
        return requested
    # About 60 bins, at least 100 ms wide, rounded to a readable width.
    raw = max(span_s / 60.0, 0.1)
    for width in (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600):
        if width >= raw:
            return float(width)
    return 3600.0


def plot_log(read: LogRead, out: Path, *, bin_seconds: float | None = None) -> dict[str, float]:
    """Write the figure to `out` (the format follows the suffix); returns what it plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    spans = request_spans(read.records)
    stamps: list[float] = [float(r["ts_unix_ms"]) / 1000.0 for r in read.records]
    if not stamps:
        raise ValueError("no records to plot")
    t0, t1 = min(stamps), max(stamps)
    width = _bins(t1 - t0, bin_seconds)
    n_bins = max(1, math.ceil((t1 - t0) / width) + 1)
    edges = [i * width for i in range(n_bins + 1)]

    running: list[tuple[float, int]] = []
    waiting: list[tuple[float, int]] = []
    admitted = [0] * n_bins
    rejected = [0] * n_bins
    totals: list[list[float]] = [[] for _ in range(n_bins)]
    ttfts: list[list[float]] = [[] for _ in range(n_bins)]

    def slot(t: float) -> int:
        return min(n_bins - 1, max(0, math.floor((t - t0) / width)))

    for s in spans:
        _account(s, running, waiting)
        if s.admitted_at is not None:
            admitted[slot(s.admitted_at)] += 1
        if s.outcome == "rejected":
            rejected[slot(s.end)] += 1
        if s.outcome == "done" and s.total_s is not None:
            totals[slot(s.end)].append(s.total_s)
            if s.ttft_s is not None:
                ttfts[slot(s.end)].append(s.ttft_s)

    fig, (ax_level, ax_rate, ax_lat) = plt.subplots(
        3, 1, figsize=(10, 8.5), sharex=True, constrained_layout=True
    )
    for events, label in ((running, "running"), (waiting, "waiting")):
        xs, ys = _level(events, t0)
        ax_level.step(xs, ys, where="post", label=label)
    ax_level.set_ylabel("requests")
    ax_level.yaxis.set_major_locator(MaxNLocator(integer=True))  # whole requests
    ax_level.set_title("requests running and waiting")
    ax_level.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)

    centers = [e + width / 2 for e in edges[:-1]]
    ax_rate.bar(centers, [a / width for a in admitted], width=width * 0.9, label="admitted/s")
    down = [-r / width for r in rejected]
    ax_rate.bar(
        centers,
        down,
        width=width * 0.9,
        color="tab:red",
        label="rejected/s (down)",
    )
    ax_rate.axhline(0, color="black", linewidth=0.5)
    ax_rate.set_ylabel("per second")
    ax_rate.set_title(f"admitted and rejected ({width:g} s bins)")
    ax_rate.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)

    for values, name in ((totals, "total"), (ttfts, "ttft")):
        for p, style in ((50, "-"), (95, "--")):
            lat = [percentile(sorted(v), p) if v else math.nan for v in values]
            ax_lat.plot(centers, lat, style, marker=".", label=f"{name} p{p}")
    ax_lat.set_ylabel("seconds")
    ax_lat.set_xlabel("seconds since the first record")
    ax_lat.set_xlim(0.0, max(t1 - t0, width))
    ax_lat.set_title("latency of completed requests")
    ax_lat.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle(_title(read.files, len(spans)))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return {
        "requests": float(len(spans)),
        "seconds": t1 - t0,
        "bin_seconds": width,
        "peak_running": float(max(_level(running, t0)[1])),
        "peak_waiting": float(max(_level(waiting, t0)[1])),
    }


def _account(
    s: RequestSpan, running: list[tuple[float, int]], waiting: list[tuple[float, int]]
) -> None:
    if s.waiting_from is not None:
        until = s.admitted_at if s.admitted_at is not None else s.end
        waiting += [(s.waiting_from, 1), (max(until, s.waiting_from), -1)]
    if s.admitted_at is not None:
        running += [(s.admitted_at, 1), (max(s.end, s.admitted_at), -1)]


def _title(files: Sequence[str], requests: int) -> str:
    names = ", ".join(Path(f).name for f in files[:3]) + (" …" if len(files) > 3 else "")
    return f"ninfer: {names} ({requests} requests)"
