"""The public ASGI entry point: `hypercorn --worker-class trio 'ninfer.app:create_app()'`."""

from __future__ import annotations

from ninfer._app import App, create_app

__all__ = ["App", "create_app"]
