from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GpuInfo(_message.Message):
    __slots__ = ("index", "uuid", "name", "pci_bus_id", "pcie_gen_max", "pcie_gen_current", "pcie_width_max", "pcie_width_current", "memory_total_bytes", "mig_mode", "virtualization_mode", "numa_node")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    PCIE_GEN_MAX_FIELD_NUMBER: _ClassVar[int]
    PCIE_GEN_CURRENT_FIELD_NUMBER: _ClassVar[int]
    PCIE_WIDTH_MAX_FIELD_NUMBER: _ClassVar[int]
    PCIE_WIDTH_CURRENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIG_MODE_FIELD_NUMBER: _ClassVar[int]
    VIRTUALIZATION_MODE_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    pcie_gen_max: int
    pcie_gen_current: int
    pcie_width_max: int
    pcie_width_current: int
    memory_total_bytes: int
    mig_mode: str
    virtualization_mode: str
    numa_node: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., pcie_gen_max: _Optional[int] = ..., pcie_gen_current: _Optional[int] = ..., pcie_width_max: _Optional[int] = ..., pcie_width_current: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., mig_mode: _Optional[str] = ..., virtualization_mode: _Optional[str] = ..., numa_node: _Optional[int] = ...) -> None: ...

class Fingerprint(_message.Message):
    __slots__ = ("cpuid_hypervisor_bit", "cpuid_hypervisor_vendor", "dmi_sys_vendor", "dmi_product_name", "sys_hypervisor_type", "container_markers", "container_runtime", "nvml_virtualization_mode", "virt_type", "virtualized", "in_container", "clocksource")
    CPUID_HYPERVISOR_BIT_FIELD_NUMBER: _ClassVar[int]
    CPUID_HYPERVISOR_VENDOR_FIELD_NUMBER: _ClassVar[int]
    DMI_SYS_VENDOR_FIELD_NUMBER: _ClassVar[int]
    DMI_PRODUCT_NAME_FIELD_NUMBER: _ClassVar[int]
    SYS_HYPERVISOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_MARKERS_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_RUNTIME_FIELD_NUMBER: _ClassVar[int]
    NVML_VIRTUALIZATION_MODE_FIELD_NUMBER: _ClassVar[int]
    VIRT_TYPE_FIELD_NUMBER: _ClassVar[int]
    VIRTUALIZED_FIELD_NUMBER: _ClassVar[int]
    IN_CONTAINER_FIELD_NUMBER: _ClassVar[int]
    CLOCKSOURCE_FIELD_NUMBER: _ClassVar[int]
    cpuid_hypervisor_bit: bool
    cpuid_hypervisor_vendor: str
    dmi_sys_vendor: str
    dmi_product_name: str
    sys_hypervisor_type: str
    container_markers: _containers.RepeatedScalarFieldContainer[str]
    container_runtime: str
    nvml_virtualization_mode: str
    virt_type: str
    virtualized: bool
    in_container: bool
    clocksource: str
    def __init__(self, cpuid_hypervisor_bit: _Optional[bool] = ..., cpuid_hypervisor_vendor: _Optional[str] = ..., dmi_sys_vendor: _Optional[str] = ..., dmi_product_name: _Optional[str] = ..., sys_hypervisor_type: _Optional[str] = ..., container_markers: _Optional[_Iterable[str]] = ..., container_runtime: _Optional[str] = ..., nvml_virtualization_mode: _Optional[str] = ..., virt_type: _Optional[str] = ..., virtualized: _Optional[bool] = ..., in_container: _Optional[bool] = ..., clocksource: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("hostname", "machine_id", "agent_version", "labels", "cpu_model", "cpu_cores_logical", "cpu_cores_physical", "memory_total_bytes", "kernel", "driver_version", "cuda_version", "gpus", "fingerprint", "numa_nodes", "os", "boot_time_ns", "fabric_address", "path_port")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CPU_MODEL_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_LOGICAL_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_PHYSICAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODES_FIELD_NUMBER: _ClassVar[int]
    OS_FIELD_NUMBER: _ClassVar[int]
    BOOT_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    FABRIC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PATH_PORT_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    machine_id: str
    agent_version: str
    labels: _containers.ScalarMap[str, str]
    cpu_model: str
    cpu_cores_logical: int
    cpu_cores_physical: int
    memory_total_bytes: int
    kernel: str
    driver_version: str
    cuda_version: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    fingerprint: Fingerprint
    numa_nodes: int
    os: str
    boot_time_ns: int
    fabric_address: str
    path_port: int
    def __init__(self, hostname: _Optional[str] = ..., machine_id: _Optional[str] = ..., agent_version: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., cpu_model: _Optional[str] = ..., cpu_cores_logical: _Optional[int] = ..., cpu_cores_physical: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., kernel: _Optional[str] = ..., driver_version: _Optional[str] = ..., cuda_version: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., numa_nodes: _Optional[int] = ..., os: _Optional[str] = ..., boot_time_ns: _Optional[int] = ..., fabric_address: _Optional[str] = ..., path_port: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("node_id", "last_committed_seq")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMITTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    last_committed_seq: int
    def __init__(self, node_id: _Optional[str] = ..., last_committed_seq: _Optional[int] = ...) -> None: ...

class Series(_message.Message):
    __slots__ = ("id", "metric", "gpu", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    id: int
    metric: str
    gpu: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[int] = ..., metric: _Optional[str] = ..., gpu: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SampleColumns(_message.Message):
    __slots__ = ("series", "ts_ns", "series_id", "value")
    SERIES_FIELD_NUMBER: _ClassVar[int]
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    SERIES_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    series: _containers.RepeatedCompositeFieldContainer[Series]
    ts_ns: _containers.RepeatedScalarFieldContainer[int]
    series_id: _containers.RepeatedScalarFieldContainer[int]
    value: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, series: _Optional[_Iterable[_Union[Series, _Mapping]]] = ..., ts_ns: _Optional[_Iterable[int]] = ..., series_id: _Optional[_Iterable[int]] = ..., value: _Optional[_Iterable[float]] = ...) -> None: ...

class SummaryColumns(_message.Message):
    __slots__ = ("series", "interval_ns", "start_ns", "series_id", "count", "sum", "min", "max")
    SERIES_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_NS_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    SERIES_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    series: _containers.RepeatedCompositeFieldContainer[Series]
    interval_ns: int
    start_ns: _containers.RepeatedScalarFieldContainer[int]
    series_id: _containers.RepeatedScalarFieldContainer[int]
    count: _containers.RepeatedScalarFieldContainer[int]
    sum: _containers.RepeatedScalarFieldContainer[float]
    min: _containers.RepeatedScalarFieldContainer[float]
    max: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, series: _Optional[_Iterable[_Union[Series, _Mapping]]] = ..., interval_ns: _Optional[int] = ..., start_ns: _Optional[_Iterable[int]] = ..., series_id: _Optional[_Iterable[int]] = ..., count: _Optional[_Iterable[int]] = ..., sum: _Optional[_Iterable[float]] = ..., min: _Optional[_Iterable[float]] = ..., max: _Optional[_Iterable[float]] = ...) -> None: ...

class RawWindow(_message.Message):
    __slots__ = ("request_id", "since_ns", "until_ns", "samples", "final", "held_since_ns")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    HELD_SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    since_ns: int
    until_ns: int
    samples: SampleColumns
    final: bool
    held_since_ns: int
    def __init__(self, request_id: _Optional[str] = ..., since_ns: _Optional[int] = ..., until_ns: _Optional[int] = ..., samples: _Optional[_Union[SampleColumns, _Mapping]] = ..., final: _Optional[bool] = ..., held_since_ns: _Optional[int] = ...) -> None: ...

class ProbeResult(_message.Message):
    __slots__ = ("probe", "status", "reason", "params", "metrics", "started_ns", "ended_ns", "env", "gpu")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROBE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STARTED_NS_FIELD_NUMBER: _ClassVar[int]
    ENDED_NS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    probe: str
    status: str
    reason: str
    params: _containers.ScalarMap[str, str]
    metrics: _containers.ScalarMap[str, float]
    started_ns: int
    ended_ns: int
    env: _containers.ScalarMap[str, str]
    gpu: int
    def __init__(self, probe: _Optional[str] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., started_ns: _Optional[int] = ..., ended_ns: _Optional[int] = ..., env: _Optional[_Mapping[str, str]] = ..., gpu: _Optional[int] = ...) -> None: ...

class JobSample(_message.Message):
    __slots__ = ("ts_ns", "job_id", "job_name", "source", "pid", "rank", "local_rank", "world_size", "gpu", "gpu_util_percent", "gpu_memory_bytes", "cpu_percent", "rss_bytes", "read_bytes_per_s", "write_bytes_per_s", "attrs")
    class AttrsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    GPU_UTIL_PERCENT_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    WRITE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    ATTRS_FIELD_NUMBER: _ClassVar[int]
    ts_ns: int
    job_id: str
    job_name: str
    source: str
    pid: int
    rank: int
    local_rank: int
    world_size: int
    gpu: int
    gpu_util_percent: float
    gpu_memory_bytes: float
    cpu_percent: float
    rss_bytes: float
    read_bytes_per_s: float
    write_bytes_per_s: float
    attrs: _containers.ScalarMap[str, str]
    def __init__(self, ts_ns: _Optional[int] = ..., job_id: _Optional[str] = ..., job_name: _Optional[str] = ..., source: _Optional[str] = ..., pid: _Optional[int] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., gpu: _Optional[int] = ..., gpu_util_percent: _Optional[float] = ..., gpu_memory_bytes: _Optional[float] = ..., cpu_percent: _Optional[float] = ..., rss_bytes: _Optional[float] = ..., read_bytes_per_s: _Optional[float] = ..., write_bytes_per_s: _Optional[float] = ..., attrs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class JobStep(_message.Message):
    __slots__ = ("ts_ns", "job_id", "job_name", "rank", "window_s", "steps", "step_time_p50_s", "step_time_p95_s", "step_time_max_s", "steps_per_s", "samples_per_s", "tokens_per_s", "data_wait_fraction", "pid", "step_time_mean_s", "model_flops_per_s", "peak_flops_per_s", "mfu")
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_P50_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_P95_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MAX_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DATA_WAIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MEAN_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FLOPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_FLOPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MFU_FIELD_NUMBER: _ClassVar[int]
    ts_ns: int
    job_id: str
    job_name: str
    rank: int
    window_s: float
    steps: int
    step_time_p50_s: float
    step_time_p95_s: float
    step_time_max_s: float
    steps_per_s: float
    samples_per_s: float
    tokens_per_s: float
    data_wait_fraction: float
    pid: int
    step_time_mean_s: float
    model_flops_per_s: float
    peak_flops_per_s: float
    mfu: float
    def __init__(self, ts_ns: _Optional[int] = ..., job_id: _Optional[str] = ..., job_name: _Optional[str] = ..., rank: _Optional[int] = ..., window_s: _Optional[float] = ..., steps: _Optional[int] = ..., step_time_p50_s: _Optional[float] = ..., step_time_p95_s: _Optional[float] = ..., step_time_max_s: _Optional[float] = ..., steps_per_s: _Optional[float] = ..., samples_per_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., data_wait_fraction: _Optional[float] = ..., pid: _Optional[int] = ..., step_time_mean_s: _Optional[float] = ..., model_flops_per_s: _Optional[float] = ..., peak_flops_per_s: _Optional[float] = ..., mfu: _Optional[float] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("ts_ns", "kind", "gpu", "message", "value", "attrs")
    class AttrsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ATTRS_FIELD_NUMBER: _ClassVar[int]
    ts_ns: int
    kind: str
    gpu: int
    message: str
    value: float
    attrs: _containers.ScalarMap[str, str]
    def __init__(self, ts_ns: _Optional[int] = ..., kind: _Optional[str] = ..., gpu: _Optional[int] = ..., message: _Optional[str] = ..., value: _Optional[float] = ..., attrs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("node_id", "seq", "created_ns", "samples", "probe_results", "job_samples", "job_steps", "events", "summaries", "raw_windows")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CREATED_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROBE_RESULTS_FIELD_NUMBER: _ClassVar[int]
    JOB_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    JOB_STEPS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SUMMARIES_FIELD_NUMBER: _ClassVar[int]
    RAW_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    seq: int
    created_ns: int
    samples: SampleColumns
    probe_results: _containers.RepeatedCompositeFieldContainer[ProbeResult]
    job_samples: _containers.RepeatedCompositeFieldContainer[JobSample]
    job_steps: _containers.RepeatedCompositeFieldContainer[JobStep]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    summaries: SummaryColumns
    raw_windows: _containers.RepeatedCompositeFieldContainer[RawWindow]
    def __init__(self, node_id: _Optional[str] = ..., seq: _Optional[int] = ..., created_ns: _Optional[int] = ..., samples: _Optional[_Union[SampleColumns, _Mapping]] = ..., probe_results: _Optional[_Iterable[_Union[ProbeResult, _Mapping]]] = ..., job_samples: _Optional[_Iterable[_Union[JobSample, _Mapping]]] = ..., job_steps: _Optional[_Iterable[_Union[JobStep, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., summaries: _Optional[_Union[SummaryColumns, _Mapping]] = ..., raw_windows: _Optional[_Iterable[_Union[RawWindow, _Mapping]]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq", "duplicate", "highest_committed_seq", "raw_requests")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_COMMITTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    RAW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    duplicate: bool
    highest_committed_seq: int
    raw_requests: _containers.RepeatedCompositeFieldContainer[RawWindowRequest]
    def __init__(self, seq: _Optional[int] = ..., duplicate: _Optional[bool] = ..., highest_committed_seq: _Optional[int] = ..., raw_requests: _Optional[_Iterable[_Union[RawWindowRequest, _Mapping]]] = ...) -> None: ...

class RawWindowRequest(_message.Message):
    __slots__ = ("request_id", "since_ns", "until_ns")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    since_ns: int
    until_ns: int
    def __init__(self, request_id: _Optional[str] = ..., since_ns: _Optional[int] = ..., until_ns: _Optional[int] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("sql", "max_rows")
    SQL_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    sql: str
    max_rows: int
    def __init__(self, sql: _Optional[str] = ..., max_rows: _Optional[int] = ...) -> None: ...

class QueryResponse(_message.Message):
    __slots__ = ("columns", "column_types", "rows_json", "truncated")
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    COLUMN_TYPES_FIELD_NUMBER: _ClassVar[int]
    ROWS_JSON_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    columns: _containers.RepeatedScalarFieldContainer[str]
    column_types: _containers.RepeatedScalarFieldContainer[str]
    rows_json: str
    truncated: bool
    def __init__(self, columns: _Optional[_Iterable[str]] = ..., column_types: _Optional[_Iterable[str]] = ..., rows_json: _Optional[str] = ..., truncated: _Optional[bool] = ...) -> None: ...

class AnalyzeRequest(_message.Message):
    __slots__ = ("window_s", "max_flags", "wait_actions_s")
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    MAX_FLAGS_FIELD_NUMBER: _ClassVar[int]
    WAIT_ACTIONS_S_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    max_flags: int
    wait_actions_s: float
    def __init__(self, window_s: _Optional[float] = ..., max_flags: _Optional[int] = ..., wait_actions_s: _Optional[float] = ...) -> None: ...

class AnalyzeResponse(_message.Message):
    __slots__ = ("pass_json", "flags_json", "truncated", "actions_json", "actions_pending")
    PASS_JSON_FIELD_NUMBER: _ClassVar[int]
    FLAGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_PENDING_FIELD_NUMBER: _ClassVar[int]
    pass_json: str
    flags_json: str
    truncated: bool
    actions_json: str
    actions_pending: bool
    def __init__(self, pass_json: _Optional[str] = ..., flags_json: _Optional[str] = ..., truncated: _Optional[bool] = ..., actions_json: _Optional[str] = ..., actions_pending: _Optional[bool] = ...) -> None: ...

class RawWindowAsk(_message.Message):
    __slots__ = ("node_id", "seconds", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    seconds: float
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., seconds: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class RawWindowAskReply(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AssignmentsRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("kind", "pair_id", "role", "peer_node_id", "peer_address", "port_lo", "port_hi", "port", "secret", "probe", "params", "deadline_ns", "reason", "node_a", "node_b", "members", "node_rank", "peer_addresses", "epoch")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PEER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_LO_FIELD_NUMBER: _ClassVar[int]
    PORT_HI_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_NS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_A_FIELD_NUMBER: _ClassVar[int]
    NODE_B_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    kind: str
    pair_id: str
    role: str
    peer_node_id: str
    peer_address: str
    port_lo: int
    port_hi: int
    port: int
    secret: str
    probe: str
    params: _containers.ScalarMap[str, str]
    deadline_ns: int
    reason: str
    node_a: str
    node_b: str
    members: _containers.RepeatedScalarFieldContainer[str]
    node_rank: int
    peer_addresses: _containers.RepeatedScalarFieldContainer[str]
    epoch: int
    def __init__(self, kind: _Optional[str] = ..., pair_id: _Optional[str] = ..., role: _Optional[str] = ..., peer_node_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., port_lo: _Optional[int] = ..., port_hi: _Optional[int] = ..., port: _Optional[int] = ..., secret: _Optional[str] = ..., probe: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ..., deadline_ns: _Optional[int] = ..., reason: _Optional[str] = ..., node_a: _Optional[str] = ..., node_b: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., node_rank: _Optional[int] = ..., peer_addresses: _Optional[_Iterable[str]] = ..., epoch: _Optional[int] = ...) -> None: ...

class AssignmentAnswer(_message.Message):
    __slots__ = ("node_id", "pair_id", "accepted", "reason", "port", "finished", "status")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    pair_id: str
    accepted: bool
    reason: str
    port: int
    finished: bool
    status: str
    def __init__(self, node_id: _Optional[str] = ..., pair_id: _Optional[str] = ..., accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., port: _Optional[int] = ..., finished: _Optional[bool] = ..., status: _Optional[str] = ...) -> None: ...

class AssignmentAnswerAck(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...
