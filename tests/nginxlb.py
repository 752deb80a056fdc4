"""ninfer replicas behind Debian's nginx with the shipped deploy/nginx.conf, on loopback.

Used by tests/test_replicas.py and benchmarks/replicas.py. The shipped file is run as
it is, with only its upstream `server` lines, its `listen` port and its access log
path rewritten; nginx gets a main configuration of its own (pid, logs and temporary
files in a scratch folder), so nothing is installed or touched outside it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx

SHIPPED = Path(__file__).resolve().parent.parent / "deploy" / "nginx.conf"
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
READY_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@attrs.define
class Replica:
    port: int
    log: Path  # its request log
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@attrs.define
class Balanced:
    url: str  # nginx
    replicas: list[Replica]
    access_log: Path
    nginx: subprocess.Popen[bytes]

    def access(self) -> list[Access]:
        """nginx's access log, one entry per line (the `ninfer` log format)."""
        out = []
        for line in self.access_log.read_text().splitlines():
            m = _ACCESS.match(line)
            assert m is not None, line
            request, status, rid, upstreams, statuses = m.groups()
            out.append(
                Access(
                    request,
                    int(status),
                    rid,
                    re.split(r", | : ", upstreams) if upstreams != "-" else [],
                    re.split(r", | : ", statuses) if statuses != "-" else [],
                )
            )
        return out


@attrs.frozen
class Access:
    """One line of nginx's access log: every upstream attempt, in order."""

    request: str  # "POST /v1/chat/completions HTTP/1.1"
    status: int
    request_id: str
    upstreams: list[str]  # host:port of each attempt
    upstream_statuses: list[str]  # each attempt's status ("502": no answer)


_ACCESS = re.compile(
    r'^\S+ \[[^\]]*\] "(.*?)" (\d+) \d+ rid=(\S+) upstream=(.*?) '
    r"upstream_status=(.*?) rt=\S+$"
)


def render(shipped: str, listen: int, ports: list[int], access_log: Path) -> str:
    """The shipped configuration with this run's ports and log path."""
    servers = "".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=10s;\n" for p in ports)
    text = re.sub(
        r"(    server 127\.0\.0\.1:\d+ max_fails=1 fail_timeout=10s;\n)+", servers, shipped
    )
    text = re.sub(r"listen \d+;", f"listen 127.0.0.1:{listen};", text)
    text = text.replace("/var/log/nginx/ninfer.access.log", str(access_log))
    return text.replace("proxy_next_upstream_tries 2;", f"proxy_next_upstream_tries {len(ports)};")


def _main_conf(work: Path, site: Path) -> str:
    # As root, nginx's workers would run as nobody, who may not write to `work`.
    user = "user root;" if os.geteuid() == 0 else ""
    return f"""
{user}
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    client_body_temp_path {work}/client_body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    include {site};
}}
"""


def wait_ready(url: str, proc: subprocess.Popen[bytes], path: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with status {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        time.sleep(0.05)  # polling another process over HTTP: no event to wait on
    raise RuntimeError(f"{url} was not ready within {READY_TIMEOUT_S:.0f} s")


def start_replica(model: Path, work: Path, name: str, settings: dict[str, Any]) -> Replica:
    port = free_port()
    log = work / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "ninfer", "serve", "--model", str(model), "--port", str(port),
           "--request-log-jsonl", str(log), "--log-stats-interval-ms", "0"]  # fmt: skip
    for key, value in settings.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    out = (work / f"{name}.console").open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return Replica(port, log, proc)


@contextlib.contextmanager
def balanced(model: Path, work: Path, replicas: int = 2, **settings: Any) -> Iterator[Balanced]:
    """`replicas` ninfer processes and nginx before them, until the block ends."""
    assert NGINX is not None, "nginx is not installed"
    started = [start_replica(model, work, f"replica{i}", settings) for i in range(replicas)]
    nginx: subprocess.Popen[bytes] | None = None
    try:
        for r in started:
            wait_ready(r.url, r.proc, "/ready")
        listen = free_port()
        access_log = work / "access.log"
        site = work / "ninfer.conf"
        site.write_text(render(SHIPPED.read_text(), listen, [r.port for r in started],
                               access_log))  # fmt: skip
        main = work / "nginx.conf"
        main.write_text(_main_conf(work, site))
        cmd = [NGINX, "-p", str(work), "-e", str(work / "error.log"), "-c", str(main)]
        nginx = subprocess.Popen(
            [*cmd, "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=(work / "nginx.stderr").open("wb"),
        )
        url = f"http://127.0.0.1:{listen}"
        wait_ready(url, nginx, "/health")
        yield Balanced(url, started, access_log, nginx)
    finally:
        for p in [nginx, *(r.proc for r in started)]:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [nginx, *(r.proc for r in started)]:
            if p is not None:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
