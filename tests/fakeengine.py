"""A fake engine that runs inside Trio, and an ASGI client made of memory channels.

`FakeEngine` is an `EngineHost` (what the bridge drives): each step is a
`trio.sleep(step_s)`, so on the autojump clock a test sees exact, repeatable times.
A request prefills for `prefill_steps` steps, then gets one token a step (text "a"
each) until its budget; a prompt containing the `FAIL` marker fails in decode; an
embedding request ends after its prefill with a vector of 4 values. Its
events reach the real `EngineService` through the same sink as the threaded engine's.

`AsgiClient` calls the real app with channel-backed receive/send, so a test can send
the body in pieces, disconnect at any point, and stop reading (a send that waits).
"""

from __future__ import annotations

import array
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import orjson
import trio

from ninfer.engine import (
    ChatText,
    Embedding,
    EngineStatistics,
    EngineTimings,
    EventSink,
    Finish,
    FinishReason,
    GenerationRequest,
    ModelIdentity,
    RequestHandle,
    ServedModel,
    TokenDelta,
    Usage,
)

FAIL = "FAIL"


class FakeTemplate:
    source = "<role>content...<assistant>"
    writes_tool_calls = False
    thinking = None
    bos_token = ""
    eos_token = "<eos>"

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> ChatText:
        return ChatText(self.render(messages, add_generation_prompt=add_generation_prompt))


class FakeTokenizer:
    """One token per character (ids 1..255); `template`: a real chat template's Jinja
    text instead of the fake one."""

    chat_template: Any = FakeTemplate()

    def __init__(self, template: str | None = None) -> None:
        if template is not None:
            from ninfer.engine._tokenizer import ChatTemplate

            self.chat_template = ChatTemplate.from_source(template, bos_token="", eos_token="")

    max_token_bytes = 4  # one character, at most four UTF-8 bytes

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 255 + 1 for c in text]

    def encode_chat(self, chat: ChatText) -> list[int]:
        return self.encode(chat.text)

    def encode_plain(self, text: str) -> list[int]:
        return self.encode(text)

    def chat_prompt(self, chat: ChatText) -> str:
        return chat.text

    def exceeds(self, prompt: str | ChatText, limit: int, *, special: bool = True) -> bool:
        return len(prompt.text if isinstance(prompt, ChatText) else prompt) > limit

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id - 1).encode("utf-8")


def served_model(
    *, max_context: int = 512, kv_pages: int = 256, template: str | None = None
) -> ServedModel:
    return ServedModel(
        identity=ModelIdentity("fake", "llama", "0" * 64, max_context, 256, "fake.gguf"),
        tokenizer=FakeTokenizer(template),
        load_seconds=0.0,
        max_context=max_context,
        page_size=16,
        kv_pages=kv_pages,
        dtype="float32",
        device="cpu",
        batch_invariant=True,
        batch_sizes=(1, 2, 4, 8),
        embedding_length=4,
    )


@attrs.define(eq=False)
class _Req:
    handle: RequestHandle
    request: GenerationRequest
    prefill_left: int
    generated: int = 0
    paused: bool = False


