"""Reading the request log back: `ninfer logs summarize/plot`, and ingestion by DuckDB and
pandas, on a log that a real server wrote under overload."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from server import serve

from ninfer._cli import main
from ninfer.tools._logtools import percentile, read_logs, request_spans, summarize

GEN = "/v1/generate"
CHAT = "/v1/chat/completions"


async def _overload(model: Path, tmp_path: Path) -> tuple[Path, Counter[int]]:
    """A small server and 3x more clients than it can hold, plus a 422 and a cancellation."""
    seen: Counter[int] = Counter()
    async with (
        serve(
            model, tmp_path, max_concurrency=2, max_pending_requests=4, pending_timeout_ms=300
        ) as srv,
        srv.client(limits=httpx.Limits(max_connections=64)) as c,
    ):
        # The refused clients never come back and ask for no promise: a place held for
        # them would hold up the requests below until it lapsed (docs/scheduler.md).
        once = {"x-ninfer-no-promise": "1"}

        async def one(i: int) -> None:
            if i % 2:
                r = await c.post(
                    GEN,
                    json={"prompt": "x", "max_new_tokens": 24, "ignore_eos": True},
                    headers=once,
                )
            else:
                r = await c.post(
                    CHAT,
                    json={
                        "model": srv.app.lifespan.public_id,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 24,
                    },
                    headers=once,
                )
            seen[r.status_code] += 1

        async with trio.open_nursery() as n:
            for i in range(18):
                n.start_soon(one, i)
        sched = srv.app.lifespan.scheduler
        assert sched is not None
        assert sched.statistics().promised == 0
        # Which of the burst were admitted is the scheduler's race (on one core all six
        # were chat requests once): one /v1/generate that completes, asked alone.
        done = await c.post(GEN, json={"prompt": "x", "max_new_tokens": 24, "ignore_eos": True})
        assert done.status_code == 200, done.text
        seen[done.status_code] += 1
        seen[(await c.post(GEN, json={"prompt": "x", "temperature": -1})).status_code] += 1
        async with c.stream(
            "POST", GEN, json={"prompt": "x", "max_new_tokens": 400, "stream": True}
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
        sched = srv.app.lifespan.scheduler
        assert sched is not None
        while sched.statistics().in_system:
            await trio.lowlevel.checkpoint()
    return srv.log_path, seen


@pytest.fixture(scope="module")
def overload_log(
    tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Counter[int]]:
    return trio.run(_overload, tiny_gguf, tmp_path_factory.mktemp("overload"))


def test_summary_counts_match_the_clients(overload_log: tuple[Path, Counter[int]]) -> None:
    path, seen = overload_log
    read = read_logs([path])
    assert read.problems == []
    assert read.partial_lines == 0
    s = summarize(read)
    by = {(row["endpoint"], row["outcome"]): row for row in s["by_endpoint_outcome"]}
    done = sum(row["count"] for (_, outcome), row in by.items() if outcome == "done")
    assert done == seen[200]
    rejected = {(r["status"], r["type"]): r["count"] for r in s["rejections"]}
    assert rejected.get((429, "server_overloaded"), 0) == seen[429]
    assert rejected.get((503, "request_queue_timeout"), 0) == seen[503]
    assert rejected[(422, "invalid_request")] == 1
    assert s["cancellations"] == {"decode": 1} or s["cancellations"] == {"prefill": 1}
    assert s["requests"] == sum(seen.values()) + 1  # plus the cancelled stream
    row = by[(GEN, "done")]
    assert 0 < row["ttft_s"]["p50"] <= row["total_s"]["p50"] <= row["total_s"]["p99"]
    assert row["output_tokens_per_s"]["p50"] > 0
    assert s["span"]["seconds"] > 0
    assert s["servers"] == 1


def test_cli_table_json_and_plot(
    overload_log: tuple[Path, Counter[int]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, seen = overload_log
    assert main(["logs", "summarize", str(path)]) == 0
    table = capsys.readouterr().out
    assert "ttft ms" in table
    assert "(each: p50/p95/p99)" in table
    assert ("server_overloaded" in table) == (seen[429] > 0)
    assert main(["logs", "summarize", "--json", str(path)]) == 0
    as_json = orjson.loads(capsys.readouterr().out)
    assert as_json["requests"] == sum(seen.values()) + 1
    out = tmp_path / "run.png"
    assert main(["logs", "plot", str(path), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"{sum(seen.values()) + 1} requests" in capsys.readouterr().out


def test_the_table_is_as_wide_whatever_its_figures() -> None:
    """The summary's layout rule holds for any figure: each number takes at most four
    characters (k/M/G/T past 999) and the figure columns a fixed width, so a table's
    width depends on its routes' and outcomes' names and its counts alone: the same for
    a quiet run's figures and for one whose every figure is enormous, and within a
    terminal's 100 columns for the longest generation route (/v1/chat/completions)."""
    from ninfer.tools._logtools import _short, render_table

    def summary(figure: float) -> dict[str, Any]:
        stats = {"p50": figure, "p95": figure * 3.3, "p99": figure * 9.9}
        return {
            "span": {"seconds": 1.0}, "records": 1, "files": ["a.jsonl"], "servers": 1,
            "requests": 1, "finish_reasons": {}, "rejections": [], "cancellations": {},
            "bad_lines": [], "partial_lines": 0,
            "by_endpoint_outcome": [
                {"endpoint": endpoint, "outcome": "cancelled", "count": 99999, "queue_s": stats,
                 "ttft_s": stats, "total_s": stats, "output_tokens_per_s": stats}
                for endpoint in ("/v1/chat/completions", "/v1/generate")
            ],
        }  # fmt: skip

    widths: dict[float, list[int]] = {}
    for figure in (0.0123, 1.5, 99.96, 1e3, 123_456.7, 9.9e12):
        table = render_table(summary(figure)).splitlines()
        widths[figure] = [len(line) for line in table]
    assert len(set(map(tuple, widths.values()))) == 1, widths
    assert max(widths[1.5]) <= 100  # a terminal's width
    values = (0.04, 9.96, 12.46, 138.2, 999.4, 999.6, 15_049.0, 138_000.0, 1.2e6)
    assert [_short(v) for v in values] == [
        "0.0", "10", "12", "138", "999", "1.0k", "15k", "138k", "1.2M",
    ]  # fmt: skip
    assert all(len(_short(v)) <= 4 for v in (1e-9, 9.949, 9999.0, 5e14, 7.77e17, float("inf")))


