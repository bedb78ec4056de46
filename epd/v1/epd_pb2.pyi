from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ContentPart(_message.Message):
    __slots__ = ("text", "image", "video")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: bytes
    video: VideoPart
    def __init__(self, text: _Optional[str] = ..., image: _Optional[bytes] = ..., video: _Optional[_Union[VideoPart, _Mapping]] = ...) -> None: ...

class VideoPart(_message.Message):
    __slots__ = ("data", "fps", "max_frames", "max_pixels")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    fps: float
    max_frames: int
    max_pixels: int
    def __init__(self, data: _Optional[bytes] = ..., fps: _Optional[float] = ..., max_frames: _Optional[int] = ..., max_pixels: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "logprobs", "stop_token_ids", "min_tokens", "logit_bias", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "structured", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    structured: StructuredOutput
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice")
    class Choices(_message.Message):
        __slots__ = ("values",)
        VALUES_FIELD_NUMBER: _ClassVar[int]
        values: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: StructuredOutput.Choices
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[StructuredOutput.Choices, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "messages", "sampling", "max_pixels", "enable_thinking", "prompt", "prompt_token_ids", "cache_salt", "return_prompt_token_ids", "tools_json")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_THINKING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    max_pixels: int
    enable_thinking: bool
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    return_prompt_token_ids: bool
    tools_json: str
    def __init__(self, request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_pixels: _Optional[int] = ..., enable_thinking: _Optional[bool] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., return_prompt_token_ids: _Optional[bool] = ..., tools_json: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top", "rank", "token_id")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    rank: int
    token_id: int
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., rank: _Optional[int] = ..., token_id: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "prompt_tokens", "prompt_token_ids", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Summary(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "image_tokens", "completion_tokens", "finish_reason", "ttft_s", "e2e_s", "images", "images_encoded", "seed", "cached_tokens", "images_cached", "timings", "resumes", "stop_string", "stop_token_id", "videos", "video_tokens", "video_chunks", "video_chunks_encoded")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ENCODED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_CHUNKS_ENCODED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    image_tokens: int
    completion_tokens: int
    finish_reason: str
    ttft_s: float
    e2e_s: float
    images: int
    images_encoded: int
    seed: int
    cached_tokens: int
    images_cached: int
    timings: StageTimings
    resumes: int
    stop_string: str
    stop_token_id: int
    videos: int
    video_tokens: int
    video_chunks: int
    video_chunks_encoded: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., image_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., images: _Optional[int] = ..., images_encoded: _Optional[int] = ..., seed: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., images_cached: _Optional[int] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., resumes: _Optional[int] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., videos: _Optional[int] = ..., video_tokens: _Optional[int] = ..., video_chunks: _Optional[int] = ..., video_chunks_encoded: _Optional[int] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("encode_s", "store_write_s", "store_read_s", "prefill_s", "handoff_s", "handoff_bytes", "queue_s")
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    STORE_WRITE_S_FIELD_NUMBER: _ClassVar[int]
    STORE_READ_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    encode_s: float
    store_write_s: float
    store_read_s: float
    prefill_s: float
    handoff_s: float
    handoff_bytes: int
    queue_s: float
    def __init__(self, encode_s: _Optional[float] = ..., store_write_s: _Optional[float] = ..., store_read_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., handoff_s: _Optional[float] = ..., handoff_bytes: _Optional[int] = ..., queue_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "summary")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    summary: Summary
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., summary: _Optional[_Union[Summary, _Mapping]] = ...) -> None: ...

class EncodeItem(_message.Message):
    __slots__ = ("store_key", "data", "max_pixels", "inline", "video")
    STORE_KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    store_key: str
    data: bytes
    max_pixels: int
    inline: bool
    video: VideoChunk
    def __init__(self, store_key: _Optional[str] = ..., data: _Optional[bytes] = ..., max_pixels: _Optional[int] = ..., inline: _Optional[bool] = ..., video: _Optional[_Union[VideoChunk, _Mapping]] = ...) -> None: ...

class VideoChunk(_message.Message):
    __slots__ = ("fps", "max_frames", "max_pixels", "first_patch", "num_patches")
    FPS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    FIRST_PATCH_FIELD_NUMBER: _ClassVar[int]
    NUM_PATCHES_FIELD_NUMBER: _ClassVar[int]
    fps: float
    max_frames: int
    max_pixels: int
    first_patch: int
    num_patches: int
    def __init__(self, fps: _Optional[float] = ..., max_frames: _Optional[int] = ..., max_pixels: _Optional[int] = ..., first_patch: _Optional[int] = ..., num_patches: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[EncodeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[EncodeItem, _Mapping]]] = ...) -> None: ...

