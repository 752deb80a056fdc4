"""The shapes of successful answers and stream events, per protocol, for the OpenAPI
document. The tests validate every answer the servers produce against these (strictly:
no field beyond them), so the document cannot drift from what is sent."""

from __future__ import annotations

from typing import Any, Literal

import attrs

__all__ = [
    "ANTHROPIC_STREAM_EVENTS",
    "NATIVE_STREAM_EVENTS",
    "RESPONSES_STREAM_EVENTS",
    "AnthropicError",
    "AnthropicErrorBody",
    "AnthropicErrorDetails",
    "AnthropicStop",
    "AnthropicUsage",
    "AssistantMessage",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatDelta",
    "ChatFinish",
    "ChatLogprobs",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionChunkChoice",
    "CompletionLogprobs",
    "CompletionTokensDetails",
    "ContentBlockDelta",
    "ContentBlockStart",
    "ContentBlockStop",
    "ContentPartEvent",
    "CountTokensResponse",
    "FunctionCall",
    "FunctionCallArgumentsDeltaEvent",
    "FunctionCallArgumentsDoneEvent",
    "FunctionCallDelta",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "GenerateResponse",
    "IncompleteDetails",
    "InputItemList",
    "InputJsonDelta",
    "InputMessage",
    "InputText",
    "InputTokensCount",
    "InputTokensDetails",
    "LlamaTimings",
    "MessageDelta",
    "MessageResponse",
    "MessageStart",
    "MessageStop",
    "ModelCard",
    "ModelList",
    "ModelMeta",
    "NativeDoneEvent",
    "NativeError",
    "NativeErrorBody",
    "NativeFinish",
    "NativeModel",
    "NativeTokenEvent",
    "OpenAIError",
    "OpenAIErrorBody",
    "OpenAIFinish",
    "OpenAIUsage",
    "OutputItemEvent",
    "OutputMessage",
    "OutputText",
    "OutputTextDeltaEvent",
    "OutputTextDoneEvent",
    "OutputTokensDetails",
    "Ping",
    "PromptProgressBody",
    "PromptTokensDetails",
    "ReasoningItem",
    "ReasoningText",
    "ReasoningTextDeltaEvent",
    "ReasoningTextDoneEvent",
    "ResponseDeleted",
    "ResponseError",
    "ResponseLifecycleEvent",
    "ResponseObject",
    "ResponseTextConfig",
    "ResponseTextFormat",
    "ResponseUsage",
    "SignatureDelta",
    "StopDelta",
    "StreamMessage",
    "TextBlock",
    "TextDelta",
    "ThinkingBlock",
    "ThinkingDelta",
    "Timing",
    "TokenLogprobEntry",
    "ToolCall",
    "ToolCallDelta",
    "ToolUseBlock",
    "TopLogprob",
    "Usage",
]


def tag(value: str) -> Any:
    """A field the class fixes (`type`, `object`, a role or status that can only be
    one word): set without being passed, and always written (the encoder omits other
    fields left at their default). Every answer class is built with keywords."""
    return attrs.field(default=value, metadata={"tag": True})


NativeFinish = Literal["eos", "stop", "length", "context"]
OpenAIFinish = Literal["stop", "length"]
ChatFinish = Literal["stop", "length", "tool_calls"]
AnthropicStop = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


# ---- native ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class NativeModel:
    id: str
    architecture: str
    sha256: str


