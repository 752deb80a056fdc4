"""Clients that never run inside the server: `ninfer bench` (`_bench`), `ninfer probe`
(`_probes`), `ninfer logs` (`_logs`, over `_logtools` and `_logplot`) and `ninfer
openapi` (`_openapi`). They load no torch. Each adds its own command to `ninfer`'s
parser (`add_command`); its flags' value types are in `_args`."""

from __future__ import annotations

from ninfer.tools import _bench, _logs, _openapi, _probes

__all__ = ["TOOLS"]

# In the order `ninfer --help` lists them, after the server's own (fetch-model, serve).
TOOLS = (_logs.add_command, _probes.add_command, _openapi.add_command, _bench.add_command)
