"""`ninfer bench` against a real server: the counts it reports are the server's."""

from __future__ import annotations

from pathlib import Path

import pytest
from server import serve

from ninfer.tools._bench import (
    BenchConfig,
    check_loopback,
    plot_bench,
    render_table,
    run_bench,
    server_url,
)


@pytest.mark.parametrize("route", ["chat", "completions", "native"])
async def test_bench_closed_and_open_loop(tiny_gguf: Path, tmp_path: Path, route: str) -> None:
    async with serve(tiny_gguf, tmp_path, max_concurrency=2, max_pending_requests=2) as srv:
        cfg = BenchConfig(
            url=srv.url, route=route, clients=(1, 6), rates=(40.0,), duration_s=0.6,
            max_requests=60, max_tokens=8, warmup_s=0.2,
        )  # fmt: skip
        results = await run_bench(cfg, progress=False)
        done = [r for r in srv.log_records() if r["event"] == "request_done"]
    rows = [r.summary() for r in results]
    assert [(r["mode"], r["load"]) for r in rows] == [("closed", 1), ("closed", 6), ("open", 40)]
    for row in rows:
        assert row["failed"] == 0, row["errors"]
        assert row["ok"] > 0
        assert row["completion_tokens"] == 8 * row["ok"]
        assert row["ttft_p50"] is not None
        assert row["itl_p50"] is not None
    # Six clients on two slots and two queue places: some are refused at once.
    assert rows[1]["rejected_429"] > 0
    # Everything the bench counted as served, the server logged as done (plus warm-up).
    assert len(done) >= sum(r["ok"] for r in rows)
    assert "tok/s" in render_table(rows)
    plot_bench(rows, str(tmp_path / "bench.png"), "test")
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_stays_on_loopback_unless_asked() -> None:
    check_loopback("http://127.0.0.1:8080")
    with pytest.raises(ValueError, match="loopback"):
        check_loopback("http://10.0.0.5:8080")
    # `ninfer bench localhost:8080` said " is not a loopback address" (an empty host)
    assert server_url("localhost:8080") == "http://localhost:8080"
    assert server_url("http://127.0.0.1:8080/") == "http://127.0.0.1:8080"
    check_loopback(server_url("localhost:8080"))
    with pytest.raises(ValueError, match="names no host"):
        check_loopback("http://:8080")
