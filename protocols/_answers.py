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
    "MessageDelta",
    "MessageResponse",
    "MessageStart",
    "MessageStop",
    "ModelCard",
    "ModelList",
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

NativeFinish = Literal["eos", "stop", "length", "context"]
OpenAIFinish = Literal["stop", "length"]
ChatFinish = Literal["stop", "length", "tool_calls"]
AnthropicStop = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


# ---- native ---------------------------------------------------------------------------------


@attrs.frozen
class NativeModel:
    id: str
    architecture: str
    sha256: str


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@attrs.frozen
class Timing:
    """Seconds: reading/parsing/tokenizing, waiting, arrival to first token, engine
    prefill and decode time, arrival to last token."""

    prepare: float
    queue: float
    ttft: float
    prefill: float
    decode: float
    total: float


@attrs.frozen
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


@attrs.frozen
class NativeTokenEvent:
    """`event: token`: the tokens of one engine step and the text they complete."""

    token_ids: list[int]
    text: str


@attrs.frozen
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


@attrs.frozen
class NativeError:
    type: str
    message: str
    param: str | None
    request_id: str


@attrs.frozen
class NativeErrorBody:
    """Every native error, and `event: error` in a native stream."""

    error: NativeError


NATIVE_STREAM_EVENTS: dict[str, type] = {
    "token": NativeTokenEvent,
    "done": NativeDoneEvent,
    "error": NativeErrorBody,
}


# ---- OpenAI ---------------------------------------------------------------------------------


@attrs.frozen
class PromptTokensDetails:
    cached_tokens: int


@attrs.frozen
class CompletionTokensDetails:
    reasoning_tokens: int  # of completion_tokens, those of the reasoning block


@attrs.frozen
class OpenAIUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Where the request could think (a model with a reasoning template).
    completion_tokens_details: CompletionTokensDetails | None = None


@attrs.frozen
class FunctionCall:
    name: str
    arguments: str  # JSON text of an object that matches the function's parameters


@attrs.frozen
class ToolCall:
    id: str
    type: Literal["function"]
    function: FunctionCall


@attrs.frozen
class AssistantMessage:
    role: Literal["assistant"]
    content: str | None  # null when the message is tool calls only
    refusal: None
    tool_calls: list[ToolCall] | None = None
    # The reasoning the model wrote before its answer (a thinking model's <think>
    # block), apart from `content`: the field vLLM and llama.cpp's server answer with.
    reasoning_content: str | None = None


@attrs.frozen
class FunctionCallDelta:
    name: str | None = None  # in a call's first delta
    arguments: str | None = None


@attrs.frozen
class ToolCallDelta:
    """A piece of a streamed tool call: its first carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


@attrs.frozen
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]


@attrs.frozen
class TokenLogprobEntry:
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


@attrs.frozen
class ChatLogprobs:
    """Chat log probabilities: one entry per output token (the end-of-sequence token
    excluded); `bytes` rebuild a token that holds part of a UTF-8 character."""

    content: list[TokenLogprobEntry]
    refusal: None


@attrs.frozen
class ChatChoice:
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinish


@attrs.frozen
class ChatCompletion:
    """The answer to POST /v1/chat/completions without streaming."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage
    system_fingerprint: None
    service_tier: str | None = None  # as the request named it ("auto" answers "default")


@attrs.frozen
class ChatDelta:
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None  # a piece of the reasoning, as it is written


@attrs.frozen
class ChatChunkChoice:
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinish | None


@attrs.frozen
class ChatCompletionChunk:
    """One `data:` line of a chat completion stream (the last one is `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: OpenAIUsage | None = None
    service_tier: str | None = None


@attrs.frozen
class CompletionLogprobs:
    """The legacy completions shape: parallel lists, one item per token (the prompt's
    first, when echoed, has null for its logprob and its alternatives)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


@attrs.frozen
class CompletionChoice:
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: OpenAIFinish


