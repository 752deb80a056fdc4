"""`ninfer openapi`: the HTTP contract as an OpenAPI 3.1 document (what docs/openapi.json
keeps), and whether a change of it breaks an older one."""

from __future__ import annotations

import argparse
import sys

from ninfer import __version__

__all__ = ["add_command"]


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    openapi = sub.add_parser(
        "openapi",
        help="print the OpenAPI 3.1 document of the HTTP contract",
        description="Print the OpenAPI document generated from the protocol schemas (the "
        "repository keeps it as docs/openapi.json). With --compare OLD.json, say whether "
        "the current contract is a compatible change of OLD and name each broken rule "
        "(exit status 1 when incompatible).",
    )
    openapi.add_argument("-o", "--output", default=None, help="write to this file")
    openapi.add_argument("--compare", metavar="OLD", default=None, help="an older document")
    openapi.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    from pathlib import Path

    import orjson

    from protocols import classify, openapi_document

    doc = openapi_document(__version__)
    if args.compare is not None:
        try:
            old = orjson.loads(Path(args.compare).read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            print(f"ninfer openapi: error: {args.compare}: {exc}", file=sys.stderr)
            return 2
        breaks = classify(old, doc)
        for b in breaks:
            print(f"incompatible: {b}")
        if not breaks:
            print("compatible" + (" (identical)" if old == doc else ""))
        return 1 if breaks else 0
    text = orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n"
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
