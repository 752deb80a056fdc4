"""The tokenizer and chat template, built from the GGUF file's own metadata.

Two kinds of GGUF vocabulary, each as a `tokenizers` BPE model:
- `gpt2` (SmolLM2, Llama 3, Qwen): byte-level BPE from the file's merges, split first
  by the family's pre-tokenizer.
- `llama` (SentencePiece: Gemma, Llama 2): spaces written as U+2581, pieces merged
  pair by pair, the pair whose merged piece scores highest first (llama.cpp's SPM
  tokenizer), which is BPE with merges ranked by the file's scores; a character no
  piece covers becomes its UTF-8 bytes (`<0xXX>` byte tokens).
Control tokens (GGUF token type 3) become special added tokens, each a single id. The
chat template is the GGUF's Jinja source, rendered in Jinja2's immutable sandbox.
"""

from __future__ import annotations

import array
import contextlib
import datetime
import functools
import hashlib
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
)

from ninfer.engine._contract import (
    THINK_CLOSE,
    ChatText,
    ThinkingSupport,
    opens_thinking,
)
from ninfer.engine._controltext import ControlText
from ninfer.engine._errors import ArtifactError
from ninfer.engine._kept import keep_file, mark_used

__all__ = [
    "ChatTemplate",
    "TextTokenizer",
    "thinking_support",
    "tokenizer_from_metadata",
]

_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_TOKEN_TYPE_BYTE = 6
_SPACE = "\u2581"  # SentencePiece's visible space

# The split before byte-level BPE of the Llama 3 and Qwen 2 families (llama.cpp's
# LLAMA3 and QWEN2 pre-tokenizers; the `pre_tokenizer` regex of their tokenizer.json):
# contractions, letters with one leading non-letter, numbers (up to three digits for
# Llama 3, one for Qwen), punctuation runs, newlines, other whitespace.
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _SPLIT % "{1,3}", "qwen2": _SPLIT % ""}

