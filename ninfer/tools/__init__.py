"""Clients that never run inside the server: `ninfer bench` (`_bench`), `ninfer probe`
(`_probes`) and `ninfer logs` (`_logtools`, `_logplot`). They load no torch."""

from __future__ import annotations
