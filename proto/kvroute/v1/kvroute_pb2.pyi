from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatCompletionRequest(_message.Message):
    __slots__ = ("model", "messages", "sampling", "stream_options", "logprobs", "top_logprobs", "max_completion_tokens", "parallel_tool_calls", "cache_salt", "routing", "extra_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    stream_options: StreamOptions
    logprobs: bool
    top_logprobs: int
    max_completion_tokens: int
    parallel_tool_calls: bool
    cache_salt: str
    routing: RoutingHints
    extra_json: str
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., max_completion_tokens: _Optional[int] = ..., parallel_tool_calls: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., routing: _Optional[_Union[RoutingHints, _Mapping]] = ..., extra_json: _Optional[str] = ...) -> None: ...

class CompletionRequest(_message.Message):
    __slots__ = ("model", "text", "token_ids", "sampling", "stream_options", "logprobs", "echo", "suffix", "cache_salt", "routing", "extra_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    stream_options: StreamOptions
    logprobs: int
    echo: bool
    suffix: str
    cache_salt: str
    routing: RoutingHints
    extra_json: str
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ..., logprobs: _Optional[int] = ..., echo: _Optional[bool] = ..., suffix: _Optional[str] = ..., cache_salt: _Optional[str] = ..., routing: _Optional[_Union[RoutingHints, _Mapping]] = ..., extra_json: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "parts", "name", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("type", "text", "image_url", "input_audio")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_URL_FIELD_NUMBER: _ClassVar[int]
    INPUT_AUDIO_FIELD_NUMBER: _ClassVar[int]
    type: str
    text: str
    image_url: ImageUrl
    input_audio: InputAudio
    def __init__(self, type: _Optional[str] = ..., text: _Optional[str] = ..., image_url: _Optional[_Union[ImageUrl, _Mapping]] = ..., input_audio: _Optional[_Union[InputAudio, _Mapping]] = ...) -> None: ...

class ImageUrl(_message.Message):
    __slots__ = ("url", "detail")
    URL_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    url: str
    detail: str
    def __init__(self, url: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class InputAudio(_message.Message):
    __slots__ = ("data", "format")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    data: str
    format: str
    def __init__(self, data: _Optional[str] = ..., format: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("index", "id", "type", "function")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    type: str
    function: FunctionCall
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., type: _Optional[str] = ..., function: _Optional[_Union[FunctionCall, _Mapping]] = ...) -> None: ...

class FunctionCall(_message.Message):
    __slots__ = ("name", "arguments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: str
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop", "stop_token_ids", "n", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "skip_special_tokens", "user")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[str, float]
    ignore_eos: bool
    skip_special_tokens: bool
    user: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[str, float]] = ..., ignore_eos: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., user: _Optional[str] = ...) -> None: ...

class StreamOptions(_message.Message):
    __slots__ = ("include_usage", "continuous_usage_stats")
    INCLUDE_USAGE_FIELD_NUMBER: _ClassVar[int]
    CONTINUOUS_USAGE_STATS_FIELD_NUMBER: _ClassVar[int]
    include_usage: bool
    continuous_usage_stats: bool
    def __init__(self, include_usage: _Optional[bool] = ..., continuous_usage_stats: _Optional[bool] = ...) -> None: ...

class RoutingHints(_message.Message):
    __slots__ = ("tenant", "session_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class ChatCompletion(_message.Message):
    __slots__ = ("id", "model", "created", "choices", "usage")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    created: int
    choices: _containers.RepeatedCompositeFieldContainer[ChatChoice]
    usage: Usage
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., created: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[ChatChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ChatChoice(_message.Message):
    __slots__ = ("index", "message", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    message: ChatMessageOut
    finish_reason: str
    def __init__(self, index: _Optional[int] = ..., message: _Optional[_Union[ChatMessageOut, _Mapping]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class ChatMessageOut(_message.Message):
    __slots__ = ("role", "content", "reasoning_content", "tool_calls")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    reasoning_content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class ChatCompletionChunk(_message.Message):
    __slots__ = ("id", "model", "created", "choices", "usage")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    created: int
    choices: _containers.RepeatedCompositeFieldContainer[ChatChunkChoice]
    usage: Usage
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., created: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[ChatChunkChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ChatChunkChoice(_message.Message):
    __slots__ = ("index", "delta", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    delta: ChatMessageOut
    finish_reason: str
    def __init__(self, index: _Optional[int] = ..., delta: _Optional[_Union[ChatMessageOut, _Mapping]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("id", "model", "created", "choices", "usage")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    created: int
    choices: _containers.RepeatedCompositeFieldContainer[CompletionChoice]
    usage: Usage
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., created: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[CompletionChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class CompletionChoice(_message.Message):
    __slots__ = ("index", "text", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    finish_reason: str
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