# GGUF `tokenizer.ggml.pre` values whose pre-tokenization ninfer reproduces.
_PRE_TOKENIZERS = frozenset({"smollm", "gpt2", "default", *_SPLITS})


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, byte_level])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # Digits are split one by one before the GPT-2 regex (as in SmolLM2's tokenizer.json).
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as the templates expect it (transformers' `tojson`): not HTML-escaped, as
    Jinja's own filter would, and keeping non-ASCII text as it is."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    """Today's date for the templates that print it (Llama 3.x: "26 Jul 2024")."""
    return datetime.datetime.now().strftime(fmt)


@attrs.frozen
class ChatTemplate:
    """A Jinja chat template compiled in a sandbox, in the environment the published
    templates are written for (transformers' `apply_chat_template`): an undefined name
    or key is empty rather than an error (Qwen's template asks `if tools`, Llama 3's
    for `date_string`, and every template reads `message.tool_calls` of messages that
    have none), `{% break %}`/`{% continue %}`, `raise_exception`, `strftime_now` and a
    `tojson` that does not HTML-escape."""

    source: str
    _template: jinja2.Template = attrs.field(alias="template")
    bos_token: str
    eos_token: str
    controls: ControlText = attrs.field(factory=lambda: ControlText.of({}))

    @classmethod
    def from_source(
        cls,
        source: str,
        *,
        bos_token: str,
        eos_token: str,
        controls: ControlText | None = None,
    ) -> ChatTemplate:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ArtifactError(f"the GGUF chat template does not compile: {exc}") from exc
        return cls(
            source=source,
            template=template,
            bos_token=bos_token,
            eos_token=eos_token,
            controls=controls or ControlText.of({}),
        )

    @property
    def writes_tool_calls(self) -> bool:
        """Whether the template offers tools and writes calls in the Hermes markup ninfer
        reads (`<tool_call>`, as Qwen 2.5's): then it is given the tools and tool turns
        itself; other templates get ninfer's generic tool section (docs/api.md)."""
        return "tools" in self.source and "<tool_call>" in self.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Render the conversation (`tools`: the functions offered, in OpenAI's shape, for
        a template that describes them itself; `variables`: more names the template may
        read, as transformers' chat_template_kwargs); a template error becomes
        ValueError."""
        try:
            return self._template.render(
                **(variables or {}),
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=list(tools) if tools else None,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> ChatText:
        """`render` with every string of the messages and tools escaped (client text:
        see `_controltext`), for `TextTokenizer.encode_chat`."""
        escape = self.controls.escape_all
        return ChatText(
            self.render(
                [escape(dict(m)) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=[escape(dict(t)) for t in tools] if tools else None,
                variables=variables,
            )
        )

    @functools.cached_property
    def thinking(self) -> ThinkingSupport | None:
        """How the template handles reasoning, found by rendering it (once): see
        `thinking_support`."""
        return thinking_support(self)


def thinking_support(template: ChatTemplate) -> ThinkingSupport | None:
    """What `template` does with reasoning, by rendering a short conversation: a
    template whose prompt changes with `enable_thinking` (Qwen 3's), or whose reply
    begins inside `<think>` (DeepSeek-R1's distills, QwQ), supports thinking; it
    preserves closed turns' reasoning if `preserve_thinking` (or `preserved_thinking`)
    brings an earlier turn's reasoning into the prompt. None for any other template, and
    for one that fails on this conversation."""
    asked = [{"role": "user", "content": "q"}]
    try:
        on = template.render(asked, variables={"enable_thinking": True})
        off = template.render(asked, variables={"enable_thinking": False})
    except ValueError:
        return None
    # Off, the prompt closes the reasoning it would open (Qwen 3: an empty block).
    switch = off.count(THINK_CLOSE) > on.count(THINK_CLOSE)
    opens = opens_thinking(on)
    if not (switch or opens):
        return None
    marker = "reasoning-of-an-earlier-turn"
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": marker, "thinking": marker},
        {"role": "user", "content": "r"},
    ]
    names = {"preserve_thinking": True, "preserved_thinking": True}
    try:
        kept = template.render(history, variables=names)
        dropped = template.render(
            history, variables={"preserve_thinking": False, "preserved_thinking": False}
        )
    except ValueError:
        kept = dropped = ""
    return ThinkingSupport(
        switch=switch, opens=opens, preserve=marker in kept and marker not in dropped
    )


# Texts longer than this many characters are encoded with encode_batch (measured
# here: the other threads' worst wait during a 900 KB encode, 26 ms with encode and
# 9 ms with encode_batch).
_LONG_TEXT = 4096
# `exceeds` counts a text in pieces of about this many characters (a few thousand
# tokens: a hopeless text is given up on within a piece of passing the limit).
PIECE_CHARS = 16384


@attrs.frozen
class TextTokenizer:
    """Text <-> token ids for one model, plus its special ids and chat template."""

    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    bos_id: int | None
    chat_template: ChatTemplate | None
    vocab_size: int
    # The most UTF-8 bytes one token covers (an upper bound): a text of more than
    # max_token_bytes * N bytes has more than N tokens, which is known before encoding.
    max_token_bytes: int = 1 << 16
    # Each token's bytes (a byte-level token may hold part of a UTF-8 character).
    spellings: tuple[bytes, ...] = ()
    # Whether a prompt starts with the BOS token (the file's tokenizer.ggml.add_bos_token;
    # added once: a chat template that writes it already is not given a second).
    add_bos: bool = False
    # Whether a text cut before a space that follows a letter or a digit encodes as its
    # two pieces do (`exceeds` counts in such pieces): true of the byte-level BPE
    # pre-tokenizers ninfer builds (GPT-2's, SmolLM2's, Llama 3's, Qwen 2's regexes),
    # where whitespace only ever begins a pre-token and merges never cross one; not of
    # SentencePiece, whose merges may cross spaces (its texts are counted whole).
    pieces_at_spaces: bool = False
    # The control tokens' texts. The tokenizer reads them as plain text
    # (`encode_special_tokens`): a text is split at them here first, where they are
    # meant (a raw prompt's, a chat template's), so one tokenizer serves both (for
    # Gemma 3's 262k vocabulary a second one was ~95 MB and ~1 s of start-up).
    controls: ControlText = attrs.field(factory=lambda: ControlText.of({}))

    def __attrs_post_init__(self) -> None:
        self.tokenizer.encode_special_tokens = True

    def token_bytes(self, token_id: int) -> bytes:
        return self.spellings[token_id]

    def encode(self, text: str) -> list[int]:
        """A prompt's ids, its control tokens' texts read as those tokens, with the BOS
        token first when the model wants one."""
        return self._with_bos(self._encode_parts(self._parts(text, special=True)))

    def encode_chat(self, chat: ChatText) -> list[int]:
        """A rendered chat's ids: split at the control tokens its template wrote (client
        text was escaped before rendering), the text between encoded with control
        tokens not recognised."""
        return self._with_bos(self._encode_parts(self._parts(chat)))

    def _parts(self, prompt: str | ChatText, *, special: bool = True) -> list[str | int]:
        """A prompt as its texts and control tokens, as the encode methods take it: a
        chat split at its template's controls; a text at its own (`special`) or whole."""
        if isinstance(prompt, ChatText):
            return self.controls.split(prompt.text)
        return self.controls.split(prompt, escaped=False) if special else [prompt]

    def exceeds(self, prompt: str | ChatText, limit: int, *, special: bool = True) -> bool:
        """Whether the prompt's ids (`encode_chat`'s, or `encode`'s / `encode_plain`'s by
        `special`) are more than `limit`: its texts counted in pieces (PIECE_CHARS, cut
        where the pre-tokenizer always cuts: `pieces_at_spaces`), stopping as soon as the
        count passes `limit`; the same answer as counting the ids, in about `limit`
        tokens' worth of work for a text far over it."""
        parts = self._parts(prompt, special=special)
        count = 1 if self.add_bos and self.bos_id is not None and parts[:1] != [self.bos_id] else 0
        if count > limit:  # the BOS token alone (an empty text has no part)
            return True
        for part in parts:
            pieces = self._pieces(part) if isinstance(part, str) else [part]
            for piece in pieces:
                # a piece is up to PIECE_CHARS: encode_batch, which lets other threads run
                # while it works (`encode` holds the interpreter lock ~15 ms a piece, and a
                # stream's steps on the engine thread waited for it)
                count += (
                    1
                    if isinstance(piece, int)
                    else len(self.tokenizer.encode_batch([piece], add_special_tokens=False)[0].ids)
                )
                if count > limit:
                    return True
        return False

    def _pieces(self, text: str) -> Iterator[str]:
        """`text` in pieces of about PIECE_CHARS that encode as the whole does: each cut
        just before a space that follows a letter or a digit (a text with none, or a
        tokenizer without `pieces_at_spaces`: whole)."""
        start = 0
        while self.pieces_at_spaces and len(text) - start > PIECE_CHARS:
            cut = text.find(" ", start + PIECE_CHARS)
            while cut != -1 and not text[cut - 1].isalnum():
                cut = text.find(" ", cut + 1)
            if cut == -1:
                break
            yield text[start:cut]
            start = cut
        yield text[start:]

    def chat_prompt(self, chat: ChatText) -> str:
        """A rendered chat as text, the client's strings unescaped."""
        return self.controls.unescape(chat.text)

    def encode_plain(self, text: str) -> list[int]:
        """`text`'s ids, control tokens' texts read as plain text, with the BOS token
        first when the model wants one."""
        return self._with_bos(self._encode_parts([text]))

    def _encode_parts(self, parts: list[str | int]) -> list[int]:
        texts = [p for p in parts if isinstance(p, str)]
        if len(parts) == 1 and len(texts) == 1 and len(texts[0]) <= _LONG_TEXT:
            return list(self.tokenizer.encode(texts[0], add_special_tokens=False).ids)
        # encode_batch releases the interpreter lock: other threads run more often
        encoded = iter(
            self.tokenizer.encode_batch(texts, add_special_tokens=False) if texts else ()
        )
        ids: list[int] = []
        for p in parts:
            ids.extend([p] if isinstance(p, int) else next(encoded).ids)
        return ids

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def count(self, text: str) -> int:
        return len(self.encode(text))


def _byte_level_model(md: Mapping[str, Any], vocab: dict[str, int]) -> Tokenizer:
    """GPT-2-style byte-level BPE from the file's merges and pre-tokenizer name."""
    pre = str(md.get("tokenizer.ggml.pre", "default"))
    if pre not in _PRE_TOKENIZERS:
        raise ArtifactError(
            f"unsupported pre-tokenizer {pre!r}; ninfer reads: "
            + ", ".join(sorted(_PRE_TOKENIZERS))
        )
    merges: list[tuple[str, str]] = []
    for m in md.get("tokenizer.ggml.merges") or []:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ArtifactError(f"malformed BPE merge in GGUF metadata: {m!r}")
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _score_merges(
    tokens: list[str], types: list[int], scores: list[float]
) -> list[tuple[int, int]]:
    """SentencePiece's merge order as BPE merges, as the ids of their two halves: every
    split of a mergeable piece into two pieces of the vocabulary, ranked by the merged
    piece's score (highest first), then by the vocabulary order of the merged piece and
    of its halves.

    The pieces are put in that order first and each one's few splits sorted among
    themselves, rather than every split of the vocabulary sorted at once and unpacked
    (Gemma 3's 262,144 pieces give 514,847 merges: 1.23 s against 1.45 s, medians of
    five starts taking turns on the 2-core machine)."""
    mergeable = {
        t: i
        for i, t in enumerate(tokens)
        if types[i] in (_TOKEN_TYPE_NORMAL, _TOKEN_TYPE_USER_DEFINED)
    }
    get = mergeable.get
    order = sorted((-scores[i], i, piece) for piece, i in mergeable.items() if len(piece) > 1)
    merges: list[tuple[int, int]] = []
    for _, _, piece in order:
        splits: list[tuple[int, int]] = []
        for cut in range(1, len(piece)):
            li = get(piece[:cut])
            if li is not None:
                ri = get(piece[cut:])
                if ri is not None:
                    splits.append((li, ri))
        if len(splits) > 1:
            splits.sort()
        merges += splits
    return merges


# What a kept merge order is (`_kept_merges`): bumped when _score_merges changes.
_MERGES_VERSION = b"ninfer score merges 1"
# Merge orders kept, the most recently used.
KEPT_MERGES = 16


def _kept_merges(
    tokens: list[str], types: list[int], scores: list[float], where: str | None
) -> list[tuple[int, int]]:
    """_score_merges, kept under `where` (a directory) by a hash of the vocabulary, its
    types and scores: Gemma 3's 514,847 merges took 1.2 s of each start, read back in
    ~0.05 s. A file of another length or with an id outside the vocabulary is not
    believed (computed again and written over)."""
    if where is None:
        return _score_merges(tokens, types, scores)
    h = hashlib.sha256(_MERGES_VERSION)
    h.update(len(tokens).to_bytes(8, "little"))
    h.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    h.update(array.array("q", types).tobytes())
    h.update(array.array("d", scores).tobytes())
    path = Path(where) / f"{h.hexdigest()[:32]}.merges"
    with contextlib.suppress(OSError, ValueError):
        ids = np.fromfile(path, dtype="<i4")
        if len(ids) >= 1 and len(ids) == 1 + 2 * int(ids[0]):
            pairs = ids[1:]
            if len(pairs) == 0 or (int(pairs.min()) >= 0 and int(pairs.max()) < len(tokens)):
                mark_used(path)
                it = iter(pairs.tolist())
                return list(zip(it, it, strict=True))
    merges = _score_merges(tokens, types, scores)
    data = np.asarray([len(merges), *itertools.chain.from_iterable(merges)], dtype="<i4")
    with contextlib.suppress(OSError):  # not kept: the next start ranks them again
        keep_file(path, data.tobytes(), keep=KEPT_MERGES)
    return merges


def _sentencepiece_model(
    md: Mapping[str, Any],
    vocab: dict[str, int],
    tokens: list[str],
    types: list[int],
    merges_kept: str | None = None,
) -> Tokenizer:
    """A SentencePiece vocabulary (llama.cpp's SPM) as BPE ranked by scores, bytes as
    the fallback; a leading space added when the file says so (Llama 2 does, Gemma not)."""
    scores = [float(x) for x in md.get("tokenizer.ggml.scores") or []]
    if len(scores) != len(tokens):
        raise ArtifactError("GGUF metadata has no score for each SentencePiece token")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[
                (tokens[a], tokens[b]) for a, b in _kept_merges(tokens, types, scores, merges_kept)
            ],
            byte_fallback=True,
            fuse_unk=False,
        )
    )
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    steps: list[normalizers.Normalizer] = [normalizers.Prepend(_SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    undo: list[decoders.Decoder] = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *undo]
    )
    return tok


def _spm_spelling(token: str, kind: int) -> bytes:
    if kind == _TOKEN_TYPE_BYTE and len(token) == 6 and token.startswith("<0x"):
        return bytes([int(token[3:5], 16)])
    if kind == _TOKEN_TYPE_CONTROL:
        return token.encode("utf-8")
    return token.replace(_SPACE, " ").encode("utf-8")


def tokenizer_from_metadata(
    md: Mapping[str, Any], *, chat_template: str | None = None, merges_kept: str | None = None
) -> TextTokenizer:
    """Build the tokenizer of a GGUF file; an unsupported kind is an error that names it.
    `merges_kept`: a directory where a SentencePiece vocabulary's merge order is kept."""
    kind = md.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ArtifactError(
            f"unsupported tokenizer type {kind!r}; ninfer reads byte-level BPE ('gpt2') "
            "and SentencePiece ('llama')"
        )
    tokens: list[str] = list(md.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ArtifactError("GGUF metadata has no tokenizer.ggml.tokens")
    types: list[int] = list(md.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if kind == "gpt2":
        tok = _byte_level_model(md, vocab)
    else:
        tok = _sentencepiece_model(md, vocab, tokens, types, merges_kept)
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t == _TOKEN_TYPE_CONTROL
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == _TOKEN_TYPE_USER_DEFINED
    ]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    controls = ControlText.of(
        {tokens[i]: i for i, t in enumerate(types) if t == _TOKEN_TYPE_CONTROL}
    )

    eos = md.get("tokenizer.ggml.eos_token_id")
    bos = md.get("tokenizer.ggml.bos_token_id")
    eos_ids = {int(eos)} if eos is not None else set()
    eot = md.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.add(int(eot))
    # ChatML models keep writing a new fake turn after <|im_end|>; <|endoftext|> ends
    # a document. Both end generation when present as control tokens.
    # Gemma ends a turn with <end_of_turn>.
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>"):
        i = vocab.get(name)
        if i is not None and types[i] == _TOKEN_TYPE_CONTROL:
            eos_ids.add(i)
    if not eos_ids:
        raise ArtifactError("GGUF metadata names no end-of-sequence token")

    template_src = chat_template or md.get("tokenizer.chat_template")
    template = None
    if template_src:
        template = ChatTemplate.from_source(
            str(template_src),
            bos_token=tokens[int(bos)] if bos is not None else "",
            eos_token=tokens[int(eos)] if eos is not None else "",
            controls=controls,
        )
    spellings = tuple(
        _spm_spelling(t, types[i])
        if kind == "llama"
        else t.encode("utf-8")
        if types[i] == _TOKEN_TYPE_CONTROL
        else _byte_level(t)
        for i, t in enumerate(tokens)
    )
    return TextTokenizer(
        tokenizer=tok,
        controls=controls,
        eos_ids=frozenset(eos_ids),
        bos_id=int(bos) if bos is not None else None,
        chat_template=template,
        vocab_size=len(tokens),
        pieces_at_spaces=kind != "llama",
        spellings=spellings,
        # the most bytes a token spells: each token covers that many of the text's at most
        max_token_bytes=max(map(len, spellings)),
        # llama.cpp's defaults: SentencePiece vocabularies and Llama 3's start with BOS.
        add_bos=bool(
            md.get(
                "tokenizer.ggml.add_bos_token",
                kind == "llama" or md.get("tokenizer.ggml.pre") == "llama-bpe",
            )
        ),
    )


def _byte_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is spelled with, reversed."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_OF = _byte_unicode()


def _byte_level(token: str) -> bytes:
    """A byte-level BPE token's bytes (a character outside the alphabet as UTF-8)."""
    out = bytearray()
    for ch in token:
        b = _BYTE_OF.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)
