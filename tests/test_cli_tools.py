"""The `ninfer probe` and `ninfer bench` commands, run as a user would, against a server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
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


def readme_hypercorn(bind: str = "127.0.0.1:0", app: str = "ninfer.app:create_app()") -> list[str]:
    """The README's `hypercorn` launch command as an argv (the venv's hypercorn, `bind`
    for its address, `app` for its application)."""
    import shlex

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if x.startswith("hypercorn ")]
    argv = shlex.split(line)
    argv[0] = str(Path(sys.executable).parent / "hypercorn")
    argv[argv.index("--bind") + 1] = bind
    assert argv[-1] == "ninfer.app:create_app()"
    return [*argv[:-1], app]


def test_hypercorn_on_a_port_in_use_fails_before_a_worker_starts(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """The README's hypercorn command on a busy port: Hypercorn's run() binds before it
    spawns the worker, so the error is Hypercorn's (docs/serving.md says so, and that
    `ninfer serve` says it in one line); no app is built, no model is loaded."""
    import os
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            readme_hypercorn(f"127.0.0.1:{port}"),
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


@pytest.mark.parametrize(
    ("variables", "line"),
    [
        ({"NINFER_MAX_CONCURRENCY": "abc"}, "NINFER_MAX_CONCURRENCY must be an integer"),
        ({"NINFER_MAX_CONCURENCY": "4"}, "unknown environment variable NINFER_MAX_CONCURENCY"),
        ({"NINFER_DEVICE": "gpu"}, "NINFER_DEVICE must be one of"),
        ({"NINFER_CONFIG": "/nonexistent/ninfer.toml"}, "NINFER_CONFIG"),
        ({"NINFER_MODEL": "/nonexistent/model.gguf"}, "--model '/nonexistent/model.gguf'"),
        ({"NINFER_MODEL": "NOT_GGUF"}, "is not a GGUF file"),
    ],
)
def test_a_bad_setting_fails_the_readme_hypercorn_command(
    variables: dict[str, str], line: str, tmp_path: Path
) -> None:
    """The README's hypercorn command (one spawned worker, Hypercorn's default) with a
    bad setting or model: one line from Hypercorn's own process, before any worker,
    and exit status 2, as a supervisor must see it (without ninfer's config, Hypercorn
    0.18 exits 0: docs/serving.md)."""
    import os

    if variables.get("NINFER_MODEL") == "NOT_GGUF":
        bogus = tmp_path / "model.gguf"
        bogus.write_bytes(b"PK\x03\x04 not a model")
        variables = {"NINFER_MODEL": str(bogus)}
    done = subprocess.run(
        readme_hypercorn(), capture_output=True, text=True, timeout=120,
        env={**os.environ, **variables},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    (said,) = done.stderr.splitlines()
    assert said.startswith("ninfer: error: ")
    assert line in said


def test_a_worker_that_fails_at_start_fails_the_readme_hypercorn_command() -> None:
    """A worker that cannot start (here: an app that cannot be imported) ends the
    README's hypercorn command with a failing exit status: ninfer's config keeps the
    worker's status, which Hypercorn 0.18's run() drops; without it, exit 0."""
    done = subprocess.run(
        readme_hypercorn(app="ninfer.no_such_module:create_app()"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "NoAppError" in done.stderr
    assert done.returncode == 1
    plain = [str(Path(sys.executable).parent / "hypercorn"), "--worker-class", "trio",
             "--bind", "127.0.0.1:0", "ninfer.no_such_module:create_app()"]  # fmt: skip
    lost = subprocess.run(plain, capture_output=True, text=True, timeout=120)
    assert "NoAppError" in lost.stderr
    assert lost.returncode == 0  # Hypercorn's own loss, the reason for the config


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
    cmd = readme_hypercorn()
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
