"""Browser SDKs across origins: a page served from another origin calls ninfer from a
real headless Chromium (Debian's package) with fetch, sending the headers the openai
and anthropic JavaScript SDKs send (`x-stainless-*`, `anthropic-version`,
`anthropic-dangerous-direct-browser-access`), so the browser makes its CORS preflight
and enforces the answer. Skipped where Chromium is not installed (`.ci/run`
installs it)."""

from __future__ import annotations

import http.server
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest
import trio
from server import serve

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HANG_GUARD_S = 120

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)"),
]

# What the page does, as the SDKs do it: the OpenAI SDK's headers on a chat completion
# (whole and streamed, read through the body's reader), the Anthropic SDK's on a
# message; every result, or the error the browser reported, is posted back.
PAGE = """<!doctype html><meta charset="utf-8"><title>ninfer cors</title><script>
const api = "%(api)s", key = "%(key)s";
const stainless = {"x-stainless-lang": "js", "x-stainless-package-version": "6.9.0",
  "x-stainless-os": "Linux", "x-stainless-arch": "x64", "x-stainless-runtime": "browser:chrome",
  "x-stainless-runtime-version": "150", "x-stainless-retry-count": "0",
  "x-stainless-timeout": "600"};
const openai = {...stainless, "content-type": "application/json", "authorization": "Bearer " + key};
async function run() {
  const out = {};
  try {
    const chat = {model: "%(model)s", max_tokens: 3, messages: [{role: "user", content: "hi"}]};
    let r = await fetch(api + "/v1/chat/completions", {method: "POST", body: JSON.stringify(chat),
                                                       headers: openai});
    out.openai = {status: r.status, requestId: r.headers.get("x-request-id"),
                  body: await r.json()};
    r = await fetch(api + "/v1/chat/completions", {method: "POST",
      body: JSON.stringify({...chat, stream: true}), headers: openai});
    const reader = r.body.getReader();
    let text = "";
    for (;;) { const {done, value} = await reader.read(); if (done) break;
               text += new TextDecoder().decode(value); }
    out.stream = {status: r.status, done: text.includes("data: [DONE]")};
    const msg = {model: "%(model)s", max_tokens: 3, messages: [{role: "user", content: "hi"}]};
    r = await fetch(api + "/v1/messages", {method: "POST", body: JSON.stringify(msg),
      headers: {...stainless, "content-type": "application/json", "x-api-key": key,
                "anthropic-version": "2023-06-01",
                "anthropic-dangerous-direct-browser-access": "true"}});
    out.anthropic = {status: r.status, requestId: r.headers.get("request-id"),
                     body: await r.json()};
    r = await fetch(api + "/v1/models", {headers: {"authorization": "Bearer wrong"}});
    out.unauthorized = {status: r.status, body: await r.json()};
  } catch (e) { out.error = String(e); }
  await fetch("/result", {method: "POST", body: JSON.stringify(out)});
}
run();
</script>"""


class _Page(http.server.BaseHTTPRequestHandler):
    """Serves the page and takes its result (on its own origin: another port)."""

    page = b""
    result: ClassVar[list[bytes]] = []
    got = threading.Event()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/html; charset=utf-8")
        self.send_header("content-length", str(len(self.page)))
        self.end_headers()
        self.wfile.write(self.page)

    def do_POST(self) -> None:
        length = int(self.headers["content-length"])
        type(self).result.append(self.rfile.read(length))
        self.send_response(204)
        self.end_headers()
        type(self).got.set()

    def log_message(self, *_args: Any) -> None:
        pass


async def test_browser_sdk_headers_pass_the_preflight(tiny_gguf: Path, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    pages = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    origin = f"http://127.0.0.1:{pages.server_address[1]}"
    threading.Thread(target=pages.serve_forever, daemon=True).start()
    settings = {"cors": origin, "api_key": "browser-key"}
    try:
        with trio.fail_after(HANG_GUARD_S):
            async with serve(tiny_gguf, tmp_path, **settings) as srv:
                _Page.page = (PAGE % {"api": srv.url, "key": "browser-key",
                                      "model": srv.app.lifespan.public_id}).encode()  # fmt: skip
                browser = await trio.lowlevel.open_process(
                    [
                        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                        "--disable-quic", "--no-first-run", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp_path / 'chromium'}", origin + "/",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )  # fmt: skip
                try:
                    await trio.to_thread.run_sync(_Page.got.wait, abandon_on_cancel=True)
                finally:
                    browser.kill()
                    await browser.wait()
    finally:
        pages.shutdown()
    out = orjson.loads(_Page.result[0])
    assert "error" not in out, out
    assert out["openai"]["status"] == 200
    assert out["openai"]["body"]["object"] == "chat.completion"
    assert out["openai"]["requestId"]  # an exposed header the page may read
    assert out["stream"] == {"status": 200, "done": True}
    assert out["anthropic"]["status"] == 200
    assert out["anthropic"]["body"]["type"] == "message"
    assert out["anthropic"]["requestId"]
    assert out["unauthorized"]["status"] == 401
    assert out["unauthorized"]["body"]["error"]["code"] == "invalid_api_key"
