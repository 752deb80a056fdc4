"""A request's row in the engine: what it has been given and what it has produced, its
stop rules, and the events it sends.

The engine decides when a row runs and which pages it holds; the row decides what a
token means for it (`accept`: the stop rules, in one order: an end-of-sequence token,
a stop string or a finished grammar, the output budget, the context window), what it
sends after a step (`delta`) and how it ends (`final_delta`, `finish`). It touches no
page, no tensor of the model and no counter of the engine's.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

import attrs
import torch

from ninfer.engine._contract import (
    Embedding,
    EngineTimings,
    Finish,
    FinishReason,
    GenerationRequest,
    PromptProgress,
    RequestHandle,
    TokenDelta,
    TokenLogprob,
    Usage,
    misfit,
    reserved_pages,
)
from ninfer.engine._errors import RequestInvalid
from ninfer.engine._kvpool import pages_for
from ninfer.engine._loader import LoadedModel
from ninfer.engine._sampling import RowSampler, logprobs_of
from ninfer.engine._speculative import RowSpeculation
from ninfer.engine._textstream import TextStream

__all__ = ["Row", "check_request", "draft_group", "plain_group"]

Group = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # tokens, positions, page table


def check_request(
    request: GenerationRequest, *, vocab: int, max_context: int, kv_pages: int, page_size: int
) -> None:
    """Raise RequestInvalid when `request` can never run on an engine of these limits."""
    n = len(request.prompt_ids)
    if n == 0:
        raise RequestInvalid("the prompt has no tokens", param="prompt")
    if request.embed is not None:
        if request.max_new_tokens != 0:
            raise RequestInvalid("an embedding request samples no token", param="max_new_tokens")
    elif request.max_new_tokens < 1:
        raise RequestInvalid("max_new_tokens must be at least 1", param="max_new_tokens")
    if any(t < 0 or t >= vocab for t in request.prompt_ids):
        raise RequestInvalid("a prompt token id is outside the vocabulary", param="prompt")
    wrong = misfit(n, request.max_new_tokens, max_context=max_context, kv_pages=kv_pages,
                   page_size=page_size)  # fmt: skip
    if wrong is not None and wrong.limit == "context":
        raise RequestInvalid(
            f"prompt ({n} tokens) plus max_new_tokens ({request.max_new_tokens}) "
            f"exceeds the context window of {max_context} tokens",
            param="max_new_tokens",
        )
    reserve = request.reserve_tokens
    if (
        reserve is not None
        and not min(1, request.max_new_tokens) <= reserve <= request.max_new_tokens
    ):
        raise RequestInvalid("reserve_tokens must be 1..max_new_tokens", param="max_new_tokens")
    if wrong is not None:
        raise RequestInvalid(
            f"prompt plus max_new_tokens needs {wrong.pages} KV pages; the pool has {kv_pages}",
            param="max_new_tokens",
        )


@attrs.define(eq=False)
class Row:
    handle: RequestHandle
    request: GenerationRequest
    sampler: RowSampler
    text: TextStream
    submitted: float  # time.perf_counter()
    pages: list[int] = attrs.field(factory=list)
    prefilled: int = 0  # prompt tokens in the cache
    position: int = 0  # next position to write
    last_token: int = -1
    generated: int = 0
    prefill_start: float = 0.0
    decode_start: float = 0.0
    pending_ids: list[int] = attrs.field(factory=list)
    output_ids: list[int] = attrs.field(factory=list)  # every token sampled
    paused: bool = False  # its reader is far behind: left out of decode steps until it reads
    cached: int = 0  # prompt tokens whose pages were shared from the prefix cache
    # Its pages from this index on are not zeroed yet: each is zeroed by the prefill pass
    # that first writes it, the output's with the prompt's last pass (`Engine._zero_ahead`).
    zeroed_to: int = 0
    page_keys: list[bytes] = attrs.field(factory=list)  # of the prompt's full pages
    delivered: bool = False  # a TokenDelta has been sent (the first carries `cached`)
    pending_lps: list[TokenLogprob] = attrs.field(factory=list)  # of pending_ids, if asked
    prompt_lps: list[TokenLogprob | None] | None = None  # when prompt_logprobs is asked
    spec: RowSpeculation | None = None  # its drafting, when the engine speculates
    # An embedding request's final-norm states, (T, dim) float32 a prefill pass, of the
    # positions its pooling reads (`keep_states`)
    states: list[torch.Tensor] = attrs.field(factory=list)
    embedded: Embedding | None = None  # its vector(s), once computed (`embedding`)

    @classmethod
    def create(
        cls,
        handle: RequestHandle,
        request: GenerationRequest,
        submitted: float,
        model: LoadedModel,
        *,
        native_top_p: bool,
        native_top_k: bool = False,
        native_sample: bool = False,
        draft_tokens: int,
    ) -> Row:
        """A new row of `request` on `model`: its sampler, its text stream, and its
        drafting when the engine speculates (`draft_tokens` > 0). Its grammar, if any, is
        the engine's to give (`sampler.constraint`)."""
        row = cls(
            handle=handle,
            request=request,
            sampler=RowSampler.create(
                request.sampling,
                model.identity.vocab_size,
                native_top_p=native_top_p,
                native_top_k=native_top_k,
                native_sample=native_sample,
            ),
            text=TextStream(decode=model.tokenizer.decode, stops=request.stop),
            submitted=submitted,
        )
        if draft_tokens > 0:
            row.spec = RowSpeculation(window=draft_tokens, history=request.prompt_ids)
        return row

    # ---- what a token means for it ----------------------------------------------------

    def accept(
        self, token: int, scored: TokenLogprob | None, *, eos_ids: Collection[int], max_context: int
    ) -> FinishReason | None:
        """Record a sampled token (its position already counted) and apply the stop
        rules: the reason it ends with, or None when it goes on. Raises what the
        grammar raises (GrammarLimitReached); the engine ends the row for it."""
        req = self.request
        self.generated += 1
        self.last_token = token
        self.pending_ids.append(token)
        self.output_ids.append(token)
        self.sampler.observe(token)
        if token in eos_ids and not req.ignore_eos:
            return "eos"  # its logprob is not reported: it is no text
        if scored is not None:
            self.pending_lps.append(scored)
        self.text.push(token)
        if self.text.stopped_at is not None or self.sampler.grammar_done:
            return "stop"  # a stop string, or the grammar is complete
        if self.generated >= req.max_new_tokens:
            return "length"
        if self.position + 1 > max_context:
            return "context"
        return None

    def logprob(self, row: torch.Tensor, token: int) -> TokenLogprob | None:
        """`token`'s log probability (and the top ones) from its (V,) logits, if asked."""
        k = self.request.logprobs
        return None if k is None else logprobs_of(row, token, k)

    def score_prompt(self, start: int, logits: torch.Tensor) -> None:
        """Log probabilities of the prompt tokens a chunk's (T, V) logits predict."""
        assert self.prompt_lps is not None
        assert self.request.prompt_logprobs is not None
        prompt = self.request.prompt_ids
        for i in range(logits.shape[0]):
            if start + i + 1 < len(prompt):
                token = prompt[start + i + 1]
                self.prompt_lps.append(logprobs_of(logits[i], token, self.request.prompt_logprobs))

    def keep_states(self, start: int, states: torch.Tensor) -> None:
        """Keep what its pooling reads of a pass's (T, dim) final-norm states for prompt
        positions start.. (all of them for mean and none, else the one it takes)."""
        assert self.request.embed is not None
        pooling = self.request.embed.pooling
        if pooling == "cls":
            if start == 0:
                self.states = [states[:1].float().cpu()]
        elif pooling == "last":
            if start + states.shape[0] == len(self.request.prompt_ids):
                self.states = [states[-1:].float().cpu()]
        else:
            self.states.append(states.float().cpu())

    def embedding(self) -> Embedding:
        """Its vector(s) from the kept states, once its whole prompt is computed: pooled
        and normalized in float64 over the prompt's states in order (so the same bits
        however its prompt was cut into passes), as float32."""
        assert self.request.embed is not None
        spec = self.request.embed
        states = torch.cat(self.states).double()  # (T or 1, dim)
        self.states = []
        if spec.pooling == "none":
            out = states  # llama.cpp normalizes no per-token state
        else:
            pooled = states.mean(dim=0, keepdim=True) if spec.pooling == "mean" else states
            out = pooled * _norm_scale(pooled[0], spec.normalize)
        values = out.float().contiguous()
        return Embedding(values.numpy().astype("<f4").tobytes(), values.shape[0], values.shape[1])

    def draft_limit(self, max_context: int) -> int:
        """The most tokens it may draft: within its budget (the round's last token
        included) and the context."""
        return min(
            self.spec.window if self.spec is not None else 0,
            self.request.max_new_tokens - self.generated - 1,
            max_context - 1 - self.position,
        )

    # ---- its pages, as the engine lays them out ----------------------------------------

    def reserved_pages(self, page_size: int) -> int:
        """The pages it holds from the start of its prefill (`reserved_pages`)."""
        return reserved_pages(len(self.request.prompt_ids), self.request.reserved_tokens, page_size)

    def page_row(self, width: int) -> list[int]:
        """Its first `width` pages, filled up with the always-zero page 0."""
        return self.pages[:width] + [0] * (width - min(width, len(self.pages)))

    def chunk_group(self, chunk: Sequence[int], page_size: int, device: str) -> Group:
        """Its next prompt `chunk` as a (1, T) prefill group, over its pages so far."""
        end = self.prefilled + len(chunk)
        return (
            torch.tensor([chunk], device=device),
            torch.arange(self.prefilled, end, device=device).view(1, -1),
            torch.tensor([self.pages[: pages_for(end, page_size)]], device=device),
        )

    def written(self) -> list[int]:
        """The tokens whose keys and values are in its pages: prompt, then output."""
        return [*self.request.prompt_ids, *self.output_ids][: self.position]

    # ---- what it sends ------------------------------------------------------------------

    def delta(self, text: str) -> TokenDelta:
        """The step's TokenDelta: its pending tokens and the text they complete (the
        first also carries the cached prompt tokens and the prompt's logprobs)."""
        first = not self.delivered
        self.delivered = True
        decode_start = self.decode_start or time.perf_counter()
        delta = TokenDelta(
            tuple(self.pending_ids),
            text,
            self.cached if first else None,
            tuple(self.pending_lps) if self.request.logprobs is not None else None,
            tuple(self.prompt_lps) if first and self.prompt_lps is not None else None,
            prefill_s=decode_start - (self.prefill_start or decode_start),
            decode_s=time.perf_counter() - decode_start,
        )
        self.pending_ids = []
        self.pending_lps = []
        return delta

    def progress(self) -> PromptProgress:
        """Where its prefill stands (for a request that asked: `request.progress`)."""
        return PromptProgress(
            total=len(self.request.prompt_ids),
            cached=self.cached,
            processed=self.prefilled,
            elapsed_s=time.perf_counter() - (self.prefill_start or time.perf_counter()),
        )

    def step_delta(self) -> TokenDelta:
        """The delta after a step it goes on from (text held back where a stop string
        may yet begin)."""
        return self.delta(self.text.take(final=False))

    def final_delta(self, reason: FinishReason) -> TokenDelta | None:
        """What is left to send as it ends for `reason` (nothing for a cancelled or
        failed row, whose text goes nowhere)."""
        if reason in ("cancelled", "error"):
            self.pending_ids = []
            return None
        text = self.text.take(final=True)
        if not self.pending_ids and not text:
            return None
        return self.delta(text)

    def finish(self, reason: FinishReason, error: str | None, speculative: str) -> Finish:
        """Its one Finish event (`speculative`: the engine's backend, for the counts)."""
        now = time.perf_counter()
        start = self.prefill_start or now
        decode_start = self.decode_start or now
        return Finish(
            reason=reason,
            usage=Usage(len(self.request.prompt_ids), self.generated, self.cached),
            timings=EngineTimings(
                wait_s=start - self.submitted,
                prefill_s=decode_start - start,
                decode_s=now - decode_start,
            ),
            seed=self.sampler.seed if not self.request.sampling.greedy else None,
            stop_string=self.text.stop_string if reason == "stop" else None,
            error=error,
            speculative=self.spec.counts(speculative) if self.spec is not None else None,
            embedding=self.embedded if reason == "embedded" else None,
        )


