from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_MODE_UNSPECIFIED: _ClassVar[PrefillMode]
    PREFILL_MODE_DISAGGREGATED: _ClassVar[PrefillMode]
    PREFILL_MODE_COLOCATED: _ClassVar[PrefillMode]
    PREFILL_MODE_CHUNKED: _ClassVar[PrefillMode]
    PREFILL_MODE_LAYERED: _ClassVar[PrefillMode]
    PREFILL_MODE_PARTITIONED: _ClassVar[PrefillMode]
    PREFILL_MODE_AUTO: _ClassVar[PrefillMode]
PREFILL_MODE_UNSPECIFIED: PrefillMode
PREFILL_MODE_DISAGGREGATED: PrefillMode
PREFILL_MODE_COLOCATED: PrefillMode
PREFILL_MODE_CHUNKED: PrefillMode
PREFILL_MODE_LAYERED: PrefillMode
PREFILL_MODE_PARTITIONED: PrefillMode
PREFILL_MODE_AUTO: PrefillMode

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "prompt", "max_new_tokens", "sampling", "stop_token_ids", "ignore_eos", "prefill_mode", "chunk_size", "prefill_sms", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MODE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    prefill_mode: PrefillMode
    chunk_size: int
    prefill_sms: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., prefill_mode: _Optional[_Union[PrefillMode, str]] = ..., chunk_size: _Optional[int] = ..., prefill_sms: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ServerTiming(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "kv_transfer_s", "first_token_s", "decode_step_s", "since_arrival_s", "kv_bytes", "kv_exposed_s", "kv_transport", "prefill_queue_s", "cached_tokens", "placement")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    SINCE_ARRIVAL_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_EXPOSED_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    first_token_s: float
    decode_step_s: float
    since_arrival_s: float
    kv_bytes: int
    kv_exposed_s: float
    kv_transport: str
    prefill_queue_s: float
    cached_tokens: int
    placement: str
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., first_token_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ..., since_arrival_s: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., kv_exposed_s: _Optional[float] = ..., kv_transport: _Optional[str] = ..., prefill_queue_s: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., placement: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_id", "index", "text", "finish_reason", "timing", "request_id")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    index: int
    text: str
    finish_reason: str
    timing: ServerTiming
    request_id: str
    def __init__(self, token_id: _Optional[int] = ..., index: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., timing: _Optional[_Union[ServerTiming, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...
