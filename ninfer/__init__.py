"""ninfer: an LLM inference server that admits what it can serve and refuses the rest at once.

`import ninfer` stays light (no torch): the engine and model modules import torch
and are loaded only by the server and the CLI commands that need them.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
