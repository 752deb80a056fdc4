"""The deploy files, checked as a host would read them: the systemd unit by
`systemd-analyze verify` (where systemd is installed), the Kubernetes manifest by its
structure, and the flags both pass by ninfer's own parser. (deploy/nginx.conf runs in
tests/test_replicas.py.)"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from ninfer._cli import build_parser
from ninfer._config import config_from_namespace

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _serve_config(argv: list[str]) -> Any:
    """The configuration `ninfer <argv>` would serve with (the flags must all exist)."""
    assert argv[0] == "serve"
    return config_from_namespace(build_parser().parse_args(argv), {})


def _unit() -> str:
    return (DEPLOY / "ninfer@.service").read_text()


def test_the_systemd_unit_creates_its_folders_and_sizes_its_threads() -> None:
    """The unit makes its cache and log folders (a fresh host has neither), and its
    replicas share the cores instead of each taking all of them."""
    unit = _unit()
    assert "CacheDirectory=ninfer" in unit
    assert "LogsDirectory=ninfer" in unit
    start = unit.split("ExecStart=", 1)[1].split("\n#", 1)[0].replace("\\\n", " ")
    argv = shlex.split(start.replace("%i", "8081"))[1:]
    cfg = _serve_config(argv)
    assert cfg.threads == 2
    assert cfg.request_log_jsonl.startswith("/var/log/ninfer/")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    """systemd's own check, with the unit's /opt/ninfer paths pointed at this checkout
    (a host installs ninfer there)."""
    here = Path(sys.executable).parent.parent.parent
    unit = _unit().replace("/opt/ninfer", str(here))
    path = tmp_path / "ninfer@8081.service"
    path.write_text(unit)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_the_kubernetes_manifest_waits_for_ready_and_keeps_the_model() -> None:
    """Pods start on /ready (not /health, which answers while the model loads), keep
    the model cache on a volume that outlives them, and pass flags ninfer takes."""
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"Deployment", "PersistentVolumeClaim", "Service"}
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    env = {e["name"]: e["value"] for e in container["env"]}
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == env["NINFER_CACHE"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert claim == by_kind["PersistentVolumeClaim"]["metadata"]["name"]
    cfg = _serve_config(container["args"])
    assert cfg.threads == int(container["resources"]["requests"]["cpu"])
    grace = by_kind["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > cfg.graceful_timeout_s + cfg.write_timeout_s


def _dockerfile() -> list[tuple[str, str]]:
    """deploy/Dockerfile's instructions, (KEYWORD, rest), continuation lines joined."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _dev_sh(name: str) -> str:
    """A variable's default in ./dev.sh (`NAME="${NINFER_…:-default}"` or `NAME=value`)."""
    for line in (DEPLOY.parent / "dev.sh").read_text().splitlines():
        if line.startswith(f"{name}="):
            value = line.split("=", 1)[1].strip('"')
            return value.split(":-", 1)[1].rstrip("}") if ":-" in value else value
    raise AssertionError(f"dev.sh sets no {name}")


def test_the_dockerfile_serves_as_the_readme_does() -> None:
    """Read as Docker reads it: the torch build ./dev.sh installs (the pin, from the CPU
    index), the default model in the cache volume, a command ninfer's parser takes on the
    exposed port, a health check on /ready, and a drain on docker stop."""
    steps = _dockerfile()
    args = dict(rest.split("=", 1) for kw, rest in steps if kw == "ARG")
    assert args["TORCH"] == _dev_sh("TORCH_SPEC")
    assert args["TORCH_INDEX"] == _dev_sh("TORCH_CPU_INDEX")
    env = " ".join(rest for kw, rest in steps if kw == "ENV")
    cache = dict(kv.split("=", 1) for kv in shlex.split(env))["NINFER_CACHE"]
    (volume,) = [orjson.loads(rest) for kw, rest in steps if kw == "VOLUME"]
    assert volume == [cache]
    runs = [rest for kw, rest in steps if kw == "RUN"]
    assert any('--extra-index-url "$TORCH_INDEX" "$TORCH"' in r for r in runs)
    assert any("ninfer fetch-model" in r for r in runs)
    assert any("ninfer build-kernels" in r for r in runs)  # as ./dev.sh does
    entry = [orjson.loads(rest) for kw, rest in steps if kw == "ENTRYPOINT"][-1]
    cmd = [orjson.loads(rest) for kw, rest in steps if kw == "CMD"][-1]
    assert entry == ["ninfer"]
    cfg = _serve_config(cmd)
    assert cfg.host == "0.0.0.0"  # reachable through the published port
    (expose,) = [int(rest) for kw, rest in steps if kw == "EXPOSE"]
    assert cfg.port == expose
    assert [kw for kw, _ in steps].count("USER") == 1  # not root
    (health,) = [rest for kw, rest in steps if kw == "HEALTHCHECK"]
    assert f"http://127.0.0.1:{expose}/ready" in health
    assert ("STOPSIGNAL", "SIGTERM") in steps
    assert cfg.graceful_timeout_s > 0


def test_the_docker_context_builds_a_complete_package(tmp_path: Path) -> None:
    """The files the Dockerfile copies (and .dockerignore lets through) build a wheel
    holding every source and data file of the package: the image installs ninfer from
    them, not in editable mode as the tests run it."""
    root = DEPLOY.parent
    ignore = (root / ".dockerignore").read_text().split()
    context = tmp_path / "context"
    for kw, rest in _dockerfile():
        if kw == "COPY":
            *sources, _dest = rest.split()
            for source in sources:
                assert f"!{source}" in ignore or f"!{source}/" in ignore, source
                src = root / source
                if src.is_dir():
                    shutil.copytree(src, context / source,
                                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
                else:
                    (context / source).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(src, context / source)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("ninfer-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        held = set(zf.namelist())
    tracked = subprocess.run(
        ["git", "ls-files", "ninfer", "scheduler", "protocols"],
        cwd=root, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()  # fmt: skip
    assert tracked
    missing = [f for f in tracked if f not in held]
    assert not missing, missing


def _docker_engine() -> bool:
    if shutil.which("docker") is None:
        return False
    try:  # the client alone answers --version; `info` needs a running engine
        done = subprocess.run(["docker", "info"], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


@pytest.mark.skipif(not _docker_engine(), reason="needs a running Docker engine")
def test_the_docker_image_builds_and_answers(tmp_path: Path) -> None:
    """Build the image, run it on a free port, wait for /ready, ask for a completion, stop
    it (a drain). Skipped where only the docker client is installed."""
    import socket
    import time
    import urllib.request

    tag = f"ninfer-test:{uuid.uuid4().hex[:8]}"
    root = DEPLOY.parent
    subprocess.run(
        ["docker", "build", "-f", str(DEPLOY / "Dockerfile"), "-t", tag, str(root)],
        check=True, timeout=3600,
    )  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = f"ninfer-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["docker", "run", "-d", "--rm", "--name", name, "-p", f"127.0.0.1:{port}:8080", tag],
        check=True, timeout=300,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 900  # a hang guard, not a speed bound
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the container never became ready"
            time.sleep(1)
        body = orjson.dumps({"prompt": "Hello", "max_new_tokens": 4, "temperature": 0})
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/generate", data=body,
            headers={"content-type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=300) as r:
            answer = orjson.loads(r.read())
        assert answer["usage"]["completion_tokens"] == 4
    finally:
        subprocess.run(["docker", "stop", "-t", "70", name], timeout=120, check=False)
        subprocess.run(["docker", "image", "rm", "-f", tag], timeout=120, check=False)