class EncodedImage(_message.Message):
    __slots__ = ("store_key", "num_tokens", "grid_thw", "encode_s", "error", "store_write_s", "embedding")
    STORE_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STORE_WRITE_S_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    store_key: str
    num_tokens: int
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    encode_s: float
    error: str
    store_write_s: float
    embedding: bytes
    def __init__(self, store_key: _Optional[str] = ..., num_tokens: _Optional[int] = ..., grid_thw: _Optional[_Iterable[int]] = ..., encode_s: _Optional[float] = ..., error: _Optional[str] = ..., store_write_s: _Optional[float] = ..., embedding: _Optional[bytes] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[EncodedImage]
    def __init__(self, images: _Optional[_Iterable[_Union[EncodedImage, _Mapping]]] = ...) -> None: ...

class ImageRef(_message.Message):
    __slots__ = ("store_key", "merged_height", "merged_width", "embedding", "temporal_patches")
    STORE_KEY_FIELD_NUMBER: _ClassVar[int]
    MERGED_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    MERGED_WIDTH_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_PATCHES_FIELD_NUMBER: _ClassVar[int]
    store_key: str
    merged_height: int
    merged_width: int
    embedding: bytes
    temporal_patches: int
    def __init__(self, store_key: _Optional[str] = ..., merged_height: _Optional[int] = ..., merged_width: _Optional[int] = ..., embedding: _Optional[bytes] = ..., temporal_patches: _Optional[int] = ...) -> None: ...

class ResolvedSampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "logprobs", "stop_token_ids", "min_tokens", "logit_bias", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    grammar: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., grammar: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "images", "sampling", "deadline_unix", "num_generated", "cache_salt", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageRef]
    sampling: ResolvedSampling
    deadline_unix: float
    num_generated: int
    cache_salt: str
    prompt_logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[ImageRef, _Mapping]]] = ..., sampling: _Optional[_Union[ResolvedSampling, _Mapping]] = ..., deadline_unix: _Optional[float] = ..., num_generated: _Optional[int] = ..., cache_salt: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "first_logprobs", "finished", "finish_reason", "decode_addr", "prefill_s", "handoff_s", "handoff_bytes", "store_read_s", "cached_tokens", "queue_s", "prompt_logprobs", "stored_prefix_keys")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_READ_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STORED_PREFIX_KEYS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    first_logprobs: TokenLogprobs
    finished: bool
    finish_reason: str
    decode_addr: str
    prefill_s: float
    handoff_s: float
    handoff_bytes: int
    store_read_s: float
    cached_tokens: int
    queue_s: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    stored_prefix_keys: bytes
    def __init__(self, first_token: _Optional[int] = ..., first_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., decode_addr: _Optional[str] = ..., prefill_s: _Optional[float] = ..., handoff_s: _Optional[float] = ..., handoff_bytes: _Optional[int] = ..., store_read_s: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., queue_s: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., stored_prefix_keys: _Optional[bytes] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class HandoffHeader(_message.Message):
    __slots__ = ("request_id", "prompt_len", "rope_delta", "first_token", "sampling", "deadline_unix", "tensors", "num_generated", "generated_token_ids", "prompt_token_set", "shared_file")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    ROPE_DELTA_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_SET_FIELD_NUMBER: _ClassVar[int]
    SHARED_FILE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_len: int
    rope_delta: int
    first_token: int
    sampling: ResolvedSampling
    deadline_unix: float
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    num_generated: int
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_set: _containers.RepeatedScalarFieldContainer[int]
    shared_file: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., rope_delta: _Optional[int] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[ResolvedSampling, _Mapping]] = ..., deadline_unix: _Optional[float] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., num_generated: _Optional[int] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., prompt_token_set: _Optional[_Iterable[int]] = ..., shared_file: _Optional[str] = ...) -> None: ...

class HandoffChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: HandoffHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[HandoffHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class HandoffAck(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ...) -> None: ...