def _norm_scale(v: torch.Tensor, p: int) -> float:
    """What a vector is multiplied by for llama.cpp's embd_normalize `p` (its
    common_embd_normalize: -1 none, 0 max absolute to int16's range, 2 euclidean, else
    the p-norm); 0 for a zero vector."""
    if p < 0:
        return 1.0
    big = v.abs()
    total = float(big.max()) / 32760.0 if p == 0 else float(big.pow(p).sum()) ** (1.0 / p)
    return 1.0 / total if total > 0.0 else 0.0


# ---- rows as a pass's inputs ------------------------------------------------------------


def plain_group(rows: list[Row], page_size: int, device: str, padded: int, scratch: int) -> Group:
    """Rows decoding one token each as one (padded, 1) group: each row's last token at
    its position; then padding rows (see _invariance), token 0 at position 0, writing
    the `scratch` page."""
    width = max(pages_for(a.position + 1, page_size) for a in rows)
    table = [a.page_row(width) for a in rows]
    tokens_in = [[a.last_token] for a in rows]
    positions = [[a.position] for a in rows]
    pad = padded - len(rows)
    table += [[scratch] + [0] * (width - 1)] * pad
    tokens_in += [[0]] * pad
    positions += [[0]] * pad
    return (
        torch.tensor(tokens_in, device=device),  # (padded, 1)
        torch.tensor(positions, device=device),  # (padded, 1)
        torch.tensor(table, device=device),  # (padded, width)
    )


def draft_group(rows: list[tuple[Row, list[int]]], page_size: int, device: str) -> Group:
    """Rows and their drafts (of one length k) as one (n, k + 1) group: each row's last
    token, then its draft."""
    T = len(rows[0][1]) + 1
    width = max(pages_for(a.position + T, page_size) for a, _ in rows)
    return (
        torch.tensor([[a.last_token, *d] for a, d in rows], device=device),
        torch.tensor([list(range(a.position, a.position + T)) for a, _ in rows], device=device),
        torch.tensor([a.page_row(width) for a, _ in rows], device=device),
    )
