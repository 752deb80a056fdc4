"""The public ASGI entry point, as Hypercorn runs it:

    hypercorn --config python:ninfer.app.hypercorn_config --bind 127.0.0.1:8080 \\
        'ninfer.app:create_app()'

`create_app()` builds the app in Hypercorn's worker; `hypercorn_config` is read in
Hypercorn's own process (ninfer/_hypercorn.py, `master_config`): it checks ninfer's
settings before a worker is spawned and keeps a failed worker's exit status, and it
selects the trio worker.
"""

from __future__ import annotations

from ninfer._app import App, create_app
from ninfer._hypercorn import master_config

__all__ = ["App", "create_app", "hypercorn_config"]  # noqa: F822 (made by __getattr__)


def __getattr__(name: str) -> object:
    # Made when Hypercorn reads it (`--config python:ninfer.app.hypercorn_config`), not at
    # import: its checks and its change to Hypercorn belong to Hypercorn's own process.
    if name == "hypercorn_config":
        return master_config()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
