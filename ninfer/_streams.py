"""Resumable streams: llama-server's stream sessions (its web UI resumes an answer after
a reload), on the Trio side.

A streamed generation whose request carries `X-Conversation-Id` writes its SSE bytes
into a session as well as to its client. When the client goes away, the generation goes
on without it while someone may come back for it: `GET /v1/stream?conv_id=…&from=N`
replays the bytes from offset N and follows the live ones; `POST /v1/streams/lookup`
says which of the named conversations have a session; `DELETE /v1/stream` stops one.
A generation nobody reads for `--stream-resume-s` is cancelled as a disconnect always
was (the request log says `cause: abandoned`). Each session keeps at most
SESSION_BYTES (its oldest bytes go first: a resume from before them is refused), and a
finished one is kept KEEP_DONE_S, at most DONE_BYTES of them (docs/api.md, "Resumable
streams"; docs/scheduler.md).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import trio

__all__ = [
    "DONE_BYTES",
    "KEEP_DONE_S",
    "SESSION_BYTES",
    "OffsetLost",
    "StreamSession",
    "StreamSessions",
    "conversation_id",
]

# What one session keeps of its stream (llama-server's cap): the newest bytes.
SESSION_BYTES = 4 << 20
# How long a finished session stays for a late reader (llama-server's), and how many of
# their bytes are kept at most (the oldest finished go first).
KEEP_DONE_S = 300.0
DONE_BYTES = 64 << 20
# A conversation id: what the web UI sends (a UUID, maybe `::` and a model name), bounded.
ID_MAX = 512
# Why a session's generation was stopped, as request_cancelled's `cause` says it.
STOPPED = "stopped"  # DELETE /v1/stream
REPLACED = "replaced"  # a newer generation of the same conversation


def conversation_id(raw: bytes | None) -> str | None:
    """The X-Conversation-Id header as a session key: printable ASCII of 1-512
    characters; None where absent or not that (such a request streams as any other)."""
    if raw is None:
        return None
    text = raw.strip()
    if not 0 < len(text) <= ID_MAX or not all(0x20 < c < 0x7F for c in text):
        return None
    return text.decode("ascii")


class OffsetLost(Exception):
    """A read from before the bytes a session still keeps."""


@attrs.define(eq=False)
class StreamSession:
    """One generation's stream: its bytes (the newest SESSION_BYTES), its readers, and
    the way to stop its generation."""

    conversation_id: str
    started_at: int  # unix seconds
    # Stops the generation (with request_cancelled's cause); set by its request.
    stop: Callable[[str], None]
    limit: int = SESSION_BYTES
    completed_at: int = 0  # unix seconds once finished; 0 while it runs
    finished_at: float = 0.0  # Trio time, for the keep
    readers: int = 0  # GET /v1/stream readers attached now
    resumes: int = 0  # readers ever attached
    _buffer: bytearray = attrs.Factory(bytearray)
    _dropped: int = 0  # bytes no longer kept, from the start
    _changed: trio.Event = attrs.Factory(trio.Event)

    @property
    def total_bytes(self) -> int:
        return self._dropped + len(self._buffer)

    @property
    def dropped(self) -> int:
        return self._dropped

    @property
    def done(self) -> bool:
        return self.completed_at != 0

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def changed(self) -> None:
        """Return at the next change: bytes, readers, the end."""
        await self._changed.wait()

    def append(self, data: bytes) -> None:
        if self.done or not data:
            return
        self._buffer += data
        over = len(self._buffer) - self.limit
        if over > 0:
            del self._buffer[:over]
            self._dropped += over
        self._wake()

    def finish(self) -> None:
        if not self.done:
            self.completed_at = int(time.time())
            self.finished_at = trio.current_time()
            self._wake()

    def attach(self) -> None:
        self.readers += 1
        self.resumes += 1
        self._wake()

    def detach(self) -> None:
        self.readers -= 1
        self._wake()

    async def read_from(self, offset: int) -> AsyncIterator[bytes]:
        """The bytes from `offset` on, as they come, to the end of the stream; raises
        OffsetLost where the session no longer keeps them (also while reading behind)."""
        while True:
            if offset < self._dropped:
                raise OffsetLost
            end = self.total_bytes
            if offset < end:
                chunk = bytes(self._buffer[offset - self._dropped :])
                offset = end
                yield chunk
                continue
            if self.done:
                return
            await self.changed()

    def describe(self) -> dict[str, Any]:
        """A lookup's entry, as llama-server answers it."""
        return {
            "conversation_id": self.conversation_id,
            "is_done": self.done,
            "total_bytes": self.total_bytes,
            "started_at": self.started_at,
            "completed_at": self.completed_at,
        }


@attrs.define
class StreamSessions:
    """The server's sessions by conversation id: one live one a conversation."""

    resume_s: float  # --stream-resume-s: how long a generation waits for a reader
    keep_s: float = KEEP_DONE_S
    done_bytes: int = DONE_BYTES
    _by_id: dict[str, StreamSession] = attrs.Factory(dict)

    @property
    def enabled(self) -> bool:
        return self.resume_s > 0

    def open(self, conv_id: str, stop: Callable[[str], None]) -> StreamSession:
        """A new session for `conv_id`; the conversation's previous one (a generation
        still running: regenerated, or sent again) is stopped and dropped."""
        self._collect()
        previous = self._by_id.pop(conv_id, None)
        if previous is not None:
            previous.stop(REPLACED)
            previous.finish()
        session = StreamSession(conv_id, int(time.time()), stop)
        self._by_id[conv_id] = session
        return session

    def get(self, conv_id: str) -> StreamSession | None:
        self._collect()
        return self._by_id.get(conv_id)

    def lookup(self, ids: list[str]) -> list[dict[str, Any]]:
        """The sessions of the named conversations (the id itself, or `id::model`): only
        those asked for, so that nobody can list the others'."""
        self._collect()
        out = []
        for wanted in ids:
            prefix = wanted + "::"
            for key, session in self._by_id.items():
                if key == wanted or key.startswith(prefix):
                    out.append(session.describe())
        return out

    def delete(self, conv_id: str) -> None:
        """Stop the conversation's generation and drop its session (a no-op where there
        is none)."""
        session = self._by_id.pop(conv_id, None)
        if session is not None:
            session.stop(STOPPED)
            session.finish()

    def close(self, session: StreamSession) -> None:
        """The session's generation ended: readers see the end. One that never wrote a
        byte (refused before its stream began) is dropped at once."""
        session.finish()
        if session.total_bytes == 0 and self._by_id.get(session.conversation_id) is session:
            del self._by_id[session.conversation_id]

    def _collect(self) -> None:
        """Drop finished sessions older than the keep, then the oldest finished ones
        past DONE_BYTES."""
        now = trio.current_time()
        done = sorted((s for s in self._by_id.values() if s.done), key=lambda s: s.finished_at)
        kept = sum(s.total_bytes - s.dropped for s in done)
        for s in done:
            if now - s.finished_at < self.keep_s and kept <= self.done_bytes:
                break
            kept -= s.total_bytes - s.dropped
            if self._by_id.get(s.conversation_id) is s:
                del self._by_id[s.conversation_id]