@attrs.frozen(kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@attrs.frozen(kw_only=True)
class Timing:
    """Seconds: reading/parsing/tokenizing, waiting, arrival to first token, engine
    prefill and decode time, arrival to last token."""

    prepare: float
    queue: float
    ttft: float
    prefill: float
    decode: float
    total: float


@attrs.frozen(kw_only=True)
class GenerateResponse:
    """The answer to POST /v1/generate without streaming."""

    id: str
    model: NativeModel
    text: str
    token_ids: list[int]
    finish_reason: NativeFinish
    stop_sequence: str | None
    seed: int | None
    usage: Usage
    warnings: list[str]
    timing: Timing


@attrs.frozen(kw_only=True)
class NativeTokenEvent:
    """`event: token`: the tokens of one engine step and the text they complete."""

    token_ids: list[int]
    text: str


@attrs.frozen(kw_only=True)
class NativeDoneEvent:
    """`event: done`: the last event of a native stream."""

    id: str
    model: NativeModel
    finish_reason: NativeFinish
    stop_sequence: str | None
    seed: int | None
    usage: Usage
    warnings: list[str]
    timing: Timing


@attrs.frozen(kw_only=True)
class NativeError:
    type: str
    message: str
    param: str | None
    request_id: str


@attrs.frozen(kw_only=True)
class NativeErrorBody:
    """Every native error, and `event: error` in a native stream."""

    error: NativeError


NATIVE_STREAM_EVENTS: dict[str, type] = {
    "token": NativeTokenEvent,
    "done": NativeDoneEvent,
    "error": NativeErrorBody,
}


# ---- OpenAI ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PromptTokensDetails:
    cached_tokens: int


@attrs.frozen(kw_only=True)
class CompletionTokensDetails:
    reasoning_tokens: int  # of completion_tokens, those of the reasoning block


@attrs.frozen(kw_only=True)
class OpenAIUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Where the request could think (a model with a reasoning template).
    completion_tokens_details: CompletionTokensDetails | None = None


@attrs.frozen(kw_only=True)
class FunctionCall:
    name: str
    arguments: str  # JSON text of an object that matches the function's parameters


@attrs.frozen(kw_only=True)
class ToolCall:
    id: str
    type: Literal["function"] = tag("function")
    function: FunctionCall


@attrs.frozen(kw_only=True)
class AssistantMessage:
    role: Literal["assistant"] = tag("assistant")
    content: str | None  # null when the message is tool calls only
    refusal: None
    tool_calls: list[ToolCall] | None = None
    # The reasoning the model wrote before its answer (a thinking model's <think>
    # block), apart from `content`: the field vLLM and llama.cpp's server answer with.
    reasoning_content: str | None = None


@attrs.frozen(kw_only=True)
class FunctionCallDelta:
    name: str | None = None  # in a call's first delta
    arguments: str | None = None


@attrs.frozen(kw_only=True)
class ToolCallDelta:
    """A piece of a streamed tool call: its first carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


@attrs.frozen(kw_only=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]


@attrs.frozen(kw_only=True)
class TokenLogprobEntry:
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


@attrs.frozen(kw_only=True)
class ChatLogprobs:
    """Chat log probabilities: one entry per output token (the end-of-sequence token
    excluded); `bytes` rebuild a token that holds part of a UTF-8 character."""

    content: list[TokenLogprobEntry]
    refusal: None


@attrs.frozen(kw_only=True)
class ChatChoice:
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinish


@attrs.frozen(kw_only=True)
class LlamaTimings:
    """llama-server's `timings`: the prompt's tokens computed (not served from the cache)
    and the output's, with their milliseconds (in a whole answer and in the last chunk
    of a stream; in every chunk with `timings_per_token`)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


@attrs.frozen(kw_only=True)
class PromptProgressBody:
    """llama-server's `prompt_progress` (streamed, with `return_progress`): the prompt's
    tokens, those served from the cache, those in the cache now, and the milliseconds
    since its prefill began."""

    total: int
    cache: int
    processed: int
    time_ms: int


@attrs.frozen(kw_only=True)
class ChatCompletion:
    """The answer to POST /v1/chat/completions without streaming."""

    id: str
    object: Literal["chat.completion"] = tag("chat.completion")
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage
    system_fingerprint: None
    service_tier: str | None = None  # as the request named it ("auto" answers "default")
    timings: LlamaTimings | None = None  # llama-server's, beside OpenAI's fields


@attrs.frozen(kw_only=True)
class ChatDelta:
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None  # a piece of the reasoning, as it is written


@attrs.frozen(kw_only=True)
class ChatChunkChoice:
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinish | None


@attrs.frozen(kw_only=True)
class ChatCompletionChunk:
    """One `data:` line of a chat completion stream (the last one is `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"] = tag("chat.completion.chunk")
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: OpenAIUsage | None = None
    service_tier: str | None = None
    # llama-server's, beside OpenAI's fields: in the last chunk (every chunk with
    # `timings_per_token`), and the prompt's progress (with `return_progress`)
    timings: LlamaTimings | None = None
    prompt_progress: PromptProgressBody | None = None


@attrs.frozen(kw_only=True)
class CompletionLogprobs:
    """The legacy completions shape: parallel lists, one item per token (the prompt's
    first, when echoed, has null for its logprob and its alternatives)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


@attrs.frozen(kw_only=True)
class CompletionChoice:
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: OpenAIFinish


