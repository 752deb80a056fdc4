"""`ninfer logs plot`: one figure of a run over time, from the request log.

Three panels sharing the time axis (wall-clock UTC, or seconds since the window's
start), over the whole log or a window of it (--since/--until): requests
running and waiting (reconstructed per request from its start and terminal
records, so exact rather than sampled; waiting means not yet scheduled by the
engine: the admission queue plus the engine's own queue for prefill), admitted
and rejected per second, and latency percentiles (p50/p95 of total time and
time to first token of the requests completing in each bin). matplotlib is
imported only here.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from ninfer.tools._logtools import LogRead, RequestSpan, percentile, request_spans

__all__ = ["plot_log", "resolve_moment"]

Clock = Literal["utc", "relative"]


def resolve_moment(text: str, first: float) -> float:
    """A window edge as Unix seconds: a number is seconds after the log's first record
    (`30`, `90.5`); anything else an ISO 8601 date and time (`2026-12-02T14:03:00`,
    with an offset or `Z`; without one it is UTC, as the log's own clock)."""
    try:
        return first + float(text)
    except ValueError:
        pass
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is neither seconds after the first record nor an ISO 8601 time "
            "(e.g. 2026-12-02T14:03:00Z)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


def _clock_label(t0: float, t1: float) -> str:
    """The wall-clock axis's label: the day(s) it covers, in UTC."""
    first, last = (dt.datetime.fromtimestamp(t, dt.UTC).date() for t in (t0, t1))
    days = first.isoformat() if first == last else f"{first.isoformat()} to {last.isoformat()}"
    return f"time (UTC, {days})"


def _level(events: list[tuple[float, int]], t0: float, t1: float) -> tuple[list[float], list[int]]:
    """A step function from (+1/-1) events over [t0, t1]: x in seconds since t0 (the
    level at t0 is that of every event before it)."""
    level = 0
    xs, ys = [0.0], [0]
    for t, delta in sorted(events):
        if t > t1:
            break
        level += delta
        if t <= t0:
            ys[0] = level
        else:
            xs.append(t - t0)
            ys.append(level)
    return xs, ys


def _begin(s: RequestSpan) -> float:
    for t in (s.waiting_from, s.admitted_at):
        if t is not None:
            return t
    return s.end


def _moment(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _clock(t: float, span_s: float) -> str:
    """A tick's label: the time of day, to the second (or the tenth, on a short window)."""
    moment = dt.datetime.fromtimestamp(t, dt.UTC)
    if span_s < 10:
        return moment.strftime("%H:%M:%S.") + f"{moment.microsecond // 100_000}"
    return moment.strftime("%H:%M:%S")


def _bins(span_s: float, requested: float | None) -> float:
    if requested:
        return requested
    # About 60 bins, at least 100 ms wide, rounded to a readable width.
    raw = max(span_s / 60.0, 0.1)
    for width in (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600):
        if width >= raw:
            return float(width)
    return 3600.0


def plot_log(
    read: LogRead,
    out: Path,
    *,
    bin_seconds: float | None = None,
    since: float | None = None,
    until: float | None = None,
    clock: Clock = "utc",
) -> dict[str, float]:
    """Write the figure to `out` (the format follows the suffix), over the window
    [since, until] (Unix seconds; default: the whole log); returns what it plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    stamps: list[float] = [float(r["ts_unix_ms"]) / 1000.0 for r in read.records]
    if not stamps:
        raise ValueError("no records to plot")
    first, last = min(stamps), max(stamps)
    if since is not None and since > last:
        raise ValueError(f"no records after {_moment(since)} (the log ends at {_moment(last)})")
    if until is not None and until < first:
        raise ValueError(f"no records before {_moment(until)} (the log begins at {_moment(first)})")
    t0 = first if since is None else since
    t1 = last if until is None else until
    if t1 <= t0:
        raise ValueError("the window ends before it begins")
    if not any(t0 <= t <= t1 for t in stamps):
        raise ValueError(f"no records between {_moment(t0)} and {_moment(t1)}")
    # The requests whose lives overlap the window: one running across its start counts.
    spans = [s for s in request_spans(read.records) if _begin(s) <= t1 and s.end >= t0]
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

    def inside(t: float) -> bool:
        return t0 <= t <= t1

    for s in spans:
        _account(s, running, waiting)
        if s.admitted_at is not None and inside(s.admitted_at):
            admitted[slot(s.admitted_at)] += 1
        if s.outcome == "rejected" and inside(s.end):
            rejected[slot(s.end)] += 1
        if s.outcome == "done" and s.total_s is not None and inside(s.end):
            totals[slot(s.end)].append(s.total_s)
            if s.ttft_s is not None:
                ttfts[slot(s.end)].append(s.ttft_s)

    fig, (ax_level, ax_rate, ax_lat) = plt.subplots(
        3, 1, figsize=(10, 8.5), sharex=True, constrained_layout=True
    )
    for events, label in ((running, "running"), (waiting, "waiting")):
        xs, ys = _level(events, t0, t1)
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
    if clock == "utc":  # x stays seconds after t0; only the tick labels are clock times
        ax_lat.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _clock(t0 + x, t1 - t0)))
        ax_lat.set_xlabel(_clock_label(t0, t1))
    else:
        origin = "the first record" if since is None else _moment(t0)
        ax_lat.set_xlabel(f"seconds since {origin}")
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
        "since": t0,
        "until": t1,
        "peak_running": float(max(_level(running, t0, t1)[1])),
        "peak_waiting": float(max(_level(waiting, t0, t1)[1])),
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
