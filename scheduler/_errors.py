"""Errors of the admission scheduler.

SchedulerError
└── Overloaded      lifetime capacity is full: refuse at once (HTTP 429), retry later
"""

from __future__ import annotations

__all__ = ["Overloaded", "SchedulerError"]


class SchedulerError(Exception):
    """Base of the scheduler's errors."""


class Overloaded(SchedulerError):
    """Every place (running plus pending) is taken. `retry_after` is the estimate, in
    seconds, of when a place will be free for this caller; `token` names the promise
    of that place, when one is held (a retry that returns it claims that place)."""

    def __init__(self, retry_after: float, token: str | None = None) -> None:
        super().__init__(f"server is at capacity; retry after {retry_after:.3f}s")
        self.retry_after = retry_after
        self.token = token