class FakeEngine:
    """An EngineHost inside Trio: exact steps on the test clock."""

    def __init__(
        self,
        *,
        step_s: float = 0.01,
        prefill_steps: int = 1,
        script: Callable[[GenerationRequest], str] | None = None,
        **model: Any,
    ) -> None:
        self.step_s = step_s
        self.prefill_steps = prefill_steps
        # What each request writes, one character a token, then its end (eos); without,
        # "a" a token to its budget.
        self.script = script
        self.model = served_model(**model)
        self._ids = itertools.count(1)
        self._reqs: dict[int, _Req] = {}
        self._stop = False
        self._wake = trio.Event()
        self.decode_steps = 0
        self.decode_rows = 0
        self.generated = 0
        self.cancelled: list[str] = []  # request ids, in order
        self.submitted: list[GenerationRequest] = []
        self._sink: EventSink | None = None

    async def run(self, sink: EventSink, on_ready: Callable[[ServedModel], None]) -> None:
        self._sink = sink
        on_ready(self.model)
        while not self._stop:
            if not any(not r.paused for r in self._reqs.values()):
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            await trio.sleep(self.step_s)
            sink.deliver(self._step())
        sink.deliver([(r.handle, self._finish(r, "cancelled")) for r in self._reqs.values()])
        self._reqs.clear()

    def _step(self) -> list[tuple[RequestHandle, Any]]:
        events: list[tuple[RequestHandle, Any]] = []
        rows = 0
        for r in list(self._reqs.values()):
            if r.paused:
                continue
            if r.prefill_left > 0:
                r.prefill_left -= 1
                continue
            if r.request.embed is not None:  # its prompt is done: its vector, no token
                events.append((r.handle, self._finish(r, "embedded")))
                continue
            rows += 1
            r.generated += 1
            self.generated += 1
            if FAIL in "".join(chr(t - 1) for t in r.request.prompt_ids):
                events.append((r.handle, self._finish(r, "error", "injected failure")))
                continue
            if self.script is not None:
                text = self.script(r.request)
                if r.generated > len(text):
                    r.generated -= 1  # the end of sequence is no output token
                    events.append((r.handle, self._finish(r, "eos")))
                    continue
                ch = text[r.generated - 1]
                events.append((r.handle, TokenDelta((ord(ch) % 255 + 1,), ch)))
            else:
                events.append((r.handle, TokenDelta((7,), "a")))
            if r.generated >= r.request.max_new_tokens:
                events.append((r.handle, self._finish(r, "length")))
        if rows:
            self.decode_steps += 1
            self.decode_rows += rows
        return events

    def _finish(self, r: _Req, reason: FinishReason, error: str | None = None) -> Finish:
        self._reqs.pop(r.handle.id, None)
        usage = Usage(len(r.request.prompt_ids), r.generated)
        embedding = None
        if reason == "embedded":  # 4 values from the prompt: its length, first, last, 1
            p = r.request.prompt_ids
            values = array.array("f", [len(p), p[0], p[-1], 1.0])
            embedding = Embedding(values.tobytes(), 1, len(values))
        return Finish(
            reason, usage, EngineTimings(0.0, 0.0, 0.0), None, error=error, embedding=embedding
        )

    def _poke(self) -> None:
        self._wake.set()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        self.submitted.append(request)
        handle = RequestHandle(next(self._ids), request.request_id)
        self._reqs[handle.id] = _Req(handle, request, self.prefill_steps)
        self._poke()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """As the real engine: a request still running ends with a cancelled Finish."""
        r = self._reqs.get(handle.id)
        if r is not None:
            self.cancelled.append(handle.request_id)
            assert self._sink is not None
            self._sink.deliver([(handle, self._finish(r, "cancelled"))])

    def pause(self, handle: RequestHandle, paused: bool) -> None:
        r = self._reqs.get(handle.id)
        if r is not None:
            r.paused = paused
            self._poke()

    def shutdown(self) -> None:
        self._stop = True
        self._poke()

    @property
    def active(self) -> int:
        return len(self._reqs)

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            state="ready",
            waiting=0,
            prefilling=sum(1 for r in self._reqs.values() if r.prefill_left),
            decoding=sum(1 for r in self._reqs.values() if not r.prefill_left),
            pages_total=self.model.kv_pages,
            pages_used=0,
            pages_free=self.model.kv_pages,
            steps=self.decode_steps,
            last_progress=time.monotonic(),
            slowest_recent_step=self.step_s,
            busy=any(not r.paused for r in self._reqs.values()),
            batch_invariant=True,
            batch_sizes=self.model.batch_sizes,
            decode_steps=self.decode_steps,
            decode_rows=self.decode_rows,
            prefill_tokens=0,
            prefill_passes=0,
            cached_prompt_tokens=0,
            pages_cached=0,
            generated_tokens=self.generated,
            decode_step_seconds=self.step_s,
            # its prefill is `prefill_steps` steps whatever the prompt: none per token
            prefill_seconds_per_token=1e-9,
        )


@attrs.define
class Response:
    status: int = 0
    headers: dict[bytes, bytes] = attrs.field(factory=dict)
    body: bytearray = attrs.field(factory=bytearray)
    complete: bool = False

    def json(self) -> Any:
        return orjson.loads(bytes(self.body))

    def events(self) -> list[tuple[str | None, Any]]:
        """SSE frames as (event name or None, parsed data or the raw text)."""
        out = []
        for block in bytes(self.body).decode().strip().split("\n\n"):
            fields = dict(line.split(": ", 1) for line in block.splitlines())
            data = fields["data"]
            out.append((fields.get("event"), data if data == "[DONE]" else orjson.loads(data)))
        return out


class AsgiClient:
    """One request against the app over memory channels.

    `send_body(...)` pushes body pieces, `disconnect()` the client going away;
    `reading` (a trio.Event, set by default) holds every response body message until
    it is set: a client that has stopped reading."""

    def __init__(
        self,
        app: Any,
        method: str,
        path: str,
        *,
        headers: Sequence[tuple[bytes, bytes]] = ((b"content-type", b"application/json"),),
    ) -> None:
        self.app = app
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": list(headers),
            "client": ("127.0.0.1", 1234),
            "server": ("127.0.0.1", 8080),
            "extensions": {},
        }
        # A real client's bytes wait in the socket: unbounded here (a test sends a few).
        self._to_app, self._from_client = trio.open_memory_channel[dict[str, Any]](1000)
        self.response = Response()
        self.reading = trio.Event()
        self.reading.set()
        self.finished = trio.Event()
        self.started = trio.Event()  # set at http.response.start
        self.held_since: float | None = None  # when a write first waited for the reader

    async def receive(self) -> dict[str, Any]:
        return await self._from_client.receive()

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.response.status = message["status"]
            self.response.headers = {k.lower(): v for k, v in message["headers"]}
            self.started.set()
        elif message["type"] == "http.response.body":
            if not self.reading.is_set() and self.held_since is None:
                self.held_since = trio.current_time()
            await self.reading.wait()
            self.response.body += message.get("body", b"")
            if not message.get("more_body", False):
                self.response.complete = True

    def send_body(self, data: bytes, *, more: bool = False) -> None:
        self._to_app.send_nowait({"type": "http.request", "body": data, "more_body": more})

    def disconnect(self) -> None:
        self._to_app.send_nowait({"type": "http.disconnect"})

    async def run(self) -> None:
        """Call the app; returns when it has answered (the connection stays open)."""
        try:
            await self.app(self.scope, self.receive, self.send)
        finally:
            self.finished.set()


async def request(
    app: Any, method: str, path: str, body: Any = None, *, address: str = "127.0.0.1"
) -> Response:
    """A whole request and its answer (the body sent at once, then read to the end),
    from a client at `address`."""
    client = AsgiClient(app, method, path)
    client.scope["client"] = (address, 1234)
    client.send_body(orjson.dumps(body) if body is not None else b"")
    await client.run()
    return client.response
