"""The deploy files, checked as a host would read them: the systemd unit by
`systemd-analyze verify` (where systemd is installed), the Kubernetes manifest by its
structure, and the flags both pass by ninfer's own parser. (deploy/nginx.conf runs in
tests/test_replicas.py.)"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

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