@attrs.frozen(kw_only=True)
class Completion:
    """The answer to POST /v1/completions without streaming."""

    id: str
    object: Literal["text_completion"] = tag("text_completion")
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAIUsage
    system_fingerprint: None
    timings: LlamaTimings | None = None  # llama-server's, beside OpenAI's fields


@attrs.frozen(kw_only=True)
class CompletionChunkChoice:
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: OpenAIFinish | None


@attrs.frozen(kw_only=True)
class CompletionChunk:
    """One `data:` line of a text completion stream (the last one is `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"] = tag("text_completion")
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: OpenAIUsage | None = None
    # llama-server's, as in a chat completion chunk
    timings: LlamaTimings | None = None
    prompt_progress: PromptProgressBody | None = None


@attrs.frozen(kw_only=True)
class ModelMeta:
    """llama-server's `meta` of a model card: its vocabulary, the context served and
    trained, the file's size in bytes (None where it cannot be read)."""

    n_vocab: int
    n_ctx: int
    n_ctx_train: int
    size: int | None = None


@attrs.frozen(kw_only=True)
class ModelCard:
    id: str
    object: Literal["model"] = tag("model")
    created: int
    owned_by: str
    # llama-server's: the model's other served names (one card a model, not one a
    # name), and what it is
    aliases: list[str] | None = None
    meta: ModelMeta | None = None


@attrs.frozen(kw_only=True)
class ModelList:
    object: Literal["list"] = tag("list")
    data: list[ModelCard]


@attrs.frozen(kw_only=True)
class OpenAIError:
    message: str
    type: str
    param: str | None
    code: str | None


@attrs.frozen(kw_only=True)
class OpenAIErrorBody:
    """Every error on the OpenAI routes, and an error `data:` line in their streams."""

    error: OpenAIError


# ---- Anthropic ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TextBlock:
    type: Literal["text"] = tag("text")
    text: str


@attrs.frozen(kw_only=True)
class ThinkingBlock:
    """The reasoning a thinking model wrote before its answer. `signature` is a digest
    of the text (hex SHA-256), not an attestation: a replayed block is taken as sent."""

    type: Literal["thinking"] = tag("thinking")
    thinking: str
    signature: str


@attrs.frozen(kw_only=True)
class ToolUseBlock:
    """A tool call of an Anthropic answer (`input` is {} in a stream's block start)."""

    type: Literal["tool_use"] = tag("tool_use")
    id: str
    name: str
    input: dict[str, Any]


@attrs.frozen(kw_only=True)
class AnthropicUsage:
    """Anthropic's accounting: `input_tokens` excludes the prompt tokens read from the
    prefix cache (`cache_read_input_tokens`); nothing is billed for writing it."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


@attrs.frozen(kw_only=True)
class MessageResponse:
    """The answer to POST /v1/messages without streaming."""

    id: str
    type: Literal["message"] = tag("message")
    role: Literal["assistant"] = tag("assistant")
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    model: str
    stop_reason: AnthropicStop
    stop_sequence: str | None
    usage: AnthropicUsage


@attrs.frozen(kw_only=True)
class StreamMessage:
    id: str
    type: Literal["message"] = tag("message")
    role: Literal["assistant"] = tag("assistant")
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    model: str
    stop_reason: AnthropicStop | None
    stop_sequence: str | None
    usage: AnthropicUsage


@attrs.frozen(kw_only=True)
class MessageStart:
    type: Literal["message_start"] = tag("message_start")
    message: StreamMessage


@attrs.frozen(kw_only=True)
class ContentBlockStart:
    type: Literal["content_block_start"] = tag("content_block_start")
    index: int
    content_block: ThinkingBlock | TextBlock | ToolUseBlock


@attrs.frozen(kw_only=True)
class Ping:
    type: Literal["ping"] = tag("ping")


@attrs.frozen(kw_only=True)
class TextDelta:
    type: Literal["text_delta"] = tag("text_delta")
    text: str


@attrs.frozen(kw_only=True)
class ThinkingDelta:
    type: Literal["thinking_delta"] = tag("thinking_delta")
    thinking: str


@attrs.frozen(kw_only=True)
class SignatureDelta:
    """A thinking block's signature, sent just before the block stops."""

    type: Literal["signature_delta"] = tag("signature_delta")
    signature: str