@attrs.frozen
class Completion:
    """The answer to POST /v1/completions without streaming."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAIUsage
    system_fingerprint: None


@attrs.frozen
class CompletionChunkChoice:
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: OpenAIFinish | None


@attrs.frozen
class CompletionChunk:
    """One `data:` line of a text completion stream (the last one is `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: OpenAIUsage | None = None


@attrs.frozen
class ModelCard:
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


@attrs.frozen
class ModelList:
    object: Literal["list"]
    data: list[ModelCard]


@attrs.frozen
class OpenAIError:
    message: str
    type: str
    param: str | None
    code: str | None


@attrs.frozen
class OpenAIErrorBody:
    """Every error on the OpenAI routes, and an error `data:` line in their streams."""

    error: OpenAIError


# ---- Anthropic ------------------------------------------------------------------------------


@attrs.frozen
class TextBlock:
    type: Literal["text"]
    text: str


@attrs.frozen
class ThinkingBlock:
    """The reasoning a thinking model wrote before its answer. `signature` is a digest
    of the text (hex SHA-256), not an attestation: a replayed block is taken as sent."""

    type: Literal["thinking"]
    thinking: str
    signature: str


@attrs.frozen
class ToolUseBlock:
    """A tool call of an Anthropic answer (`input` is {} in a stream's block start)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


@attrs.frozen
class AnthropicUsage:
    """Anthropic's accounting: `input_tokens` excludes the prompt tokens read from the
    prefix cache (`cache_read_input_tokens`); nothing is billed for writing it."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


@attrs.frozen
class MessageResponse:
    """The answer to POST /v1/messages without streaming."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    model: str
    stop_reason: AnthropicStop
    stop_sequence: str | None
    usage: AnthropicUsage


@attrs.frozen
class StreamMessage:
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    model: str
    stop_reason: AnthropicStop | None
    stop_sequence: str | None
    usage: AnthropicUsage


@attrs.frozen
class MessageStart:
    type: Literal["message_start"]
    message: StreamMessage


@attrs.frozen
class ContentBlockStart:
    type: Literal["content_block_start"]
    index: int
    content_block: ThinkingBlock | TextBlock | ToolUseBlock


@attrs.frozen
class Ping:
    type: Literal["ping"]


@attrs.frozen
class TextDelta:
    type: Literal["text_delta"]
    text: str


@attrs.frozen
class ThinkingDelta:
    type: Literal["thinking_delta"]
    thinking: str


@attrs.frozen
class SignatureDelta:
    """A thinking block's signature, sent just before the block stops."""

    type: Literal["signature_delta"]
    signature: str


@attrs.frozen
class InputJsonDelta:
    type: Literal["input_json_delta"]
    partial_json: str  # the next piece of a tool_use block's input, as JSON text


@attrs.frozen
class ContentBlockDelta:
    type: Literal["content_block_delta"]
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


@attrs.frozen
class ContentBlockStop:
    type: Literal["content_block_stop"]
    index: int


@attrs.frozen
class StopDelta:
    stop_reason: AnthropicStop
    stop_sequence: str | None


@attrs.frozen
class MessageDelta:
    type: Literal["message_delta"]
    delta: StopDelta
    usage: AnthropicUsage  # cumulative, as Anthropic sends it


@attrs.frozen
class MessageStop:
    type: Literal["message_stop"]


@attrs.frozen
class CountTokensResponse:
    """The answer to POST /v1/messages/count_tokens."""

    input_tokens: int


@attrs.frozen
class AnthropicError:
    type: str
    message: str


@attrs.frozen
class AnthropicErrorBody:
    """Every error on the Anthropic routes, and `event: error` in their streams."""

    type: Literal["error"]
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


@attrs.frozen
class OutputText:
    type: Literal["output_text"]
    text: str
    annotations: list[Any]  # always empty here
    logprobs: list[Any]  # always empty here (top_logprobs is not served yet)


@attrs.frozen
class InputText:
    type: Literal["input_text"]
    text: str


@attrs.frozen
class OutputMessage:
    """An assistant message Item of a Response's output."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


@attrs.frozen
class ReasoningText:
    type: Literal["reasoning_text"]
    text: str


@attrs.frozen
class ReasoningItem:
    """The reasoning a thinking model wrote before its answer, as an output Item (as
    open-weight models' servers give it: the text in `content`, no summary)."""

    id: str
    type: Literal["reasoning"]
    summary: list[Any]  # always empty here: the reasoning is given whole
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


@attrs.frozen
class FunctionCallItem:
    """A function call Item of a Response's output (or replayed in its input): `id` is
    the Item's (fc_...), `call_id` the call's (call_...), which its output answers."""

    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text of an object that matches the function's parameters
    status: Literal["in_progress", "completed", "incomplete"]


@attrs.frozen
class FunctionCallOutputItem:
    """A function call's result, as an input Item."""

    id: str
    type: Literal["function_call_output"]
    call_id: str
    output: str
    status: Literal["in_progress", "completed", "incomplete"]


@attrs.frozen
class InputMessage:
    """An input Item as a stored Response keeps it (GET /v1/responses/{id}/input_items)."""

    id: str
    type: Literal["message"]
    role: Literal["user", "assistant", "system", "developer"]
    status: Literal["completed"]
    content: list[InputText | OutputText]


@attrs.frozen
class InputTokensDetails:
    cached_tokens: int  # served from the prefix cache


@attrs.frozen
class OutputTokensDetails:
    reasoning_tokens: int  # of output_tokens, those of the reasoning (0: none)


@attrs.frozen
class ResponseUsage:
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


@attrs.frozen
class IncompleteDetails:
    reason: Literal["max_output_tokens"]


@attrs.frozen
class ResponseError:
    code: str
    message: str


@attrs.frozen
class ResponseTextFormat:
    """The format the Response was asked for, echoed (json_schema: with its fields)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


@attrs.frozen
class ResponseTextConfig:
    format: ResponseTextFormat


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


@attrs.frozen
class ResponseObject:
    """A Response (POST /v1/responses, GET /v1/responses/{id}, and in stream events).
    `output_text` is the SDKs' convenience, never a wire field."""

    id: str
    object: Literal["response"]
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
    truncation: Literal["disabled"]
    service_tier: str
    background: bool


@attrs.frozen
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


@attrs.frozen
class OutputItemEvent:
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: ReasoningItem | OutputMessage | FunctionCallItem


@attrs.frozen
class ContentPartEvent:
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


@attrs.frozen
class OutputTextDeltaEvent:
    type: Literal["response.output_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


@attrs.frozen
class OutputTextDoneEvent:
    type: Literal["response.output_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


@attrs.frozen
class ReasoningTextDeltaEvent:
    type: Literal["response.reasoning_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


@attrs.frozen
class ReasoningTextDoneEvent:
    type: Literal["response.reasoning_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


@attrs.frozen
class FunctionCallArgumentsDeltaEvent:
    type: Literal["response.function_call_arguments.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


@attrs.frozen
class FunctionCallArgumentsDoneEvent:
    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


@attrs.frozen
class ResponseDeleted:
    id: str
    object: Literal["response.deleted"]
    deleted: bool


@attrs.frozen
class InputItemList:
    object: Literal["list"]
    data: list[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


@attrs.frozen
class InputTokensCount:
    object: Literal["response.input_tokens"]
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
