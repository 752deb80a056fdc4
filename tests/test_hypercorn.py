"""ninfer's reach into Hypercorn (ninfer/_hypercorn.py): held to the versions its two
wrappers were written for, applied once, and by the server, not by an App."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ninfer._errors import ConfigError
from ninfer._hypercorn import HYPERCORN_VERSIONS, adapt_hypercorn, check_version

ROOT = Path(__file__).resolve().parent.parent


def test_the_requirement_is_the_range_the_wrappers_were_written_for() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [d for d in deps if d.startswith("hypercorn")]
    (low, high) = HYPERCORN_VERSIONS
    assert requirement == f"hypercorn>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    check_version(importlib.metadata.version("hypercorn"))  # what is installed is in it


@pytest.mark.parametrize("version", ["0.16.0", "0.19.0", "1.0"])
def test_another_version_is_refused_by_name(version: str) -> None:
    with pytest.raises(ConfigError, match=rf"Hypercorn {version} is installed.*<0\.19"):
        check_version(version)


def test_the_wrappers_apply_once() -> None:
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.trio.tcp_server import TCPServer

    adapt_hypercorn()
    run, send = TCPServer.run, H11Protocol._send_h11_event
    adapt_hypercorn()
    assert TCPServer.run is run
    assert H11Protocol._send_h11_event is send
    assert getattr(run, "ninfer", False)
    assert getattr(send, "ninfer", False)


def test_an_app_alone_changes_nothing_of_hypercorns() -> None:
    """An App built in a fresh interpreter (as a program embedding it would) leaves
    Hypercorn's classes as they are: only whatever runs the server adapts them."""
    probe = (
        "from ninfer._app import App\n"
        "from ninfer._config import build_config\n"
        "from fakeengine import FakeEngine\n"
        "App(build_config({'model': 'fake'}), argv=['x'], engine=FakeEngine())\n"
        "from hypercorn.protocol.h11 import H11Protocol\n"
        "from hypercorn.trio.tcp_server import TCPServer\n"
        "assert not hasattr(TCPServer.run, 'ninfer'), 'run'\n"
        "assert not hasattr(H11Protocol._send_h11_event, 'ninfer'), 'send'\n"
    )
    subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT / "tests", check=True, timeout=300,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
