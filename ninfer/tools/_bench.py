"""`ninfer bench URL`: a load generator for OpenAI-compatible chat servers (and ninfer's
native route), in Trio with httpx.

Closed loop: for each client count, that many clients send streaming requests back to
back for a fixed time. Open loop: requests arrive as a Poisson process at each rate,
whatever the server's state (in flight capped). Every request asks for the same number
of output tokens and sets `ignore_eos`, so runs compare. Each stream is timed: time to
first token, the gaps between tokens, end to end; completion tokens come from the
server's usage when it sends one, else from the chunks counted. Each level lasts
--duration-s (no request begins after it) plus at most --grace-s for the requests still
running to finish; those still running then are cut (cancelled: the server stops their
work) and counted apart, as k6's graceful stop does. At most --max-requests per level;
loopback only unless asked.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import orjson

from ninfer.tools._args import int_list, non_negative_float, positive_float, positive_int, rate_list
from ninfer.tools._logtools import percentile

__all__ = [
    "BenchConfig",
    "LevelResult",
    "add_command",
    "render_table",
    "run_bench",
]

Route = Literal["chat", "completions", "native"]

PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a refrigerator works.",
    "List some facts about the Moon.",
    "Describe a walk through a busy market.",
    "What makes a good cup of tea?",
    "Tell me about the history of bicycles.",
    "Write a poem about autumn leaves.",
    "How do bees make honey?",
)


@attrs.frozen
class BenchConfig:
    url: str
    route: Route = "chat"
    model: str | None = None  # default: the first of GET /v1/models (OpenAI routes)
    clients: tuple[int, ...] = (1, 4, 8, 16)
    rates: tuple[float, ...] = ()
    duration_s: float = 20.0
    grace_s: float = 5.0  # for the requests still running when a level's duration ends
    max_requests: int = 2000  # per level
    max_tokens: int = 64
    warmup_s: float = 2.0
    api_key: str | None = None
    max_in_flight: int = 256  # open loop
    seed: int = 0
    json_object: bool = False  # chat answers constrained to a JSON object (structured output)


@attrs.define
class Sample:
    status: int
    ttft: float | None = None
    total: float | None = None
    tokens: int = 0
    gaps: list[float] = attrs.field(factory=list)
    error: str | None = None
    finished: bool = False  # False: still running when the level's grace ran out (cut)

    @property
    def ok(self) -> bool:
        return self.finished and self.status == 200 and self.error is None

    @property
    def failed(self) -> bool:
        return self.finished and (self.status not in (200, 429, 503) or self.error is not None)


@attrs.define
class LevelResult:
    mode: Literal["closed", "open"]
    load: float  # clients, or requests per second
    seconds: float
    samples: list[Sample] = attrs.field(factory=list)

    def summary(self) -> dict[str, Any]:
        ok = [s for s in self.samples if s.ok]
        cut = [s for s in self.samples if not s.finished]
        tokens = sum(s.tokens for s in ok)
        # Throughput counts every token received in the level: a cut stream's too, and
        # a failed one's before it broke (a server that drops a connection after its
        # last token still did that work).
        received = sum(s.tokens for s in self.samples if s.status == 200)
        ttft = sorted(s.ttft for s in ok if s.ttft is not None)
        total = sorted(s.total for s in ok if s.total is not None)
        gaps = sorted(g for s in ok for g in s.gaps)
        n = len(self.samples)

        def pct(values: list[float], p: float) -> float | None:
            return percentile(values, p) if values else None

        return {
            "mode": self.mode,
            "load": self.load,
            "seconds": self.seconds,
            "requests": n,
            "ok": len(ok),
            "rejected_429": sum(s.status == 429 for s in self.samples),
            "rejected_503": sum(s.status == 503 for s in self.samples),
            "failed": sum(s.failed for s in self.samples),
            "cut": len(cut),
            "errors": dict(
                Counter(s.error or f"HTTP {s.status}" for s in self.samples if s.failed)
            ),
            "completion_tokens": tokens,
            "tokens_per_second": received / self.seconds if self.seconds else 0.0,
            "requests_per_second": len(ok) / self.seconds if self.seconds else 0.0,
            "ttft_p50": pct(ttft, 50),
            "ttft_p95": pct(ttft, 95),
            "itl_p50": pct(gaps, 50),
            "itl_p95": pct(gaps, 95),
            "itl_p99": pct(gaps, 99),
            "e2e_p50": pct(total, 50),
            "e2e_p95": pct(total, 95),
        }


def server_url(url: str) -> str:
    """The server's base URL: `localhost:8080` and `127.0.0.1:8080` mean http:// (as
    curl takes them); a trailing slash is dropped."""
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def check_loopback(url: str) -> None:
    host = urllib.parse.urlsplit(url).hostname or ""
    if not host:
        raise ValueError("the URL names no host; give http://HOST:PORT or HOST:PORT")
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
        raise ValueError(f"{host} is not a loopback address; pass --allow-remote to load it")


class _Client:
    def __init__(self, cfg: BenchConfig, http: Any, model: str | None) -> None:
        self.cfg = cfg
        self.http = http
        self.model = model
        self.rng = random.Random(cfg.seed)

    def _request(self) -> tuple[str, dict[str, Any]]:
        prompt = self.rng.choice(PROMPTS)
        if self.cfg.route == "native":
            return "/v1/generate", {
                "prompt": f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
                "max_new_tokens": self.cfg.max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        if self.cfg.route == "completions":  # the prompt as plain text (a base model)
            return "/v1/completions", {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": self.cfg.max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.cfg.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.cfg.json_object:
            body["response_format"] = {"type": "json_object"}
        return "/v1/chat/completions", body

    async def one(self, sample: Sample) -> None:
        """Send one request, filling in `sample` as the answer arrives (a cancelled one
        keeps what came, and `finished` False)."""
        import httpx

        path, body = self._request()
        headers = {"authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        start = time.perf_counter()
        last: float | None = None
        usage: int | None = None
        try:
            async with self.http.stream("POST", path, json=body, headers=headers) as r:
                sample.status = r.status_code
                if r.status_code != 200:
                    await r.aread()
                    sample.finished = True
                    return
                complete = False  # the stream's own end: [DONE], or the native `done` event
                async for line in _sse_lines(r):
                    if line in ("data: [DONE]", "event: done"):
                        complete = True
                    if line.startswith("event: error") or line.startswith('data: {"error"'):
                        sample.error = "stream ended by an error event"
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = orjson.loads(line[6:])
                    n = _tokens_in(data, self.cfg.route)
                    if n:
                        now = time.perf_counter()
                        if last is None:
                            sample.ttft = now - start
                        else:
                            sample.gaps.extend([(now - last) / n] * n)
                        last = now
                        sample.tokens += n
                    usage = _usage_in(data, self.cfg.route) or usage
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            sample.error = type(exc).__name__
            sample.finished = True
            return
        if not complete and sample.error is None:
            sample.error = "stream ended without its end"
        sample.total = time.perf_counter() - start
        if usage is not None:
            sample.tokens = usage
        sample.finished = True


async def _sse_lines(response: Any) -> AsyncIterator[str]:
    """A stream's lines, split at line feeds only: httpx's `aiter_lines` also splits at
    characters a generated text may hold raw inside its JSON (NEL, U+2028, U+2029)."""
    pending = ""
    async for chunk in response.aiter_text():
        pending += chunk
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


def _tokens_in(data: Any, route: Route) -> int:
    """How many tokens this stream line carries (OpenAI: one per content chunk)."""
    if route == "native":
        ids = data.get("token_ids")
        return len(ids) if isinstance(ids, list) and "finish_reason" not in data else 0
    choices = data.get("choices") or []
    if choices and ((choices[0].get("delta") or {}).get("content") or choices[0].get("text")):
        return 1
    return 0


def _usage_in(data: Any, route: Route) -> int | None:
    usage = data.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return None


async def _closed(client: _Client, clients: int, cfg: BenchConfig, shown: _Progress) -> LevelResult:
    import trio

    result = LevelResult("closed", clients, 0.0)
    start = trio.current_time()
    deadline = start + cfg.duration_s

    async def worker() -> None:
        while trio.current_time() < deadline and len(result.samples) < cfg.max_requests:
            sample = Sample(status=0)
            result.samples.append(sample)  # a request begun in the window counts whole
            shown.started()
            await client.one(sample)
            shown.ended()
            if not sample.ok:
                await trio.sleep(0.05)  # do not spin on refusals or failures

    with trio.move_on_at(deadline + cfg.grace_s):  # then what still runs is cut
        async with trio.open_nursery() as n:
            for _ in range(clients):
                n.start_soon(worker)
    result.seconds = trio.current_time() - start
    return result


async def _open(client: _Client, rate: float, cfg: BenchConfig, shown: _Progress) -> LevelResult:
    import trio

    result = LevelResult("open", rate, 0.0)
    rng = random.Random(cfg.seed + int(rate * 1000))
    limiter = trio.CapacityLimiter(cfg.max_in_flight)
    start = trio.current_time()
    deadline = start + cfg.duration_s

    async def fire() -> None:
        async with limiter:  # past --max-in-flight an arrival waits here, unsent
            sample = Sample(status=0)
            result.samples.append(sample)
            shown.started()
            await client.one(sample)
        shown.ended()

    with trio.move_on_at(deadline + cfg.grace_s):  # then what still runs is cut
        async with trio.open_nursery() as n:
            at = start
            sent = 0
            while sent < cfg.max_requests:
                at += rng.expovariate(rate)
                if at > deadline:
                    break
                await trio.sleep_until(at)
                n.start_soon(fire)
                sent += 1
    result.seconds = trio.current_time() - start
    return result


class _Progress:
    """One level's progress on stderr. On a terminal, a bar redrawn in place four times
    a second from the level's start (time elapsed, or requests done where --max-requests
    comes first; then the requests left to finish in the grace time); otherwise (a file,
    a pipe) a line when the level begins and one when it ends, never a pile of carriage
    returns."""

    def __init__(self, label: str, cfg: BenchConfig, stream: Any, *, enabled: bool) -> None:
        self.label = label
        self.cfg = cfg
        self.stream = stream
        self.enabled = enabled
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.begun = 0
        self.done = 0
        self.t0 = 0.0

    def started(self) -> None:
        self.begun += 1

    def ended(self) -> None:
        self.done += 1

    def _line(self, elapsed: float) -> str:
        frac = max(elapsed / self.cfg.duration_s, self.done / self.cfg.max_requests)
        bar = "#" * int(min(1.0, frac) * 30)
        plural = "" if self.done == 1 else "s"
        line = f"{self.label:<22} [{bar:<30}] {self.done} request{plural} done"
        if elapsed >= self.cfg.duration_s and self.begun > self.done:
            line += f", finishing {self.begun - self.done}"
        return line

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    async def show(self) -> None:
        """Run beside the level: its first line at once, then (on a terminal) redraws."""
        import trio

        self.t0 = trio.current_time()
        if not self.enabled:
            return
        if not self.tty:
            grace = f" (+ up to {self.cfg.grace_s:g} s to finish)" if self.cfg.grace_s else ""
            self._write(f"{self.label}: running for {self.cfg.duration_s:g} s{grace}\n")
            return
        while True:
            self._write("\r" + self._line(trio.current_time() - self.t0) + "\x1b[K")
            await trio.sleep(0.25)

    def finish(self, seconds: float, cut: int) -> None:
        if not self.enabled:
            return
        plural = "" if self.done == 1 else "s"
        tail = f" in {seconds:.1f} s" + (f", {cut} cut at the end" if cut else "")
        if self.tty:
            self._write("\r" + self._line(seconds) + tail + "\x1b[K\n")
        else:
            self._write(f"{self.label}: {self.done} request{plural} done{tail}\n")


async def run_bench(
    cfg: BenchConfig, *, progress: bool = True, stream: Any = None
) -> list[LevelResult]:
    import httpx
    import trio

    stream = stream if stream is not None else sys.stderr
    levels: list[tuple[Literal["closed", "open"], float]] = [("closed", c) for c in cfg.clients]
    levels += [("open", r) for r in cfg.rates]
    if progress:  # at once, before the first connection: what will happen, how long
        most = len(levels) * (cfg.duration_s + cfg.grace_s) + cfg.warmup_s
        stream.write(
            f"ninfer bench: {cfg.url} ({cfg.route}), {len(levels)} level"
            f"{'' if len(levels) == 1 else 's'} of {cfg.duration_s:g} s"
            f"{f' + {cfg.warmup_s:g} s warm-up' if cfg.warmup_s > 0 else ''}"
            f", at most {most:g} s\n"
        )
        stream.flush()
    limits = httpx.Limits(max_connections=max([*cfg.clients, cfg.max_in_flight]) + 8)
    async with httpx.AsyncClient(base_url=cfg.url, timeout=600, limits=limits) as http:
        try:  # anything that answers HTTP at all will do (a 404 too)
            await http.get("/", timeout=30)
        except httpx.TransportError as exc:
            raise ConnectionError(f"nothing answers there ({exc})") from None
        model = cfg.model
        if cfg.route != "native" and model is None:
            headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
            listing = (await http.get("/v1/models", headers=headers)).json()
            model = listing["data"][0]["id"]
        client = _Client(cfg, http, model)
        plan: list[tuple[str, Literal["closed", "open"], float, BenchConfig]] = []
        if cfg.warmup_s > 0:
            warm = attrs.evolve(cfg, duration_s=cfg.warmup_s, grace_s=cfg.warmup_s * 4)
            plan.append(("warm-up", "closed", 2, warm))
        for i, (mode, load) in enumerate(levels):
            plan.append((f"[{i + 1}/{len(levels)}] {mode} {load:g}", mode, load, cfg))
        results = []
        for label, mode, load, level_cfg in plan:
            shown = _Progress(label, level_cfg, stream, enabled=progress)
            async with trio.open_nursery() as n:
                n.start_soon(shown.show)
                if mode == "closed":
                    result = await _closed(client, int(load), level_cfg, shown)
                else:
                    result = await _open(client, load, level_cfg, shown)
                n.cancel_scope.cancel()
            shown.finish(result.seconds, sum(not s.finished for s in result.samples))
            if label != "warm-up":
                results.append(result)
    return results


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def render_table(rows: Sequence[dict[str, Any]]) -> str:
    header = [
        "mode",
        "load",
        "ok",
        "429",
        "503",
        "fail",
        "cut",
        "tok/s",
        "req/s",
        "ttft p50",
        "p95",
        "itl p50",
        "p95",
        "e2e p50",
        "p95",
    ]
    body = [
        [
            r["mode"],
            f"{r['load']:g}",
            str(r["ok"]),
            str(r["rejected_429"]),
            str(r["rejected_503"]),
            str(r["failed"]),
            str(r["cut"]),
            f"{r['tokens_per_second']:.1f}",
            f"{r['requests_per_second']:.2f}",
            _ms(r["ttft_p50"]),
            _ms(r["ttft_p95"]),
            _ms(r["itl_p50"]),
            _ms(r["itl_p95"]),
            _ms(r["e2e_p50"]),
            _ms(r["e2e_p95"]),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines) + (
        "\n(times in ms; tok/s = completion tokens received per second; cut = still running"
        " when the level's grace time ran out, cancelled)"
    )


# The plot's panels: one quantity each, on its own axis from zero.
PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("completion tokens per second", "tokens/s", ("tokens_per_second",)),
    ("requests served per second", "requests/s", ("requests_per_second",)),
    ("share refused (429 + 503)", "share", ()),  # computed from the counts
    ("time to first token", "seconds", ("ttft_p50", "ttft_p95")),
    ("inter-token latency", "milliseconds", ("itl_p50", "itl_p95")),
    ("end-to-end latency", "seconds", ("e2e_p50", "e2e_p95")),
)


def plot_bench(rows: Sequence[dict[str, Any]], out: str, title: str) -> list[str]:
    """Draw one panel per quantity against load (PANELS); returns the panels' titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    fig, grid = plt.subplots(2, 3, figsize=(14, 7.5), constrained_layout=True)
    axes = list(grid.flat)
    closed_only = all(r["mode"] == "closed" for r in rows)
    for ax, (name, unit, keys) in zip(axes, PANELS, strict=True):
        for mode in ("closed", "open"):
            sel = [r for r in rows if r["mode"] == mode]
            if not sel:
                continue
            x = [r["load"] for r in sel]
            # a color and marker per mode; p95 dotted with hollow markers beside p50
            look = {"marker": "o", "color": "tab:blue"} if mode == "closed" else {
                "marker": "s", "color": "tab:orange"}  # fmt: skip
            if not keys:  # the refused share
                ys = [(r["rejected_429"] + r["rejected_503"]) / max(1, r["requests"]) for r in sel]
                ax.plot(x, ys, label=f"{mode} loop", **look)
                continue
            for key in keys:
                scale = 1000.0 if unit == "milliseconds" else 1.0
                ys = [math.nan if r[key] is None else r[key] * scale for r in sel]
                pct = key.rsplit("_", 1)[1] if key.endswith(("_p50", "_p95")) else ""
                label = f"{pct} ({mode} loop)" if pct else f"{mode} loop"
                if pct == "p95":
                    ax.plot(x, ys, ":", label=label, markerfacecolor="none", **look)
                else:
                    ax.plot(x, ys, "-", label=label, **look)
        ax.set_title(name)
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0.0)
        if not keys:  # from 0, at least to 10%, as a percentage
            most = max(((r["rejected_429"] + r["rejected_503"]) / max(1, r["requests"])
                        for r in rows), default=0.0)  # fmt: skip
            ax.set_ylim(0.0, min(1.0, max(0.1, most * 1.15)))
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        if closed_only:  # clients come in whole numbers
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("clients" if closed_only else "clients, or arrivals per second")
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [name for name, _, _ in PANELS]


# ---- the command ---------------------------------------------------------------------


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        type=int_list,
        default=[1, 4, 8, 16],
        help="closed-loop client counts (default: 1,4,8,16)",
    )
    bench.add_argument(
        "--rates",
        type=rate_list,
        default=[],
        help="open-loop arrival rates per second, e.g. 1,2,4 (default: none)",
    )
    bench.add_argument(
        "--duration-s",
        type=positive_float,
        default=20.0,
        help="seconds per load level in which requests begin (default: 20)",
    )
    bench.add_argument(
        "--grace-s",
        type=non_negative_float,
        default=5.0,
        help="then at most this long for the requests still running to finish; the rest "
        "are cancelled and counted as cut (default: 5)",
    )
    bench.add_argument(
        "--max-requests",
        type=positive_int,
        default=2000,
        help="at most this many requests per level (default: 2000)",
    )
    bench.add_argument(
        "--max-tokens",
        type=positive_int,
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
        type=non_negative_float,
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
    bench.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    import trio

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
