from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("node_id", "address", "state", "last_heartbeat_age_s", "rtt_ms", "incarnation", "device_kind", "direct", "bad_updates", "flagged_for_s", "last_offence")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    BAD_UPDATES_FIELD_NUMBER: _ClassVar[int]
    FLAGGED_FOR_S_FIELD_NUMBER: _ClassVar[int]
    LAST_OFFENCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    state: str
    last_heartbeat_age_s: float
    rtt_ms: float
    incarnation: int
    device_kind: str
    direct: bool
    bad_updates: int
    flagged_for_s: float
    last_offence: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., last_heartbeat_age_s: _Optional[float] = ..., rtt_ms: _Optional[float] = ..., incarnation: _Optional[int] = ..., device_kind: _Optional[str] = ..., direct: _Optional[bool] = ..., bad_updates: _Optional[int] = ..., flagged_for_s: _Optional[float] = ..., last_offence: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("node_id", "address", "run_id", "uptime_s", "protocol_version", "peerd_version", "event_loop", "incarnation", "peers", "data_dir", "tls", "training_json", "refused_calls", "rate_limited_calls", "rate_limit_entries", "refusal_log_lines", "last_training_json", "loop_lag_p99_ms", "loop_lag_max_ms", "suspect_events", "metrics_url", "tls_mode", "revoked_nodes", "trust", "reachability", "tunnels_to", "tunnels_from", "dial_backs_reached", "dial_backs_failed", "tunnelled_connections", "tunnelled_bytes", "relayed_to", "relay", "relayed_connections", "relayed_bytes", "loop_lag_own_p99_ms", "loop_cpu_wait_s", "seeds")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEERD_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_LOOP_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    DATA_DIR_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_JSON_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CALLS_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITED_CALLS_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMIT_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_LOG_LINES_FIELD_NUMBER: _ClassVar[int]
    LAST_TRAINING_JSON_FIELD_NUMBER: _ClassVar[int]
    LOOP_LAG_P99_MS_FIELD_NUMBER: _ClassVar[int]
    LOOP_LAG_MAX_MS_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_EVENTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    TLS_MODE_FIELD_NUMBER: _ClassVar[int]
    REVOKED_NODES_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    TUNNELS_TO_FIELD_NUMBER: _ClassVar[int]
    TUNNELS_FROM_FIELD_NUMBER: _ClassVar[int]
    DIAL_BACKS_REACHED_FIELD_NUMBER: _ClassVar[int]
    DIAL_BACKS_FAILED_FIELD_NUMBER: _ClassVar[int]
    TUNNELLED_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    TUNNELLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELAYED_TO_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    RELAYED_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOP_LAG_OWN_P99_MS_FIELD_NUMBER: _ClassVar[int]
    LOOP_CPU_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    run_id: str
    uptime_s: float
    protocol_version: int
    peerd_version: str
    event_loop: str
    incarnation: int
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    data_dir: str
    tls: bool
    training_json: str
    refused_calls: int
    rate_limited_calls: int
    rate_limit_entries: int
    refusal_log_lines: int
    last_training_json: str
    loop_lag_p99_ms: float
    loop_lag_max_ms: float
    suspect_events: int
    metrics_url: str
    tls_mode: str
    revoked_nodes: int
    trust: str
    reachability: str
    tunnels_to: _containers.RepeatedScalarFieldContainer[str]
    tunnels_from: _containers.RepeatedScalarFieldContainer[str]
    dial_backs_reached: int
    dial_backs_failed: int
    tunnelled_connections: int
    tunnelled_bytes: int
    relayed_to: _containers.RepeatedScalarFieldContainer[str]
    relay: bool
    relayed_connections: int
    relayed_bytes: int
    loop_lag_own_p99_ms: float
    loop_cpu_wait_s: float
    seeds: _containers.RepeatedCompositeFieldContainer[SeedStatus]
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., run_id: _Optional[str] = ..., uptime_s: _Optional[float] = ..., protocol_version: _Optional[int] = ..., peerd_version: _Optional[str] = ..., event_loop: _Optional[str] = ..., incarnation: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., data_dir: _Optional[str] = ..., tls: _Optional[bool] = ..., training_json: _Optional[str] = ..., refused_calls: _Optional[int] = ..., rate_limited_calls: _Optional[int] = ..., rate_limit_entries: _Optional[int] = ..., refusal_log_lines: _Optional[int] = ..., last_training_json: _Optional[str] = ..., loop_lag_p99_ms: _Optional[float] = ..., loop_lag_max_ms: _Optional[float] = ..., suspect_events: _Optional[int] = ..., metrics_url: _Optional[str] = ..., tls_mode: _Optional[str] = ..., revoked_nodes: _Optional[int] = ..., trust: _Optional[str] = ..., reachability: _Optional[str] = ..., tunnels_to: _Optional[_Iterable[str]] = ..., tunnels_from: _Optional[_Iterable[str]] = ..., dial_backs_reached: _Optional[int] = ..., dial_backs_failed: _Optional[int] = ..., tunnelled_connections: _Optional[int] = ..., tunnelled_bytes: _Optional[int] = ..., relayed_to: _Optional[_Iterable[str]] = ..., relay: _Optional[bool] = ..., relayed_connections: _Optional[int] = ..., relayed_bytes: _Optional[int] = ..., loop_lag_own_p99_ms: _Optional[float] = ..., loop_cpu_wait_s: _Optional[float] = ..., seeds: _Optional[_Iterable[_Union[SeedStatus, _Mapping]]] = ...) -> None: ...

