"""Compiling an answer's grammar: a structured output's JSON schema, or a request's tools
(with the format's schema), after a reasoning block when the request thinks; on a worker
thread (a large schema takes llguidance hundreds of milliseconds: on the event loop, or
on the engine's thread, that would be a stall), down to the engine's own matcher where
the engine compiles grammars."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import trio

from ninfer.engine import CompiledGrammar
from ninfer.frontends._structured import UNENFORCEABLE, json_schema_grammar
from ninfer.frontends._tools import ToolPlan, tool_grammar
from protocols import ApiError

__all__ = ["Grammar", "GrammarCompiler"]

Grammar = str | CompiledGrammar


@attrs.frozen
class GrammarCompiler:
    """The grammars of one served model: `compile_grammar` is the engine's (None: it
    takes grammars as text); `limiter` bounds the worker threads, shared with those
    that tokenize long texts."""

    compile_grammar: Callable[[str], CompiledGrammar] | None
    limiter: trio.CapacityLimiter

    async def schema(self, schema: dict[str, Any], param: str, think: bool = False) -> Grammar:
        """A structured output's grammar (`param`: where the schema is, for refusals)."""
        return await trio.to_thread.run_sync(
            lambda: self._for_engine(json_schema_grammar(schema, param=param, think=think), param),
            limiter=self.limiter,
        )

    async def tools(
        self,
        plan: ToolPlan,
        text_schema: dict[str, Any] | None,
        text_param: str,
        think: bool = False,
    ) -> Grammar:
        """The grammar of an answer that may call tools, likewise."""
        return await trio.to_thread.run_sync(
            lambda: self._for_engine(
                tool_grammar(plan, text_schema, text_param, think=think), "tools"
            ),
            limiter=self.limiter,
        )

    def _for_engine(self, grammar: str, param: str) -> Grammar:
        """`grammar` compiled for the engine, when it compiles (on this worker thread)."""
        if self.compile_grammar is None:
            return grammar
        try:
            return attrs.evolve(self.compile_grammar(grammar), param=param)
        except ValueError:
            raise ApiError(
                "invalid_request", UNENFORCEABLE, param=param, code="invalid_value"
            ) from None
