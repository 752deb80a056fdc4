"""The `ninfer probe` and `ninfer bench` commands, run as a user would, against a server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import trio
from server import serve


async def _ninfer(*args: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(300):
        return await trio.run_process(
            [sys.executable, "-m", "ninfer", *args], capture_stdout=True, capture_stderr=True,
            check=False,
        )  # fmt: skip


async def test_probe_and_bench_commands(tiny_gguf: Path, tmp_path: Path) -> None:
    async with serve(tiny_gguf, tmp_path, api_key="cli-key") as srv:
        probe = await _ninfer("probe", srv.url, "--api-key", "cli-key", "--only", "native:")
        assert probe.returncode == 0, probe.stderr.decode()[-2000:]
        assert b"probes passed" in probe.stderr
        refused = await _ninfer("probe", srv.url, "--only", "native:")  # no key: cannot list
        assert refused.returncode == 2
        assert b"is --api-key needed?" in refused.stderr
        out = tmp_path / "bench.json"
        bench = await _ninfer(
            "bench", srv.url, "--api-key", "cli-key", "--clients", "2", "--duration-s", "0.5",
            "--max-tokens", "4", "--warmup-s", "0", "--json", str(out),
        )  # fmt: skip
        assert bench.returncode == 0, bench.stderr.decode()[-2000:] + bench.stdout.decode()
        assert b"requests failed" not in bench.stderr
        wrong = await _ninfer(
            "bench", srv.url, "--api-key", "wrong", "--model", "any", "--clients", "1",
            "--duration-s", "0.2", "--max-tokens", "4", "--warmup-s", "0",
        )  # fmt: skip
        assert wrong.returncode == 1
        assert b"requests failed at closed 1: " in wrong.stderr
        assert b" x HTTP 401" in wrong.stderr
    assert b"tok/s" in bench.stdout
    # stderr is a pipe here: the plan at once, a line as the level begins and as it
    # ends, no carriage returns
    assert b"\r" not in bench.stderr
    first, begins, ends = bench.stderr.decode().splitlines()[:3]
    assert first.startswith(f"ninfer bench: {srv.url} (chat), 1 level of 0.5 s, at most "), first
    assert begins == "[1/1] closed 2: running for 0.5 s (+ up to 5 s to finish)"
    assert ends.startswith("[1/1] closed 2: "), ends
    assert " requests done in " in ends, ends
    levels = orjson.loads(out.read_bytes())["levels"]
    assert levels[0]["ok"] > 0
    assert levels[0]["completion_tokens"] == 4 * levels[0]["ok"]


def test_serve_on_a_port_in_use_says_so_in_one_line_before_loading(tiny_gguf: Path) -> None:
    """One line and exit 1, before the model is fetched or loaded (v0.1 loaded the whole
    model, then printed a 40-line exception group)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "ninfer", "serve", "--model", str(tiny_gguf),
             "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"ninfer serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


def test_hypercorn_on_a_port_in_use_fails_before_ninfer_is_imported(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """The README's hypercorn command on a busy port: Hypercorn binds before it imports
    the app, so the error is Hypercorn's (docs/serving.md says so, and that `ninfer
    serve` says it in one line); nothing of ninfer runs, no model is loaded."""
    import os
    import socket

    hypercorn = Path(sys.executable).parent / "hypercorn"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [str(hypercorn), "--worker-class", "trio", "--bind", f"127.0.0.1:{port}",
             "ninfer.app:create_app()"],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "NINFER_MODEL": str(tiny_gguf),
                 "NINFER_REQUEST_LOG_JSONL": str(tmp_path / "requests.jsonl")},
        )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == "OSError: [Errno 98] Address already in use"
    assert not (tmp_path / "requests.jsonl").exists()  # the app was never built
    assert done.stdout == ""


def test_bench_with_nothing_listening_says_so_in_one_line() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listened
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        done = subprocess.run(
            [sys.executable, "-m", "ninfer", "bench", url, "--clients", "1",
             "--duration-s", "1"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2
    plan, line = done.stderr.splitlines()  # what it set out to do, then why it could not
    assert plan.startswith(f"ninfer bench: {url} (chat), 1 level of 1 s")
    assert line.startswith(f"ninfer bench: error: cannot reach {url}: nothing answers there")


def test_serve_with_a_file_that_is_not_gguf_says_so_in_one_line(tmp_path: Path) -> None:
    bogus = tmp_path / "model.bin"
    bogus.write_bytes(b"PK\x03\x04 not a model")
    done = subprocess.run(
        [sys.executable, "-m", "ninfer", "serve", "--model", str(bogus), "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("ninfer serve: error: --model")
    assert "is not a GGUF file" in line


def test_a_bad_setting_under_hypercorn_is_one_line() -> None:
    """Under `hypercorn 'ninfer.app:create_app()'` a refused NINFER_* value is one line,
    not a traceback; with --workers 0 the exit status says so too (Hypercorn 0.17 loses
    a spawned worker's exit status: docs/serving.md)."""
    import os

    hypercorn = Path(sys.executable).parent / "hypercorn"
    done = subprocess.run(
        [str(hypercorn), "--workers", "0", "--worker-class", "trio", "--bind", "127.0.0.1:0",
         "ninfer.app:create_app()"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "NINFER_MAX_CONCURRENCY": "abc"},
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["ninfer: error: NINFER_MAX_CONCURRENCY must be an integer"]


async def test_the_hypercorn_command_serves_and_logs_no_address_of_its_own(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """The README's `hypercorn` launch serves; its server_start record has no host and
    port of ninfer's (Hypercorn's --bind decides them, not NINFER_PORT)."""
    import os
    import signal

    import httpx

    log = tmp_path / "requests.jsonl"
    env = {**os.environ, "NINFER_MODEL": str(tiny_gguf), "NINFER_REQUEST_LOG_JSONL": str(log),
           "NINFER_THREADS": "1", "NINFER_PORT": "8080"}  # fmt: skip
    hypercorn = Path(sys.executable).parent / "hypercorn"
    cmd = [str(hypercorn), "--worker-class", "trio", "--bind", "127.0.0.1:0",
           "ninfer.app:create_app()"]  # fmt: skip
    with trio.fail_after(120):
        proc = await trio.lowlevel.open_process(cmd, env=env, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        console = b""
        while b"Running on http://" not in console:
            chunk = await proc.stderr.receive_some()
            assert chunk, console.decode(errors="replace")
            console += chunk
        url = console.decode().split("Running on ")[1].split()[0]
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            # Polling another process over HTTP: there is no event to wait on.
            while (await c.get("/ready")).status_code != 200:  # noqa: ASYNC110
                await trio.sleep(0.05)
            r = await c.post("/v1/generate", json={"prompt": "x", "max_new_tokens": 2})
            assert r.status_code == 200
        # To Hypercorn's parent process only, as Kubernetes signals a container's first
        # process: it tells its worker to shut down gracefully.
        proc.send_signal(signal.SIGTERM)
        while chunk := await proc.stderr.receive_some():
            console += chunk
        assert await proc.wait() == 0, console.decode(errors="replace")[-3000:]
    records = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    events = [rec["event"] for rec in records]
    (start,) = [rec for rec in records if rec["event"] == "server_start"]
    assert (start["config"]["host"], start["config"]["port"]) == (None, None)
    assert events[-1] == "server_stop"  # the worker drained and closed the log