class SeedStatus(_message.Message):
    __slots__ = ("address", "node_id", "failures", "last_error")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    address: str
    node_id: str
    failures: int
    last_error: str
    def __init__(self, address: _Optional[str] = ..., node_id: _Optional[str] = ..., failures: _Optional[int] = ..., last_error: _Optional[str] = ...) -> None: ...

class SwarmRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SwarmPeer(_message.Message):
    __slots__ = ("node_id", "address", "state", "answered", "error", "run_active", "run_tag", "iteration", "algorithm")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RUN_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    RUN_TAG_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    state: str
    answered: bool
    error: str
    run_active: bool
    run_tag: str
    iteration: int
    algorithm: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., answered: _Optional[bool] = ..., error: _Optional[str] = ..., run_active: _Optional[bool] = ..., run_tag: _Optional[str] = ..., iteration: _Optional[int] = ..., algorithm: _Optional[str] = ...) -> None: ...

class SwarmReply(_message.Message):
    __slots__ = ("status", "links", "peers", "progress")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    status: StatusReply
    links: LinksReply
    peers: _containers.RepeatedCompositeFieldContainer[SwarmPeer]
    progress: TrainProgress
    def __init__(self, status: _Optional[_Union[StatusReply, _Mapping]] = ..., links: _Optional[_Union[LinksReply, _Mapping]] = ..., peers: _Optional[_Iterable[_Union[SwarmPeer, _Mapping]]] = ..., progress: _Optional[_Union[TrainProgress, _Mapping]] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class LinksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinksReply(_message.Message):
    __slots__ = ("node_id", "links")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    links: _containers.RepeatedCompositeFieldContainer[LinkMeasurement]
    def __init__(self, node_id: _Optional[str] = ..., links: _Optional[_Iterable[_Union[LinkMeasurement, _Mapping]]] = ...) -> None: ...

class LinkMeasurement(_message.Message):
    __slots__ = ("measurer", "target", "throughput_bytes_s", "rtt_s", "age_s", "samples", "throughput_spread_bytes_s", "rtt_spread_s", "capacity_bytes_s", "capacity_age_s", "probe_phase")
    MEASURER_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_BYTES_S_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_SPREAD_BYTES_S_FIELD_NUMBER: _ClassVar[int]
    RTT_SPREAD_S_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_S_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_AGE_S_FIELD_NUMBER: _ClassVar[int]
    PROBE_PHASE_FIELD_NUMBER: _ClassVar[int]
    measurer: str
    target: str
    throughput_bytes_s: float
    rtt_s: float
    age_s: float
    samples: int
    throughput_spread_bytes_s: float
    rtt_spread_s: float
    capacity_bytes_s: float
    capacity_age_s: float
    probe_phase: str
    def __init__(self, measurer: _Optional[str] = ..., target: _Optional[str] = ..., throughput_bytes_s: _Optional[float] = ..., rtt_s: _Optional[float] = ..., age_s: _Optional[float] = ..., samples: _Optional[int] = ..., throughput_spread_bytes_s: _Optional[float] = ..., rtt_spread_s: _Optional[float] = ..., capacity_bytes_s: _Optional[float] = ..., capacity_age_s: _Optional[float] = ..., probe_phase: _Optional[str] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("task", "algorithm", "topology", "world", "iterations", "seed", "non_iid", "slowdown", "options", "script", "eval_every", "join_timeout_s", "max_world")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NON_IID_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SCRIPT_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_WORLD_FIELD_NUMBER: _ClassVar[int]
    task: str
    algorithm: str
    topology: str
    world: int
    iterations: int
    seed: int
    non_iid: bool
    slowdown: float
    options: _containers.ScalarMap[str, str]
    script: _containers.RepeatedScalarFieldContainer[str]
    eval_every: int
    join_timeout_s: float
    max_world: int
    def __init__(self, task: _Optional[str] = ..., algorithm: _Optional[str] = ..., topology: _Optional[str] = ..., world: _Optional[int] = ..., iterations: _Optional[int] = ..., seed: _Optional[int] = ..., non_iid: _Optional[bool] = ..., slowdown: _Optional[float] = ..., options: _Optional[_Mapping[str, str]] = ..., script: _Optional[_Iterable[str]] = ..., eval_every: _Optional[int] = ..., join_timeout_s: _Optional[float] = ..., max_world: _Optional[int] = ...) -> None: ...

class TrainProgress(_message.Message):
    __slots__ = ("state", "message", "iteration", "loss", "iterations_per_s", "peers_in_last_mix", "gap_to_fastest", "elapsed_s", "metric_name", "metric", "rank", "world", "trainer_restarts", "skipped", "wall_time", "mixes", "partial_mixes", "partial_note")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PEERS_IN_LAST_MIX_FIELD_NUMBER: _ClassVar[int]
    GAP_TO_FASTEST_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    METRIC_NAME_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_FIELD_NUMBER: _ClassVar[int]
    MIXES_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_MIXES_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_NOTE_FIELD_NUMBER: _ClassVar[int]
    state: str
    message: str
    iteration: int
    loss: float
    iterations_per_s: float
    peers_in_last_mix: int
    gap_to_fastest: int
    elapsed_s: float
    metric_name: str
    metric: float
    rank: int
    world: int
    trainer_restarts: int
    skipped: int
    wall_time: float
    mixes: int
    partial_mixes: int
    partial_note: str
    def __init__(self, state: _Optional[str] = ..., message: _Optional[str] = ..., iteration: _Optional[int] = ..., loss: _Optional[float] = ..., iterations_per_s: _Optional[float] = ..., peers_in_last_mix: _Optional[int] = ..., gap_to_fastest: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., metric_name: _Optional[str] = ..., metric: _Optional[float] = ..., rank: _Optional[int] = ..., world: _Optional[int] = ..., trainer_restarts: _Optional[int] = ..., skipped: _Optional[int] = ..., wall_time: _Optional[float] = ..., mixes: _Optional[int] = ..., partial_mixes: _Optional[int] = ..., partial_note: _Optional[str] = ...) -> None: ...

class LayoutEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("run_id", "layout", "total_bytes", "optimizer", "pid")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    layout: _containers.RepeatedCompositeFieldContainer[LayoutEntry]
    total_bytes: int
    optimizer: str
    pid: int
    def __init__(self, run_id: _Optional[str] = ..., layout: _Optional[_Iterable[_Union[LayoutEntry, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., optimizer: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("node_id", "session_id", "slot_paths", "start_iteration", "rank", "world", "start_from_slot", "join_note", "mix_timeout_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_PATHS_FIELD_NUMBER: _ClassVar[int]
    START_ITERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    START_FROM_SLOT_FIELD_NUMBER: _ClassVar[int]
    JOIN_NOTE_FIELD_NUMBER: _ClassVar[int]
    MIX_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session_id: str
    slot_paths: _containers.RepeatedScalarFieldContainer[str]
    start_iteration: int
    rank: int
    world: int
    start_from_slot: bool
    join_note: str
    mix_timeout_s: float
    def __init__(self, node_id: _Optional[str] = ..., session_id: _Optional[str] = ..., slot_paths: _Optional[_Iterable[str]] = ..., start_iteration: _Optional[int] = ..., rank: _Optional[int] = ..., world: _Optional[int] = ..., start_from_slot: _Optional[bool] = ..., join_note: _Optional[str] = ..., mix_timeout_s: _Optional[float] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("session_id", "iteration", "slot", "seq", "mass", "ranges")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MASS_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    iteration: int
    slot: int
    seq: int
    mass: float
    ranges: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., iteration: _Optional[int] = ..., slot: _Optional[int] = ..., seq: _Optional[int] = ..., mass: _Optional[float] = ..., ranges: _Optional[_Iterable[int]] = ...) -> None: ...

class PublishReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MixRequest(_message.Message):
    __slots__ = ("session_id", "iteration", "slot", "metric")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    iteration: int
    slot: int
    metric: Metric
    def __init__(self, session_id: _Optional[str] = ..., iteration: _Optional[int] = ..., slot: _Optional[int] = ..., metric: _Optional[_Union[Metric, _Mapping]] = ...) -> None: ...

class MixEntry(_message.Message):
    __slots__ = ("src", "iteration", "weight")
    SRC_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    src: str
    iteration: int
    weight: float
    def __init__(self, src: _Optional[str] = ..., iteration: _Optional[int] = ..., weight: _Optional[float] = ...) -> None: ...

class MixReply(_message.Message):
    __slots__ = ("iteration", "entries", "skip_to")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SKIP_TO_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    entries: _containers.RepeatedCompositeFieldContainer[MixEntry]
    skip_to: int
    def __init__(self, iteration: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[MixEntry, _Mapping]]] = ..., skip_to: _Optional[int] = ...) -> None: ...

class Metric(_message.Message):
    __slots__ = ("session_id", "iteration", "loss", "samples", "step_time_s", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    iteration: int
    loss: float
    samples: int
    step_time_s: float
    extra: _containers.ScalarMap[str, float]
    def __init__(self, session_id: _Optional[str] = ..., iteration: _Optional[int] = ..., loss: _Optional[float] = ..., samples: _Optional[int] = ..., step_time_s: _Optional[float] = ..., extra: _Optional[_Mapping[str, float]] = ...) -> None: ...

class MetricAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DirectivesRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("kind", "iteration", "reason")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Directive.Kind]
        KIND_SKIP_TO: _ClassVar[Directive.Kind]
        KIND_PAUSE: _ClassVar[Directive.Kind]
        KIND_RESUME: _ClassVar[Directive.Kind]
        KIND_CHECKPOINT: _ClassVar[Directive.Kind]
        KIND_STOP: _ClassVar[Directive.Kind]
    KIND_UNSPECIFIED: Directive.Kind
    KIND_SKIP_TO: Directive.Kind
    KIND_PAUSE: Directive.Kind
    KIND_RESUME: Directive.Kind
    KIND_CHECKPOINT: Directive.Kind
    KIND_STOP: Directive.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: Directive.Kind
    iteration: int
    reason: str
    def __init__(self, kind: _Optional[_Union[Directive.Kind, str]] = ..., iteration: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class DirectRequest(_message.Message):
    __slots__ = ("directive",)
    DIRECTIVE_FIELD_NUMBER: _ClassVar[int]
    directive: Directive
    def __init__(self, directive: _Optional[_Union[Directive, _Mapping]] = ...) -> None: ...

class DirectReply(_message.Message):
    __slots__ = ("delivered",)
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    delivered: int
    def __init__(self, delivered: _Optional[int] = ...) -> None: ...

class RevokeRequest(_message.Message):
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

class RevokeReply(_message.Message):
    __slots__ = ("added", "revoked_nodes")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REVOKED_NODES_FIELD_NUMBER: _ClassVar[int]
    added: bool
    revoked_nodes: int
    def __init__(self, added: _Optional[bool] = ..., revoked_nodes: _Optional[int] = ...) -> None: ...