def test_plot_takes_a_window_and_a_wall_clock_axis(
    overload_log: tuple[Path, Counter[int]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--since/--until` (seconds after the first record, or ISO 8601 times) cut the
    figure to a window, counting the requests that overlap it; the time axis is the
    wall clock in UTC unless `--clock relative`."""
    import datetime as dt

    import matplotlib

    from ninfer.tools._logplot import plot_log, resolve_moment

    path, _ = overload_log
    read = read_logs([path])
    stamps = sorted(r["ts_unix_ms"] / 1000.0 for r in read.records)
    first, last = stamps[0], stamps[-1]
    whole = plot_log(read, tmp_path / "whole.png")
    assert (whole["since"], whole["until"]) == (first, last)
    half = (last - first) / 2
    early = plot_log(read, tmp_path / "early.png", since=first, until=first + half)
    # (first + half) - first in float64 Unix seconds is half to within their resolution
    # near 1.7e9 (2.4e-7 s), not to a relative 1e-6 of a window a tenth of a second long
    assert early["seconds"] == pytest.approx(half, abs=1e-6)
    spans = request_spans(read.records)
    begun = sum(1 for s in spans if min(t for t in (s.waiting_from, s.admitted_at, s.end)
                                        if t is not None) <= first + half)  # fmt: skip
    assert early["requests"] == begun < whole["requests"]

    # The wall clock: the axis says the day and the first tick the time of day (UTC).
    matplotlib.rcParams["svg.fonttype"] = "none"  # text kept as text, to be read here
    try:
        plot_log(read, tmp_path / "clock.svg")
        plot_log(read, tmp_path / "relative.svg", clock="relative")
    finally:
        matplotlib.rcParams["svg.fonttype"] = "path"
    day = dt.datetime.fromtimestamp(first, dt.UTC).date().isoformat()
    svg = (tmp_path / "clock.svg").read_text()
    assert f"time (UTC, {day})" in svg
    hhmm = dt.datetime.fromtimestamp(first, dt.UTC).strftime("%H:%M:")
    assert hhmm in svg
    assert "seconds since the first record" in (tmp_path / "relative.svg").read_text()

    # The command line: both spellings of a moment, and what it refuses in one line.
    iso = dt.datetime.fromtimestamp(first + half, dt.UTC).isoformat().replace("+00:00", "Z")
    assert resolve_moment(iso, first) == pytest.approx(first + half)
    assert resolve_moment("2.5", first) == first + 2.5
    out = tmp_path / "window.png"
    assert main(["logs", "plot", str(path), "-o", str(out), "--until", iso]) == 0
    assert f"{int(begun)} requests over {half:.1f} s" in capsys.readouterr().out
    assert main(["logs", "plot", str(path), "-o", str(out), "--since", "3600"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith("ninfer logs plot: error: no records after ")
    assert main(["logs", "plot", str(path), "-o", str(out), "--since", "noon"]) == 1
    (err,) = capsys.readouterr().err.splitlines()
    assert "'noon' is neither seconds after the first record nor an ISO 8601 time" in err


def test_running_never_exceeds_capacity(overload_log: tuple[Path, Counter[int]]) -> None:
    """The reconstructed levels respect the limits the server ran with (2 running, 4 waiting),
    up to the log's clock resolution at the instants one request leaves as another enters."""
    path, _ = overload_log
    spans = request_spans(read_logs([path]).records)
    events: list[tuple[float, int]] = []
    for s in spans:
        if s.admitted_at is not None:
            events += [(s.admitted_at, 1), (s.end, -1)]
    level = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        level += delta
        peak = max(peak, level)
    assert 1 <= peak <= 2


def test_bad_and_partial_lines_are_reported_not_fatal(
    overload_log: tuple[Path, Counter[int]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, seen = overload_log
    good = path.read_bytes().splitlines(keepends=True)
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(
        good[0]
        + b"{not json\n"
        + b"[1, 2]\n"
        + b'{"schema": "other"}\n'
        + b"".join(good[1:])
        + b'{"schema": "ninfer.request_log", "schema_versi'  # still being written
    )
    assert main(["logs", "summarize", "--json", str(broken), str(path)]) == 0
    captured = capsys.readouterr()
    assert f"{broken}:2: not JSON" in captured.err
    assert f"{broken}:3: not a JSON object" in captured.err
    assert f"{broken}:4: not a ninfer request-log record" in captured.err
    summary = orjson.loads(captured.out)
    assert [b["line"] for b in summary["bad_lines"]] == [2, 3, 4]
    assert summary["partial_lines"] == 1
    # The same requests twice (two files): counts double.
    assert summary["requests"] == 2 * (sum(seen.values()) + 1)


def test_missing_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", "summarize", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=50), st.sampled_from([0, 50, 95, 99, 100]))
def test_percentile_matches_numpy(values: list[float], p: int) -> None:
    values.sort()
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-9)


def test_duckdb_reads_the_log(overload_log: tuple[Path, Counter[int]]) -> None:
    import duckdb

    path, seen = overload_log
    con = duckdb.connect()
    rel = con.sql(f"SELECT * FROM read_ndjson('{path}', union_by_name = true)")
    types = dict(zip(rel.columns, [str(t) for t in rel.types], strict=True))
    assert types["ts_unix_ms"] == "DOUBLE"
    assert types["schema_version"] == "BIGINT"
    assert types["completion_tokens"] == "BIGINT"
    assert types["timings_seconds"].startswith("STRUCT(")
    [(n_done,)] = con.execute(
        f"SELECT count(*) FROM read_ndjson('{path}') WHERE event = 'request_done'"
    ).fetchall()
    assert n_done == seen[200]
    rows: Any = con.execute(
        f"""SELECT status, count(*) FROM read_ndjson('{path}', union_by_name = true)
            WHERE event = 'request_rejected' GROUP BY status ORDER BY status"""
    ).fetchall()
    assert dict(rows) == {k: v for k, v in seen.items() if k >= 400}
    [(p50,)] = con.execute(
        f"""SELECT quantile_cont(timings_seconds.ttft, 0.5)
            FROM read_ndjson('{path}') WHERE event = 'request_done'"""
    ).fetchall()
    assert p50 > 0


def test_pandas_reads_the_log(overload_log: tuple[Path, Counter[int]]) -> None:
    import pandas as pd

    path, seen = overload_log
    df = pd.read_json(path, lines=True)
    assert str(df["ts_unix_ms"].dtype) == "float64"
    assert (df["event"] == "request_done").sum() == seen[200]
    done = df[df["event"] == "request_done"]
    timings = pd.json_normalize(done["timings_seconds"].tolist())
    assert list(timings.columns) == ["prepare", "queue", "ttft", "prefill", "decode", "total"]
    assert (timings["total"] >= timings["ttft"]).all()
    rejected = df[df["event"] == "request_rejected"]
    assert rejected["status"].astype(int).value_counts().to_dict() == {
        k: v for k, v in seen.items() if k >= 400
    }


@pytest.mark.parametrize("script", ["log_duckdb.py", "log_pandas.py"])
def test_examples_run_on_a_real_log(overload_log: tuple[Path, Counter[int]], script: str) -> None:
    path, seen = overload_log
    example = Path(__file__).parent.parent / "examples" / script
    done = subprocess.run(
        [sys.executable, str(example), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "server_overloaded" in done.stdout or seen[429] == 0
    assert "/v1/generate" in done.stdout
    if script == "log_duckdb.py":  # each result under its column names
        assert "('endpoint', 'requests', 'queue_p50_ms', 'ttft_p50_ms'" in done.stdout
        assert "('status', 'type', 'requests')" in done.stdout


@pytest.mark.parametrize("script", ["log_duckdb.py", "log_pandas.py"])
@pytest.mark.parametrize(
    "lines",
    [
        [],  # an empty log
        # a server that started and stopped: no request at all
        [{"event": "server_stop", "request_id": None}],
        # refusals only: no request_done, no request_cancelled
        [{"event": "request_rejected", "request_id": "r1", "endpoint": "/v1/generate",
          "status": 429, "type": "server_overloaded", "code": None, "param": None,
          "phase": "route"}],
    ],
)  # fmt: skip
def test_examples_run_on_any_valid_log(
    tmp_path: Path, script: str, lines: list[dict[str, object]]
) -> None:
    """Readers of the log must not need an event a log happens not to have."""
    base = {"schema": "ninfer.request_log", "schema_version": 1, "ts_unix_ms": 1.0,
            "server_instance_id": "s"}  # fmt: skip
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"".join(orjson.dumps({**base, **line}) + b"\n" for line in lines))
    example = Path(__file__).parent.parent / "examples" / script
    done = subprocess.run(
        [sys.executable, str(example), str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
