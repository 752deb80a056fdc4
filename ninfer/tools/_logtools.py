"""Reading request logs back: what `ninfer logs summarize` prints and the data behind
`ninfer logs plot` (the command itself is `_logs`).

Reads any number of JSONL files (several servers, rotated files), tolerates a file
that is still being written (an unterminated last line is left for the next read,
not reported) and reports every unreadable line by file and line number, skipping
it. Pure Python: no pandas needed to read your own logs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import orjson

__all__ = [
    "LogRead",
    "Problem",
    "RequestSpan",
    "percentile",
    "read_logs",
    "render_table",
    "request_spans",
    "summarize",
]

TERMINAL = ("request_done", "request_rejected", "request_cancelled", "request_error")
_OUTCOME = {
    "request_done": "done",
    "request_rejected": "rejected",
    "request_cancelled": "cancelled",
    "request_error": "error",
}
_PERCENTILES = (50, 95, 99)


@attrs.frozen
class Problem:
    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason} (skipped)"


@attrs.define
class LogRead:
    records: list[dict[str, Any]] = attrs.field(factory=list)
    problems: list[Problem] = attrs.field(factory=list)
    files: list[str] = attrs.field(factory=list)
    lines: int = 0
    partial_lines: int = 0  # unterminated last lines: a file still being written


def read_logs(paths: Iterable[str | Path]) -> LogRead:
    """Every record of every file, in file order; bad lines become `problems`."""
    out = LogRead()
    for path in paths:
        name = str(path)
        out.files.append(name)
        data = Path(path).read_bytes()
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        elif lines:
            lines.pop()  # no newline yet: the writer is mid-line
            out.partial_lines += 1
        for number, raw in enumerate(lines, 1):
            out.lines += 1
            if not raw.strip():
                continue
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                out.problems.append(Problem(name, number, f"not JSON ({exc.msg})"))
                continue
            reason = _invalid(record)
            if reason is not None:
                out.problems.append(Problem(name, number, reason))
                continue
            out.records.append(record)
    return out


def _invalid(record: object) -> str | None:
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("schema") != "ninfer.request_log":
        return "not a ninfer request-log record"
    if record.get("schema_version") != 1:
        return f"unsupported schema_version {record.get('schema_version')!r}"
    if not isinstance(record.get("event"), str):
        return "no event"
    if not isinstance(record.get("ts_unix_ms"), int | float):
        return "no ts_unix_ms"
    return None


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on sorted data."""
    if not values:
        return math.nan
    if len(values) == 1:
        return values[0]
    rank = (len(values) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (rank - lo)


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    values.sort()
    out = {f"p{p}": percentile(values, p) for p in _PERCENTILES}
    out["mean"] = sum(values) / len(values)
    return out


def _measures(record: dict[str, Any]) -> dict[str, float]:
    """queue_s, ttft_s, total_s, output_tokens_per_s where the record has them."""
    event = record["event"]
    out: dict[str, float] = {}
    if event == "request_done":
        t = record.get("timings_seconds") or {}
        out = {
            k: t[src]
            for k, src in (("queue_s", "queue"), ("ttft_s", "ttft"), ("total_s", "total"))
            if src in t
        }
        tokens = record.get("completion_tokens", 0)
        after_first = t.get("total", 0.0) - t.get("ttft", 0.0)
        if tokens > 1 and after_first > 0:
            out["output_tokens_per_s"] = (tokens - 1) / after_first
    else:
        if isinstance(record.get("elapsed_seconds"), int | float):
            out["total_s"] = record["elapsed_seconds"]
        if isinstance(record.get("queue_seconds"), int | float):
            out["queue_s"] = record["queue_seconds"]
    return out


def summarize(read: LogRead) -> dict[str, Any]:
    """The summary as plain data (what `--json` prints)."""
    records = read.records
    stamps = [r["ts_unix_ms"] for r in records]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    rejections: Counter[tuple[int, str]] = Counter()
    cancellations: Counter[str] = Counter()
    finish: Counter[str] = Counter()
    for r in records:
        event = r["event"]
        if event not in TERMINAL:
            continue
        groups.setdefault((str(r.get("endpoint")), _OUTCOME[event]), []).append(r)
        if event == "request_rejected":
            rejections[(int(r.get("status", 0)), str(r.get("type")))] += 1
        elif event == "request_cancelled":
            cancellations[str(r.get("stage"))] += 1
        elif event == "request_done":
            finish[str(r.get("finish_reason"))] += 1
    rows = []
    for (endpoint, outcome), members in sorted(groups.items()):
        columns: dict[str, list[float]] = {}
        for r in members:
            for key, value in _measures(r).items():
                columns.setdefault(key, []).append(float(value))
        rows.append(
            {
                "endpoint": endpoint,
                "outcome": outcome,
                "count": len(members),
                **{
                    key: _stats(columns.get(key, []))
                    for key in ("queue_s", "ttft_s", "total_s", "output_tokens_per_s")
                },
            }
        )
    first = min(stamps) if stamps else None
    last = max(stamps) if stamps else None
    return {
        "files": read.files,
        "lines": read.lines,
        "records": len(records),
        "bad_lines": [attrs.asdict(p) for p in read.problems],
        "partial_lines": read.partial_lines,
        "servers": len({r.get("server_instance_id") for r in records}),
        "span": {
            "first_unix_ms": first,
            "last_unix_ms": last,
            "seconds": (last - first) / 1000.0 if first is not None and last is not None else 0.0,
        },
        "requests": sum(len(m) for m in groups.values()),
        "by_endpoint_outcome": rows,
        "finish_reasons": dict(sorted(finish.items())),
        "rejections": [
            {"status": status, "type": kind, "count": n}
            for (status, kind), n in sorted(rejections.items())
        ],
        "cancellations": dict(sorted(cancellations.items())),
    }


def _short(value: float) -> str:
    """At most four characters and a sign, whatever the value: one decimal under 10,
    whole numbers to 999, then k, M, G, T, P, E (0.2, 9.9, 12, 138, 1.2k, 15k, 1.2M),
    so that the summary's width never grows with the figures it prints."""
    sign = "-" if value < 0 else ""
    a = abs(value)
    for suffix in ("", "k", "M", "G", "T", "P", "E"):
        if a < 9.95:
            return f"{sign}{a:.1f}{suffix}"
        if a < 999.5:
            return f"{sign}{a:.0f}{suffix}"
        a /= 1000.0
    return sign + ("nan" if a != a else "inf" if a == float("inf") else "huge")


# A cell of three figures (p50/p95/p99), each at most four characters: a fixed width.
FIGURES_CELL = 3 * 4 + 2


def _percentiles(stats: dict[str, float] | None, scale: float) -> str:
    """p50/p95/p99 in one cell."""
    if stats is None:
        return "-"
    return "/".join(_short(stats[p] * scale) for p in ("p50", "p95", "p99"))


def _grid(header: Sequence[str], rows: Sequence[Sequence[str]], figures: int = 0) -> list[str]:
    """Columns as wide as their widest cell, the first two left-aligned, the rest right;
    the last `figures` columns are FIGURES_CELL wide (one space between them)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    first_figure = len(header) - figures
    parts = []
    for i, w in enumerate(widths):
        gap = "" if i == 0 else " " if first_figure < i else "  "
        w = max(w, FIGURES_CELL) if i >= first_figure else w
        parts.append(gap + (f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}"))
    fmt = "".join(parts)
    return [fmt.format(*header), *(fmt.format(*r) for r in rows)]


def render_table(summary: dict[str, Any]) -> str:
    """The human-readable summary: times in milliseconds, rates in tokens per second."""
    span = summary["span"]
    lines = [
        f"{summary['records']} records from {len(summary['files'])} file(s), "
        f"{summary['servers']} server instance(s), spanning {span['seconds']:.1f} s; "
        f"{summary['requests']} requests",
    ]
    rows = []
    for row in summary["by_endpoint_outcome"]:
        q, ttft, total, rate = (
            row[k] for k in ("queue_s", "ttft_s", "total_s", "output_tokens_per_s")
        )
        rows.append(
            [
                row["endpoint"],
                row["outcome"],
                str(row["count"]),
                *(_percentiles(stats, scale) for stats, scale in
                  ((q, 1000.0), (ttft, 1000.0), (total, 1000.0), (rate, 1.0))),
            ]
        )  # fmt: skip
    if rows:
        header = ["endpoint", "outcome", "n", "queue ms", "ttft ms", "total ms", "out tok/s"]
        lines += ["", *_grid(header, rows, figures=4), "(each: p50/p95/p99)"]
    if summary["finish_reasons"]:
        lines += [
            "",
            "finish reasons: "
            + ", ".join(f"{k} {v}" for k, v in summary["finish_reasons"].items()),
        ]
    if summary["rejections"]:
        lines += [
            "",
            *_grid(
                ["rejected: status", "type", "n"],
                [[str(r["status"]), r["type"], str(r["count"])] for r in summary["rejections"]],
            ),
        ]
    if summary["cancellations"]:
        lines += [
            "",
            *_grid(
                ["cancelled: stage", "", "n"],
                [[k, "", str(v)] for k, v in summary["cancellations"].items()],
            ),
        ]
    if summary["bad_lines"]:
        lines += ["", f"{len(summary['bad_lines'])} unreadable line(s) skipped"]
    if summary["partial_lines"]:
        lines += [f"{summary['partial_lines']} file(s) end mid-line (still being written)"]
    return "\n".join(lines)


@attrs.frozen
class RequestSpan:
    """One request's life reconstructed from its records (Unix seconds)."""

    request_id: str
    endpoint: str
    outcome: str  # done | rejected | cancelled | error
    status: int | None  # for rejections
    waiting_from: float | None  # entered the admission queue (None: never queued)
    admitted_at: float | None  # got a slot (None: never admitted)
    end: float
    ttft_s: float | None
    total_s: float | None


def request_spans(records: Iterable[dict[str, Any]]) -> list[RequestSpan]:
    """Reconstruct when each request waited and ran, from its start and terminal records."""
    started: dict[str, float] = {}
    spans: list[RequestSpan] = []
    for r in records:
        event, rid = r["event"], r.get("request_id")
        ts = r["ts_unix_ms"] / 1000.0
        if event == "request_start" and isinstance(rid, str):
            started[rid] = ts
            continue
        if event not in TERMINAL or not isinstance(rid, str):
            continue
        begin = started.pop(rid, None)
        waiting_from = admitted = ttft = total = None
        status = None
        if event == "request_done":
            t = r.get("timings_seconds") or {}
            total = float(t.get("total", 0.0))
            arrival = ts - total
            waiting_from = arrival + float(t.get("prepare", 0.0))
            admitted = waiting_from + float(t.get("queue", 0.0))
            ttft = float(t.get("ttft", 0.0))
        elif event == "request_rejected":
            status = int(r.get("status", 0))
            waiting_from = begin if r.get("phase") == "queued" else None
            total = r.get("elapsed_seconds")
        elif event == "request_cancelled":
            waiting_from = begin
            queued = r.get("queue_seconds")
            if begin is not None and isinstance(queued, int | float):
                admitted = begin + queued
            total = r.get("elapsed_seconds")
        else:  # request_error: ran from its start (when it got that far)
            waiting_from = admitted = begin
        spans.append(
            RequestSpan(
                request_id=rid,
                endpoint=str(r.get("endpoint")),
                outcome=_OUTCOME[event],
                status=status,
                waiting_from=waiting_from,
                admitted_at=admitted,
                end=ts,
                ttft_s=ttft,
                total_s=total,
            )
        )
    return spans