@attrs.frozen(kw_only=True)
class InputJsonDelta:
    type: Literal["input_json_delta"] = tag("input_json_delta")
    partial_json: str  # the next piece of a tool_use block's input, as JSON text


@attrs.frozen(kw_only=True)
class ContentBlockDelta:
    type: Literal["content_block_delta"] = tag("content_block_delta")
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


@attrs.frozen(kw_only=True)
class ContentBlockStop:
    type: Literal["content_block_stop"] = tag("content_block_stop")
    index: int


@attrs.frozen(kw_only=True)
class StopDelta:
    stop_reason: AnthropicStop
    stop_sequence: str | None


@attrs.frozen(kw_only=True)
class MessageDelta:
    type: Literal["message_delta"] = tag("message_delta")
    delta: StopDelta
    usage: AnthropicUsage  # cumulative, as Anthropic sends it


@attrs.frozen(kw_only=True)
class MessageStop:
    type: Literal["message_stop"] = tag("message_stop")


@attrs.frozen(kw_only=True)
class CountTokensResponse:
    """The answer to POST /v1/messages/count_tokens."""

    input_tokens: int


@attrs.frozen(kw_only=True)
class AnthropicErrorDetails:
    """`error.details` of the refusals Anthropic's SDKs act on by their `error_code`."""

    error_code: str


@attrs.frozen(kw_only=True)
class AnthropicError:
    type: str
    message: str
    details: AnthropicErrorDetails | None = None


@attrs.frozen(kw_only=True)
class AnthropicErrorBody:
    """Every error on the Anthropic routes, and `event: error` in their streams."""

    type: Literal["error"] = tag("error")
    error: AnthropicError
    request_id: str


ANTHROPIC_STREAM_EVENTS: dict[str, type] = {
    "message_start": MessageStart,
    "content_block_start": ContentBlockStart,
    "ping": Ping,
    "content_block_delta": ContentBlockDelta,
    "content_block_stop": ContentBlockStop,
    "message_delta": MessageDelta,
    "message_stop": MessageStop,
    "error": AnthropicErrorBody,
}


# ---- OpenAI Responses -----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class OutputText:
    type: Literal["output_text"] = tag("output_text")
    text: str
    annotations: list[Any]  # always empty here
    logprobs: list[Any]  # always empty here (top_logprobs is not served yet)


@attrs.frozen(kw_only=True)
class InputText:
    type: Literal["input_text"] = tag("input_text")
    text: str


@attrs.frozen(kw_only=True)
class OutputMessage:
    """An assistant message Item of a Response's output."""

    id: str
    type: Literal["message"] = tag("message")
    role: Literal["assistant"] = tag("assistant")
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


@attrs.frozen(kw_only=True)
class ReasoningText:
    type: Literal["reasoning_text"] = tag("reasoning_text")
    text: str


@attrs.frozen(kw_only=True)
class ReasoningItem:
    """The reasoning a thinking model wrote before its answer, as an output Item (as
    open-weight models' servers give it: the text in `content`, no summary)."""

    id: str
    type: Literal["reasoning"] = tag("reasoning")
    summary: list[Any]  # always empty here: the reasoning is given whole
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


@attrs.frozen(kw_only=True)
class FunctionCallItem:
    """A function call Item of a Response's output (or replayed in its input): `id` is
    the Item's (fc_...), `call_id` the call's (call_...), which its output answers."""

    id: str
    type: Literal["function_call"] = tag("function_call")
    call_id: str
    name: str
    arguments: str  # JSON text of an object that matches the function's parameters
    status: Literal["in_progress", "completed", "incomplete"]


@attrs.frozen(kw_only=True)
class FunctionCallOutputItem:
    """A function call's result, as an input Item."""

    id: str
    type: Literal["function_call_output"] = tag("function_call_output")
    call_id: str
    output: str
    status: Literal["in_progress", "completed", "incomplete"]


@attrs.frozen(kw_only=True)
class InputMessage:
    """An input Item as a stored Response keeps it (GET /v1/responses/{id}/input_items)."""

    id: str
    type: Literal["message"] = tag("message")
    role: Literal["user", "assistant", "system", "developer"]
    status: Literal["completed"] = tag("completed")
    content: list[InputText | OutputText]


@attrs.frozen(kw_only=True)
class InputTokensDetails:
    cached_tokens: int  # served from the prefix cache


