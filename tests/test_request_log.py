"""The request-log schema shipped in the package: valid itself, and it refuses bad lines."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import jsonschema
import orjson
import pytest

from ninfer._requestlog import SCHEMA, SCHEMA_VERSION, RequestLog


def _validator() -> jsonschema.Draft202012Validator:
    raw = importlib.resources.files("ninfer").joinpath("request_log.schema.json").read_bytes()
    schema = orjson.loads(raw)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_written_lines_validate_and_bad_ones_do_not(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = RequestLog(str(path))
    log.emit(
        "request_cancelled", "r1", endpoint="/v1/generate", stage="queued", elapsed_seconds=0.5
    )
    log.emit("server_stop")
    log.close()
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    v = _validator()
    assert [list(v.iter_errors(rec)) for rec in lines] == [[], []]
    assert lines[0]["schema"] == SCHEMA
    assert lines[0]["schema_version"] == SCHEMA_VERSION
    bad = dict(lines[0], stage="teleported")
    assert list(v.iter_errors(bad))
    missing = {k: val for k, val in lines[0].items() if k != "server_instance_id"}
    assert list(v.iter_errors(missing))


@pytest.mark.parametrize("extra", [{"new_field": 1}, {"another": {"nested": True}}])
def test_new_fields_are_allowed_within_the_major_version(extra: dict[str, object]) -> None:
    record = {
        "schema": SCHEMA, "schema_version": 1, "event": "server_stop", "ts_unix_ms": 1.0,
        "server_instance_id": "x", "request_id": None, **extra,
    }  # fmt: skip
    assert not list(_validator().iter_errors(record))


async def test_an_engine_traceback_reaches_the_console_and_the_log(
    tiny_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Engine diagnostics go through the one logging system: the traceback of a request
    that fails inside the engine is a console line and a `diagnostic` record (with the
    request id) in the JSONL log, while the client gets a clean 500 without it."""
    from conftest import FAILING_SEED, plant_sampling_failure
    from server import serve_model

    plant_sampling_failure(monkeypatch, "planted failure")
    async with serve_model(tiny_gguf, tmp_path) as srv, srv.client() as c:
        r = await c.post(
            "/v1/generate",
            json={"prompt": "x", "temperature": 1.0, "seed": FAILING_SEED},
            headers={"x-request-id": "doomed"},
        )
        assert r.status_code == 500
        assert "planted" not in r.text
    # Other diagnostics may come first (what start-up decided on this CPU): this one is
    # the request's.
    (diag,) = [
        rec
        for rec in srv.log_records()
        if rec["event"] == "diagnostic" and rec["message"] == "engine_request_failed"
    ]
    assert (diag["level"], diag["message"], diag["request_id"]) == (
        "error",
        "engine_request_failed",
        "doomed",
    )
    assert "RuntimeError: planted failure" in diag["exception"]
    err = capfd.readouterr().err
    assert "engine_request_failed" in err
    assert "RuntimeError: planted failure" in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_log_that_cannot_be_written_fails_loudly_once_and_boundedly() -> None:
    """/dev/full opens but refuses every write: the failure is said once on the console,
    records are dropped and counted (memory stays bounded), and close() returns."""
    import io

    from ninfer._requestlog import MAX_QUEUED

    console = io.StringIO()
    log = RequestLog("/dev/full", console=console)
    for i in range(3 * MAX_QUEUED):
        log.emit("request_cancelled", f"r{i}", endpoint="/v1/generate", stage="queued",
                 elapsed_seconds=0.1)  # fmt: skip
        assert log._q.qsize() <= MAX_QUEUED
    log.emit("server_stop")
    log.close()
    assert log.failure is not None
    assert "No space left" in log.failure
    assert log.dropped == 3 * MAX_QUEUED + 1  # every record: none could be written
    assert console.getvalue().count("request_log_failed") == 1


def test_a_restart_after_a_crash_mid_line_starts_on_a_new_line(tmp_path: Path) -> None:
    from ninfer.tools._logtools import read_logs

    path = tmp_path / "log.jsonl"
    log = RequestLog(str(path))
    log.emit("server_stop")
    log.close()
    with path.open("ab") as f:
        f.write(b'{"schema": "ninfer.request_log", "event": "request_st')  # the crash
    log = RequestLog(str(path))
    log.emit("server_stop")
    log.close()
    lines = path.read_bytes().splitlines()
    assert len(lines) == 3
    assert [orjson.loads(lines[i])["event"] for i in (0, 2)] == ["server_stop", "server_stop"]
    read = read_logs([str(path)])
    assert len(read.records) == 2
    assert [p.line for p in read.problems] == [2]


def test_written_waits_for_the_records_emitted_before_it(tmp_path: Path) -> None:
    """`written` returns once the writer thread has written every record emitted before
    the call, and not before: with the file's writes held, it times out; let go, every
    record is in the file when it returns."""
    import threading

    path = tmp_path / "log.jsonl"
    log = RequestLog(str(path))
    gate = threading.Event()
    assert log._file is not None
    real_write = log._file.write

    def held(data: bytes) -> int:
        assert gate.wait(60), "the gate was never opened"
        return real_write(data)

    log._file.write = held  # type: ignore[method-assign]
    for i in range(3):
        log.emit("request_cancelled", f"r{i}", endpoint="/v1/generate", stage="queued",
                 elapsed_seconds=0.1)  # fmt: skip
    assert not log.written(0.05)  # the writer is held at the first record
    gate.set()
    assert log.written(60)
    assert [orjson.loads(line)["request_id"] for line in path.read_bytes().splitlines()] == [
        "r0",
        "r1",
        "r2",
    ]
    log.close()
