"""Admission scheduling in pure Trio: bounded capacity, FIFO waiting, units, no LLM knowledge."""

from __future__ import annotations

from scheduler._admission import AdmissionController, SchedulerStatistics, Ticket
from scheduler._errors import Overloaded, SchedulerError

__all__ = ["AdmissionController", "Overloaded", "SchedulerError", "SchedulerStatistics", "Ticket"]
