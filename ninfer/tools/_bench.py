"""`ninfer bench URL`: a load generator for OpenAI-compatible chat servers (and ninfer's
native route), in Trio with httpx.

Closed loop: for each client count, that many clients send streaming requests back to
back for a fixed time. Open loop: requests arrive as a Poisson process at each rate,
whatever the server's state (in flight capped). Every request asks for the same number
of output tokens and sets `ignore_eos`, so runs compare. Each stream is timed: time to
first token, the gaps between tokens, end to end; completion tokens come from the
server's usage when it sends one, else from the chunks counted. Bounded by time and by
count per level; loopback only unless asked.
"""

from __future__ import annotations

import math
import random
import sys
import time
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

import attrs
import orjson

from ninfer.tools._logtools import percentile

__all__ = ["BenchConfig", "LevelResult", "render_table", "run_bench"]

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


@attrs.define
class LevelResult:
    mode: Literal["closed", "open"]
    load: float  # clients, or requests per second
    seconds: float
    samples: list[Sample] = attrs.field(factory=list)

    def summary(self) -> dict[str, Any]:
        ok = [s for s in self.samples if s.status == 200 and s.error is None]
        tokens = sum(s.tokens for s in ok)
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
            "failed": sum(
                s.status not in (200, 429, 503) or s.error is not None for s in self.samples
            ),
            "errors": dict(
                Counter(
                    s.error or f"HTTP {s.status}"
                    for s in self.samples
                    if s.status not in (200, 429, 503) or s.error is not None
                )
            ),
            "completion_tokens": tokens,
            "tokens_per_second": tokens / self.seconds if self.seconds else 0.0,
            "requests_per_second": len(ok) / self.seconds if self.seconds else 0.0,
            "ttft_p50": pct(ttft, 50),
            "ttft_p95": pct(ttft, 95),
            "itl_p50": pct(gaps, 50),
            "itl_p95": pct(gaps, 95),
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

    async def one(self) -> Sample:
        import httpx

        path, body = self._request()
        headers = {"authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        start = time.perf_counter()
        sample = Sample(status=0)
        last: float | None = None
        chunks = 0
        usage: int | None = None
        try:
            async with self.http.stream("POST", path, json=body, headers=headers) as r:
                sample.status = r.status_code
                if r.status_code != 200:
                    await r.aread()
                    return sample
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
                        chunks += n
                    usage = _usage_in(data, self.cfg.route) or usage
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            sample.error = type(exc).__name__
            return sample
        if not complete and sample.error is None:
            sample.error = "stream ended without its end"
        sample.total = time.perf_counter() - start
        sample.tokens = usage if usage is not None else chunks
        return sample


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


async def _closed(
    client: _Client, clients: int, cfg: BenchConfig, tick: Callable[[], None]
) -> LevelResult:
    import trio

    result = LevelResult("closed", clients, 0.0)
    start = trio.current_time()
    deadline = start + cfg.duration_s

    async def worker() -> None:
        while trio.current_time() < deadline and len(result.samples) < cfg.max_requests:
            sample = await client.one()
            result.samples.append(sample)  # a request begun in the window counts whole
            tick()
            if sample.status != 200 or sample.error is not None:
                await trio.sleep(0.05)  # do not spin on refusals or failures

    async with trio.open_nursery() as n:
        for _ in range(clients):
            n.start_soon(worker)
    result.seconds = trio.current_time() - start
    return result


async def _open(
    client: _Client, rate: float, cfg: BenchConfig, tick: Callable[[], None]
) -> LevelResult:
    import trio

    result = LevelResult("open", rate, 0.0)
    rng = random.Random(cfg.seed + int(rate * 1000))
    limiter = trio.CapacityLimiter(cfg.max_in_flight)
    start = trio.current_time()

    async def fire() -> None:
        async with limiter:
            result.samples.append(await client.one())
            tick()

    async with trio.open_nursery() as n:
        at = start
        sent = 0
        while sent < cfg.max_requests:
            at += rng.expovariate(rate)
            if at > start + cfg.duration_s:
                break
            await trio.sleep_until(at)
            n.start_soon(fire)
            sent += 1
    result.seconds = trio.current_time() - start
    return result


class _Progress:
    """One level's progress on stderr: on a terminal, a bar redrawn in place four times a
    second (time elapsed, or requests done where --max-requests comes first); otherwise
    (a file, a pipe) one line when the level ends, never a pile of carriage returns."""

    def __init__(self, label: str, cfg: BenchConfig, stream: Any) -> None:
        self.label = label
        self.cfg = cfg
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.done = 0
        self.begun = time.monotonic()

    def tick(self) -> None:
        self.done += 1

    def _line(self, frac: float) -> str:
        bar = "#" * int(min(1.0, frac) * 30)
        plural = "" if self.done == 1 else "s"
        return f"{self.label:<22} [{bar:<30}] {self.done} request{plural}"

    async def redraw(self) -> None:
        import trio

        if not self.tty:
            return
        while True:
            elapsed = time.monotonic() - self.begun
            frac = max(elapsed / self.cfg.duration_s, self.done / self.cfg.max_requests)
            self.stream.write("\r" + self._line(frac))
            self.stream.flush()
            await trio.sleep(0.25)

    def finish(self) -> None:
        seconds = time.monotonic() - self.begun
        if self.tty:
            self.stream.write("\r" + self._line(1.0) + f" in {seconds:.1f} s\n")
        else:
            plural = "" if self.done == 1 else "s"
            self.stream.write(f"{self.label}: {self.done} request{plural} in {seconds:.1f} s\n")
        self.stream.flush()


async def run_bench(cfg: BenchConfig, *, progress: bool = True) -> list[LevelResult]:
    import httpx
    import trio

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
        if cfg.warmup_s > 0:
            with trio.move_on_after(cfg.warmup_s * 5):
                await _closed(client, 2, attrs.evolve(cfg, duration_s=cfg.warmup_s), lambda: None)
        results = []
        levels: list[tuple[str, float]] = [("closed", c) for c in cfg.clients]
        levels += [("open", r) for r in cfg.rates]
        for i, (mode, load) in enumerate(levels):
            shown = _Progress(f"[{i + 1}/{len(levels)}] {mode} {load:g}", cfg, sys.stderr)
            async with trio.open_nursery() as n:
                if progress:
                    n.start_soon(shown.redraw)
                if mode == "closed":
                    result = await _closed(client, int(load), cfg, shown.tick)
                else:
                    result = await _open(client, load, cfg, shown.tick)
                n.cancel_scope.cancel()
            if progress:
                shown.finish()
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
    return "\n".join(lines) + "\n(times in ms; tok/s = completion tokens per second)"


def plot_bench(rows: Sequence[dict[str, Any]], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), constrained_layout=True)
    for mode in ("closed", "open"):
        sel = [r for r in rows if r["mode"] == mode]
        if not sel:
            continue
        x = [r["load"] for r in sel]
        style = "o-" if mode == "closed" else "s--"
        axes[0].plot(x, [r["tokens_per_second"] for r in sel], style, label=f"{mode} loop")
        for key, name in (("ttft", "TTFT"), ("e2e", "end to end")):
            for p, ls in (("p50", style), ("p95", ":")):
                ys = [r[f"{key}_{p}"] if r[f"{key}_{p}"] is not None else math.nan for r in sel]
                axes[1].plot(x, ys, ls, label=f"{name} {p} ({mode})")
        refused = [(r["rejected_429"] + r["rejected_503"]) / max(1, r["requests"]) for r in sel]
        axes[2].plot(x, refused, style, label=f"{mode} loop")
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    axes[0].set_title("completion tokens per second")
    axes[1].set_title("latency (s)")
    axes[1].set_yscale("log")
    axes[2].set_title("share refused (429 + 503)")
    # A share: from 0 (never below), at least to 10%, as a percentage.
    most = max(((r["rejected_429"] + r["rejected_503"]) / max(1, r["requests"]) for r in rows),
               default=0.0)  # fmt: skip
    axes[2].set_ylim(0.0, min(1.0, max(0.1, most * 1.15)))
    axes[2].yaxis.set_major_formatter(PercentFormatter(1.0))
    closed_only = all(r["mode"] == "closed" for r in rows)
    for ax in axes:
        if closed_only:  # clients come in whole numbers
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("clients" if closed_only else "clients, or arrivals per second")
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)