@attrs.frozen(kw_only=True)
class OutputTokensDetails:
    reasoning_tokens: int  # of output_tokens, those of the reasoning (0: none)


@attrs.frozen(kw_only=True)
class ResponseUsage:
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


@attrs.frozen(kw_only=True)
class IncompleteDetails:
    reason: Literal["max_output_tokens"] = tag("max_output_tokens")


@attrs.frozen(kw_only=True)
class ResponseError:
    code: str
    message: str


@attrs.frozen(kw_only=True)
class ResponseTextFormat:
    """The format the Response was asked for, echoed (json_schema: with its fields)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


@attrs.frozen(kw_only=True)
class ResponseTextConfig:
    format: ResponseTextFormat


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


@attrs.frozen(kw_only=True)
class ResponseObject:
    """A Response (POST /v1/responses, GET /v1/responses/{id}, and in stream events).
    `output_text` is the SDKs' convenience, never a wire field."""

    id: str
    object: Literal["response"] = tag("response")
    created_at: int
    status: ResponseStatus
    completed_at: int | None
    model: str
    output: list[ReasoningItem | OutputMessage | FunctionCallItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    error: ResponseError | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, Any]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float
    top_p: float
    top_logprobs: int
    text: ResponseTextConfig
    tool_choice: str | dict[str, Any]  # as the request gave it (default auto)
    tools: list[dict[str, Any]]  # the request's function tools
    truncation: Literal["disabled"] = tag("disabled")
    service_tier: str
    background: bool


@attrs.frozen(kw_only=True)
class ResponseLifecycleEvent:
    """response.created / in_progress / completed / incomplete / failed."""

    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    sequence_number: int
    response: ResponseObject


@attrs.frozen(kw_only=True)
class OutputItemEvent:
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: ReasoningItem | OutputMessage | FunctionCallItem


@attrs.frozen(kw_only=True)
class ContentPartEvent:
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


@attrs.frozen(kw_only=True)
class OutputTextDeltaEvent:
    type: Literal["response.output_text.delta"] = tag("response.output_text.delta")
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


@attrs.frozen(kw_only=True)
class OutputTextDoneEvent:
    type: Literal["response.output_text.done"] = tag("response.output_text.done")
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


@attrs.frozen(kw_only=True)
class ReasoningTextDeltaEvent:
    type: Literal["response.reasoning_text.delta"] = tag("response.reasoning_text.delta")
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


@attrs.frozen(kw_only=True)
class ReasoningTextDoneEvent:
    type: Literal["response.reasoning_text.done"] = tag("response.reasoning_text.done")
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


@attrs.frozen(kw_only=True)
class FunctionCallArgumentsDeltaEvent:
    type: Literal["response.function_call_arguments.delta"] = tag(
        "response.function_call_arguments.delta"
    )
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


@attrs.frozen(kw_only=True)
class FunctionCallArgumentsDoneEvent:
    type: Literal["response.function_call_arguments.done"] = tag(
        "response.function_call_arguments.done"
    )
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


@attrs.frozen(kw_only=True)
class ResponseDeleted:
    id: str
    object: Literal["response.deleted"] = tag("response.deleted")
    deleted: bool


@attrs.frozen(kw_only=True)
class InputItemList:
    object: Literal["list"] = tag("list")
    data: list[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


@attrs.frozen(kw_only=True)
class InputTokensCount:
    object: Literal["response.input_tokens"] = tag("response.input_tokens")
    input_tokens: int


RESPONSES_STREAM_EVENTS: dict[str, type] = {
    "response.created": ResponseLifecycleEvent,
    "response.in_progress": ResponseLifecycleEvent,
    "response.output_item.added": OutputItemEvent,
    "response.content_part.added": ContentPartEvent,
    "response.reasoning_text.delta": ReasoningTextDeltaEvent,
    "response.reasoning_text.done": ReasoningTextDoneEvent,
    "response.output_text.delta": OutputTextDeltaEvent,
    "response.output_text.done": OutputTextDoneEvent,
    "response.function_call_arguments.delta": FunctionCallArgumentsDeltaEvent,
    "response.function_call_arguments.done": FunctionCallArgumentsDoneEvent,
    "response.content_part.done": ContentPartEvent,
    "response.output_item.done": OutputItemEvent,
    "response.completed": ResponseLifecycleEvent,
    "response.incomplete": ResponseLifecycleEvent,
    "response.failed": ResponseLifecycleEvent,
}
