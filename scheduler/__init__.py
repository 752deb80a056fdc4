"""Admission scheduling in pure Trio: bounded capacity, FIFO waiting, units, no LLM knowledge."""

from __future__ import annotations

from scheduler._admission import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    TOKEN_GRACE_S,
    AdmissionController,
    SchedulerStatistics,
    ServiceTime,
    Ticket,
)
from scheduler._errors import Overloaded, SchedulerError

__all__ = [
    "RETRY_AFTER_MAX_S",
    "RETRY_AFTER_MIN_S",
    "TOKEN_GRACE_S",
    "AdmissionController",
    "Overloaded",
    "SchedulerError",
    "SchedulerStatistics",
    "ServiceTime",
    "Ticket",
]
