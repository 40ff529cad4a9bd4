from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DialBack(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIAL_BACK_UNSPECIFIED: _ClassVar[DialBack]
    DIAL_BACK_REACHED: _ClassVar[DialBack]
    DIAL_BACK_FAILED: _ClassVar[DialBack]

class PeerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_STATE_UNSPECIFIED: _ClassVar[PeerState]
    PEER_STATE_ALIVE: _ClassVar[PeerState]
    PEER_STATE_SUSPECT: _ClassVar[PeerState]
    PEER_STATE_DEAD: _ClassVar[PeerState]
    PEER_STATE_LEFT: _ClassVar[PeerState]

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_FP16: _ClassVar[Compression]
    COMPRESSION_BF16: _ClassVar[Compression]
    COMPRESSION_INT8: _ClassVar[Compression]
    COMPRESSION_INT4: _ClassVar[Compression]
DIAL_BACK_UNSPECIFIED: DialBack
DIAL_BACK_REACHED: DialBack
DIAL_BACK_FAILED: DialBack
PEER_STATE_UNSPECIFIED: PeerState
PEER_STATE_ALIVE: PeerState
PEER_STATE_SUSPECT: PeerState
PEER_STATE_DEAD: PeerState
PEER_STATE_LEFT: PeerState
COMPRESSION_NONE: Compression
COMPRESSION_FP16: Compression
COMPRESSION_BF16: Compression
COMPRESSION_INT8: Compression
COMPRESSION_INT4: Compression

class Capabilities(_message.Message):
    __slots__ = ("device_kind", "gpu_name", "gpu_memory_bytes", "step_time_s", "cpu_count", "peerd_version", "site", "relay")
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    GPU_NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    PEERD_VERSION_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    device_kind: str
    gpu_name: str
    gpu_memory_bytes: int
    step_time_s: float
    cpu_count: int
    peerd_version: str
    site: str
    relay: bool
    def __init__(self, device_kind: _Optional[str] = ..., gpu_name: _Optional[str] = ..., gpu_memory_bytes: _Optional[int] = ..., step_time_s: _Optional[float] = ..., cpu_count: _Optional[int] = ..., peerd_version: _Optional[str] = ..., site: _Optional[str] = ..., relay: _Optional[bool] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node_id", "protocol_version", "run_id", "address", "capabilities", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    protocol_version: int
    run_id: str
    address: str
    capabilities: Capabilities
    incarnation: int
    def __init__(self, node_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., address: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("node", "peers", "revocations", "dial_back")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    DIAL_BACK_FIELD_NUMBER: _ClassVar[int]
    node: Hello
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    revocations: _containers.RepeatedCompositeFieldContainer[Revocation]
    dial_back: DialBack
    def __init__(self, node: _Optional[_Union[Hello, _Mapping]] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., revocations: _Optional[_Iterable[_Union[Revocation, _Mapping]]] = ..., dial_back: _Optional[_Union[DialBack, str]] = ...) -> None: ...

class TunnelFrame(_message.Message):
    __slots__ = ("data", "go", "target")
    DATA_FIELD_NUMBER: _ClassVar[int]
    GO_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    go: bool
    target: str
    def __init__(self, data: _Optional[bytes] = ..., go: _Optional[bool] = ..., target: _Optional[str] = ...) -> None: ...

class Revocation(_message.Message):
    __slots__ = ("node_id", "revoked_at", "reason", "signature")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    revoked_at: float
    reason: str
    signature: bytes
    def __init__(self, node_id: _Optional[str] = ..., revoked_at: _Optional[float] = ..., reason: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("node_id", "address", "incarnation", "state")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    incarnation: int
    state: PeerState
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ..., state: _Optional[_Union[PeerState, str]] = ...) -> None: ...

class LinkEntry(_message.Message):
    __slots__ = ("measurer", "target", "throughput_bytes_s", "throughput_spread_bytes_s", "rtt_s", "rtt_spread_s", "samples", "age_s", "capacity_bytes_s", "capacity_age_s")
    MEASURER_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_BYTES_S_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_SPREAD_BYTES_S_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    RTT_SPREAD_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_S_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_AGE_S_FIELD_NUMBER: _ClassVar[int]
    measurer: str
    target: str
    throughput_bytes_s: float
    throughput_spread_bytes_s: float
    rtt_s: float
    rtt_spread_s: float
    samples: int
    age_s: float
    capacity_bytes_s: float
    capacity_age_s: float
    def __init__(self, measurer: _Optional[str] = ..., target: _Optional[str] = ..., throughput_bytes_s: _Optional[float] = ..., throughput_spread_bytes_s: _Optional[float] = ..., rtt_s: _Optional[float] = ..., rtt_spread_s: _Optional[float] = ..., samples: _Optional[int] = ..., age_s: _Optional[float] = ..., capacity_bytes_s: _Optional[float] = ..., capacity_age_s: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("node_id", "incarnation", "seq", "peers", "address", "links", "revocations_digest", "revocations")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    seq: int
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    address: str
    links: _containers.RepeatedCompositeFieldContainer[LinkEntry]
    revocations_digest: bytes
    revocations: _containers.RepeatedCompositeFieldContainer[Revocation]
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., address: _Optional[str] = ..., links: _Optional[_Iterable[_Union[LinkEntry, _Mapping]]] = ..., revocations_digest: _Optional[bytes] = ..., revocations: _Optional[_Iterable[_Union[Revocation, _Mapping]]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("node_id", "incarnation", "peers", "links", "revocations_digest", "revocations")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    links: _containers.RepeatedCompositeFieldContainer[LinkEntry]
    revocations_digest: bytes
    revocations: _containers.RepeatedCompositeFieldContainer[Revocation]
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkEntry, _Mapping]]] = ..., revocations_digest: _Optional[bytes] = ..., revocations: _Optional[_Iterable[_Union[Revocation, _Mapping]]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("nonce", "payload", "reply_bytes")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    payload: bytes
    reply_bytes: int
    def __init__(self, nonce: _Optional[int] = ..., payload: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ...) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("nonce", "payload")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    payload: bytes
    def __init__(self, nonce: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class Leave(_message.Message):
    __slots__ = ("node_id", "incarnation", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("sender", "run_id", "iteration", "tensors", "total_bytes", "wire_bytes", "checksum_algo", "checksum", "compression", "transfer_id", "kind", "mass", "copy_epoch", "copy_base", "copy_version", "ranges")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MASS_FIELD_NUMBER: _ClassVar[int]
    COPY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    COPY_BASE_FIELD_NUMBER: _ClassVar[int]
    COPY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    sender: str
    run_id: str
    iteration: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    wire_bytes: int
    checksum_algo: str
    checksum: int
    compression: Compression
    transfer_id: int
    kind: str
    mass: float
    copy_epoch: int
    copy_base: int
    copy_version: int
    ranges: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sender: _Optional[str] = ..., run_id: _Optional[str] = ..., iteration: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., checksum_algo: _Optional[str] = ..., checksum: _Optional[int] = ..., compression: _Optional[_Union[Compression, str]] = ..., transfer_id: _Optional[int] = ..., kind: _Optional[str] = ..., mass: _Optional[float] = ..., copy_epoch: _Optional[int] = ..., copy_base: _Optional[int] = ..., copy_version: _Optional[int] = ..., ranges: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("data", "offset")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class TensorFrame(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class TransferReply(_message.Message):
    __slots__ = ("transfer_id", "received_bytes", "seconds")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    received_bytes: int
    seconds: float
    def __init__(self, transfer_id: _Optional[int] = ..., received_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("requester", "run_id", "min_iteration", "compression", "kind")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_ITERATION_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    requester: str
    run_id: str
    min_iteration: int
    compression: Compression
    kind: str
    def __init__(self, requester: _Optional[str] = ..., run_id: _Optional[str] = ..., min_iteration: _Optional[int] = ..., compression: _Optional[_Union[Compression, str]] = ..., kind: _Optional[str] = ...) -> None: ...

class TokenGrant(_message.Message):
    __slots__ = ("sender", "run_id", "tokens", "iteration")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    sender: str
    run_id: str
    tokens: int
    iteration: int
    def __init__(self, sender: _Optional[str] = ..., run_id: _Optional[str] = ..., tokens: _Optional[int] = ..., iteration: _Optional[int] = ...) -> None: ...

class TokenReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerNotice(_message.Message):
    __slots__ = ("sender", "run_id", "tag", "state", "iteration")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[TrainerNotice.State]
        STATE_ABSENT: _ClassVar[TrainerNotice.State]
        STATE_RESUMING: _ClassVar[TrainerNotice.State]
        STATE_FINISHED: _ClassVar[TrainerNotice.State]
    STATE_UNSPECIFIED: TrainerNotice.State
    STATE_ABSENT: TrainerNotice.State
    STATE_RESUMING: TrainerNotice.State
    STATE_FINISHED: TrainerNotice.State
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    sender: str
    run_id: str
    tag: str
    state: TrainerNotice.State
    iteration: int
    def __init__(self, sender: _Optional[str] = ..., run_id: _Optional[str] = ..., tag: _Optional[str] = ..., state: _Optional[_Union[TrainerNotice.State, str]] = ..., iteration: _Optional[int] = ...) -> None: ...

class TrainerNoticeReply(_message.Message):
    __slots__ = ("iteration",)
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    def __init__(self, iteration: _Optional[int] = ...) -> None: ...

class RunQuery(_message.Message):
    __slots__ = ("sender", "run_id", "founders", "algorithm")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FOUNDERS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    sender: str
    run_id: str
    founders: _containers.RepeatedScalarFieldContainer[str]
    algorithm: str
    def __init__(self, sender: _Optional[str] = ..., run_id: _Optional[str] = ..., founders: _Optional[_Iterable[str]] = ..., algorithm: _Optional[str] = ...) -> None: ...

class RunInfo(_message.Message):
    __slots__ = ("active", "tag", "spec_json", "nodes", "iteration", "ranking", "waiting_spec_json")
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    RANKING_FIELD_NUMBER: _ClassVar[int]
    WAITING_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    active: bool
    tag: str
    spec_json: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    iteration: int
    ranking: _containers.RepeatedScalarFieldContainer[str]
    waiting_spec_json: str
    def __init__(self, active: _Optional[bool] = ..., tag: _Optional[str] = ..., spec_json: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., iteration: _Optional[int] = ..., ranking: _Optional[_Iterable[str]] = ..., waiting_spec_json: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("sender", "run_id", "tag", "spec_json")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    sender: str
    run_id: str
    tag: str
    spec_json: str
    def __init__(self, sender: _Optional[str] = ..., run_id: _Optional[str] = ..., tag: _Optional[str] = ..., spec_json: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("rank", "nodes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("sender", "run_id", "tag", "node", "rank", "release")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    sender: str
    run_id: str
    tag: str
    node: str
    rank: int
    release: bool
    def __init__(self, sender: _Optional[str] = ..., run_id: _Optional[str] = ..., tag: _Optional[str] = ..., node: _Optional[str] = ..., rank: _Optional[int] = ..., release: _Optional[bool] = ...) -> None: ...

class AdmitReply(_message.Message):
    __slots__ = ("accepted", "holder")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    holder: str
    def __init__(self, accepted: _Optional[bool] = ..., holder: _Optional[str] = ...) -> None: ...
