from pd.v1 import decode_pb2 as _decode_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("model", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "shape_order")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_ORDER_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    shape_order: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., shape_order: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("layout", "transports", "peer_id", "host", "gpu_index", "pid", "nixl_metadata", "nixl_pool_addr", "nixl_pool_num_slots", "nixl_pool_device")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    NIXL_POOL_ADDR_FIELD_NUMBER: _ClassVar[int]
    NIXL_POOL_NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NIXL_POOL_DEVICE_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    transports: _containers.RepeatedScalarFieldContainer[str]
    peer_id: str
    host: str
    gpu_index: int
    pid: int
    nixl_metadata: bytes
    nixl_pool_addr: int
    nixl_pool_num_slots: int
    nixl_pool_device: int
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., transports: _Optional[_Iterable[str]] = ..., peer_id: _Optional[str] = ..., host: _Optional[str] = ..., gpu_index: _Optional[int] = ..., pid: _Optional[int] = ..., nixl_metadata: _Optional[bytes] = ..., nixl_pool_addr: _Optional[int] = ..., nixl_pool_num_slots: _Optional[int] = ..., nixl_pool_device: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("layout", "transport", "server_id", "gpu_index", "nccl_group", "ipc_pool_handle", "ipc_pool_offset", "ipc_pool_num_slots", "nccl_secret", "nixl_metadata")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    NCCL_GROUP_FIELD_NUMBER: _ClassVar[int]
    IPC_POOL_HANDLE_FIELD_NUMBER: _ClassVar[int]
    IPC_POOL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IPC_POOL_NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NCCL_SECRET_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    transport: str
    server_id: str
    gpu_index: int
    nccl_group: str
    ipc_pool_handle: bytes
    ipc_pool_offset: int
    ipc_pool_num_slots: int
    nccl_secret: bytes
    nixl_metadata: bytes
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., transport: _Optional[str] = ..., server_id: _Optional[str] = ..., gpu_index: _Optional[int] = ..., nccl_group: _Optional[str] = ..., ipc_pool_handle: _Optional[bytes] = ..., ipc_pool_offset: _Optional[int] = ..., ipc_pool_num_slots: _Optional[int] = ..., nccl_secret: _Optional[bytes] = ..., nixl_metadata: _Optional[bytes] = ...) -> None: ...

class RendezvousRequest(_message.Message):
    __slots__ = ("peer_id", "secret", "op", "keys", "value", "expected", "amount", "timeout_s")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OP_UNSPECIFIED: _ClassVar[RendezvousRequest.Op]
        OP_SET: _ClassVar[RendezvousRequest.Op]
        OP_GET: _ClassVar[RendezvousRequest.Op]
        OP_ADD: _ClassVar[RendezvousRequest.Op]
        OP_CHECK: _ClassVar[RendezvousRequest.Op]
        OP_WAIT: _ClassVar[RendezvousRequest.Op]
        OP_COMPARE_SET: _ClassVar[RendezvousRequest.Op]
        OP_DELETE_KEY: _ClassVar[RendezvousRequest.Op]
        OP_NUM_KEYS: _ClassVar[RendezvousRequest.Op]
    OP_UNSPECIFIED: RendezvousRequest.Op
    OP_SET: RendezvousRequest.Op
    OP_GET: RendezvousRequest.Op
    OP_ADD: RendezvousRequest.Op
    OP_CHECK: RendezvousRequest.Op
    OP_WAIT: RendezvousRequest.Op
    OP_COMPARE_SET: RendezvousRequest.Op
    OP_DELETE_KEY: RendezvousRequest.Op
    OP_NUM_KEYS: RendezvousRequest.Op
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    secret: bytes
    op: RendezvousRequest.Op
    keys: _containers.RepeatedScalarFieldContainer[str]
    value: bytes
    expected: bytes
    amount: int
    timeout_s: float
    def __init__(self, peer_id: _Optional[str] = ..., secret: _Optional[bytes] = ..., op: _Optional[_Union[RendezvousRequest.Op, str]] = ..., keys: _Optional[_Iterable[str]] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RendezvousResponse(_message.Message):
    __slots__ = ("value", "number", "ok")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    number: int
    ok: bool
    def __init__(self, value: _Optional[bytes] = ..., number: _Optional[int] = ..., ok: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "transport", "peer_id", "kv_chunk_tokens", "kv_checksums", "decode_cached_tokens", "cache_salt", "dst_block_table", "dst_block_size", "dst_tag")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DST_TAG_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _decode_pb2.SamplingParams
    transport: str
    peer_id: str
    kv_chunk_tokens: int
    kv_checksums: bool
    decode_cached_tokens: int
    cache_salt: str
    dst_block_table: _containers.RepeatedScalarFieldContainer[int]
    dst_block_size: int
    dst_tag: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_decode_pb2.SamplingParams, _Mapping]] = ..., transport: _Optional[str] = ..., peer_id: _Optional[str] = ..., kv_chunk_tokens: _Optional[int] = ..., kv_checksums: _Optional[bool] = ..., decode_cached_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., dst_block_table: _Optional[_Iterable[int]] = ..., dst_block_size: _Optional[int] = ..., dst_tag: _Optional[str] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("layer", "token_start", "token_end", "data")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layer: int
    token_start: int
    token_end: int
    data: bytes
    def __init__(self, layer: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TransferStart(_message.Message):
    __slots__ = ("sequence", "src_block_table", "src_block_size")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    src_block_table: _containers.RepeatedScalarFieldContainer[int]
    src_block_size: int
    def __init__(self, sequence: _Optional[int] = ..., src_block_table: _Optional[_Iterable[int]] = ..., src_block_size: _Optional[int] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("first_token_id", "prefill_s", "kv_send_s", "kv_bytes", "queue_s", "checksum_s", "layer_checksums", "cached_tokens", "backlog_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_SEND_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_S_FIELD_NUMBER: _ClassVar[int]
    LAYER_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    prefill_s: float
    kv_send_s: float
    kv_bytes: int
    queue_s: float
    checksum_s: float
    layer_checksums: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    backlog_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., prefill_s: _Optional[float] = ..., kv_send_s: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., queue_s: _Optional[float] = ..., checksum_s: _Optional[float] = ..., layer_checksums: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., backlog_tokens: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("backlog_tokens",)
    BACKLOG_TOKENS_FIELD_NUMBER: _ClassVar[int]
    backlog_tokens: int
    def __init__(self, backlog_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("kv", "layer_sent", "start", "done", "heartbeat")
    KV_FIELD_NUMBER: _ClassVar[int]
    LAYER_SENT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    kv: KVChunk
    layer_sent: int
    start: TransferStart
    done: PrefillDone
    heartbeat: Heartbeat
    def __init__(self, kv: _Optional[_Union[KVChunk, _Mapping]] = ..., layer_sent: _Optional[int] = ..., start: _Optional[_Union[TransferStart, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "peer_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    peer_id: str
    def __init__(self, request_id: _Optional[str] = ..., peer_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
