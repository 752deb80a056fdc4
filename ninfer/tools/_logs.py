"""`ninfer logs`: its parser and its two commands, over `_logtools` (reading and
summarizing request logs) and `_logplot` (the figure; matplotlib, imported only when
`plot` runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ninfer.tools._args import positive_float
from ninfer.tools._logtools import read_logs, render_table, summarize

__all__ = ["add_command"]


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    logs = sub.add_parser(
        "logs",
        help="read request logs (--request-log-jsonl): summarize, plot",
        description="Read one or more request-log files (JSONL, schema ninfer.request_log "
        "v1). A line that cannot be read is reported with its file and line number on "
        "stderr and skipped; a file still being written is read up to its last full line.",
    )
    verbs = logs.add_subparsers(dest="logs_command", required=True)
    summ = verbs.add_parser(
        "summarize",
        help="counts and latency percentiles per endpoint and outcome",
        description="Per endpoint and outcome (done, rejected, cancelled, error): counts "
        "and p50/p95/p99 of queue time, time to first token, total time and output tokens "
        "per second (tokens after the first over the time after the first); rejections by "
        "status and type; cancellations by stage; the time span covered.",
    )
    summ.add_argument("files", nargs="+", metavar="FILE", help="request-log files")
    summ.add_argument("--json", action="store_true", help="print the summary as JSON")
    summ.set_defaults(func=_summarize_command)
    plot = verbs.add_parser(
        "plot",
        help="one figure over time: running/waiting, admitted/rejected, latency",
        description="Draw requests running and waiting, admitted and rejected per "
        "second, and p50/p95 latency over time in one figure, over the whole log or a "
        "window of it, against the wall clock (UTC) or seconds (needs matplotlib: "
        "pip install 'ninfer[plot]').",
    )
    plot.add_argument("files", nargs="+", metavar="FILE", help="request-log files")
    plot.add_argument("-o", "--output", required=True, help="the image to write (.png, .svg, .pdf)")
    plot.add_argument(
        "--bin-seconds",
        type=positive_float,
        default=None,
        help="width of the rate and latency bins (default: about 60 bins over the span)",
    )
    for edge, what in (("since", "begins"), ("until", "ends")):
        plot.add_argument(
            f"--{edge}",
            default=None,
            metavar="WHEN",
            help=f"the window {what} here: seconds after the log's first record (e.g. 30), "
            "or an ISO 8601 time (2026-12-02T14:03:00Z; UTC without an offset) "
            f"(default: the log's {'first' if edge == 'since' else 'last'} record)",
        )
    plot.add_argument(
        "--clock",
        choices=["utc", "relative"],
        default="utc",
        help="the time axis: utc, the wall clock (default), or relative, seconds since "
        "the window's start",
    )
    plot.set_defaults(func=_plot_command)


def _summarize_command(args: argparse.Namespace) -> int:
    try:
        read = read_logs(args.files)
    except OSError as exc:
        print(f"ninfer logs summarize: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    for problem in read.problems:
        print(problem, file=sys.stderr)
    summary = summarize(read)
    if args.json:
        import orjson

        sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(render_table(summary))
    return 0


def _plot_command(args: argparse.Namespace) -> int:
    try:
        from ninfer.tools._logplot import plot_log, resolve_moment
    except ImportError:  # pragma: no cover - depends on the install
        print(
            "ninfer logs plot: error: matplotlib is not installed (pip install 'ninfer[plot]')",
            file=sys.stderr,
        )
        return 2
    try:
        read = read_logs(args.files)
    except OSError as exc:
        print(f"ninfer logs plot: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    for problem in read.problems:
        print(problem, file=sys.stderr)
    try:
        first = min((r["ts_unix_ms"] / 1000.0 for r in read.records), default=0.0)
        since = None if args.since is None else resolve_moment(args.since, first)
        until = None if args.until is None else resolve_moment(args.until, first)
        shown = plot_log(
            read, Path(args.output), bin_seconds=args.bin_seconds, since=since, until=until,
            clock=args.clock,
        )  # fmt: skip
    except ValueError as exc:
        print(f"ninfer logs plot: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"{args.output}: {int(shown['requests'])} requests over {shown['seconds']:.1f} s "
        f"({shown['bin_seconds']:g} s bins)"
    )
    return 0
