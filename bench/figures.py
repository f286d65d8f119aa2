"""The figures each report suite returns, as frozen records (:mod:`bench.typed`).

A suite's runner returns one of the ``*Result`` records below; the session writes it to
``<stem>.json`` and the report, the plots and ``merge`` read it back through the same
record, so a field the renderer reads is checked when the file is loaded, not when a
table happens to reach it. Fields typed ``Json`` are the raw per-run records kept for
whoever opens the JSON (fio's figures per repetition, DLIO's per-epoch output): the
report does not read them, so their shape is not pinned here. Defaults are there for
files written before a field existed (or by a test), never to hide a missing figure the
report reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.fio import FioMetrics
from bench.typed import Json, Record, key

# -- overhead and metadata: rows of fio figures per side (native, no-qos, policy...) --


@dataclass(frozen=True, kw_only=True)
class SideFigures(Record):
    """One side of a row: medians over its repetitions."""

    value: float | None  # the row's figure: bytes/s or ops/s
    reps: int
    clat_p50_us: float | None
    clat_p99_us: float | None
    clat_p999_us: float | None
    daemon_cpu_pct: float | None


@dataclass(frozen=True, kw_only=True)
class SummaryRow(Record):
    key: str
    label: str
    group: str
    area: str
    metric: str  # "bw" or "iops"
    target: float | None
    sides: dict[str, SideFigures]
    ratio_to_native: dict[str, float]
    machinery: float | None  # policy / no-qos
    error: str | None
    max_other_cpu_pct: float | None

    def side(self, name: str, what: str = "value") -> float | None:
        """A figure of side *name* (None when the side did not run)."""
        s = self.sides.get(name)
        return None if s is None else getattr(s, what)

    def over(self, a: str, b: str) -> float | None:
        """Side *a*'s figure / side *b*'s, when both ran."""
        va, vb = self.side(a), self.side(b)
        return va / vb if va is not None and vb else None


@dataclass(frozen=True, kw_only=True)
class OverheadResult(Record):
    summary: list[SummaryRow]
    policy: str
    caches_dropped: bool = False
    groups: Json = None  # per group: env, error, every fio record per side


@dataclass(frozen=True, kw_only=True)
class HandlerCost(Record):
    no_qos_us: float
    policy_us: float
    added_us: float


@dataclass(frozen=True, kw_only=True)
class HandlerCosts(Record):
    """bench.machinery.measure: handler microseconds per metadata operation."""

    files: int
    rounds: int
    ops: dict[str, HandlerCost]


@dataclass(frozen=True, kw_only=True)
class MetadataResult(Record):
    summary: list[SummaryRow]
    nrfiles: int
    meta_cap: int
    policy: str
    in_process: HandlerCosts | None = None
    caches_dropped: bool = False
    groups: Json = None


# -- caps --


@dataclass(frozen=True, kw_only=True)
class CapLevel(Record):
    """One cap of a workload; without steady windows only ``windows`` (0) is known."""

    level: str
    cap: float
    has_demand: bool
    fio_rate: float
    windows: int
    span_s: float | None = None
    long_window_s: float | None = None
    achieved: float | None = None
    worst_1s_pct: float | None = None
    worst_long_pct: float | None = None
    idle_windows: int = 0
    waiting: list[float] = field(default_factory=list)
    per_second: list[float] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class CapWorkload(Record):
    key: str
    label: str
    demand: float
    levels: list[CapLevel]


@dataclass(frozen=True, kw_only=True)
class CapsResult(Record):
    workloads: list[CapWorkload]
    runtime_s: int
    policy: str
    elapsed_s: float | None = None


# -- isolation --


@dataclass(frozen=True, kw_only=True)
class IsolationRow(Record):
    """A scenario's reader (medians) and its ratios to the solo reader of its kind."""

    scenario: str
    baseline: str
    reps: int
    storm_bw: float | None
    bw_bytes: float | None
    bw_bytes_ratio: float | None
    clat_p50_us: float | None
    clat_p50_us_ratio: float | None
    clat_p99_us: float | None
    clat_p99_us_ratio: float | None
    clat_p999_us: float | None
    clat_p999_us_ratio: float | None
    daemon_cpu_pct: float | None = None
    machine_busy_pct: float | None = None


@dataclass(frozen=True, kw_only=True)
class WriteCost(Record):
    cap: str | None
    storm_bw: float
    daemon_cpu_pct: float | None
    daemon_ms_per_mib: float
    wall_s: float | None = None
    machine_busy_pct: float | None = None


Series = list[tuple[float, float]]  # (s, bytes/s)


@dataclass(frozen=True, kw_only=True)
class Burst(Record):
    cap: str | None
    series: dict[str, Series]
    reader_during: float | None
    reader_between: float | None
    reader: FioMetrics
    checkpoint: FioMetrics
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class IsolationResult(Record):
    headline_cap: str
    sweep: list[str]
    policy: str
    reader_env: dict[str, str]
    storm_env: dict[str, str]
    summary: list[IsolationRow]
    bursts: list[Burst]
    write_cost: list[WriteCost] = field(default_factory=list)
    runs: Json = None  # per scenario, every repetition's fio figures

    def row(self, scenario: str) -> IsolationRow | None:
        return next((r for r in self.summary if r.scenario == scenario), None)


# -- live change --


@dataclass(frozen=True, kw_only=True)
class DelaySummary(Record):
    median_delay_ms: float
    max_delay_ms: float
    n: int


@dataclass(frozen=True, kw_only=True)
class StepChange(Record):
    at_s: float
    from_: str = field(metadata=key("from"))
    to: str
    settle_ms: float | None


@dataclass(frozen=True, kw_only=True)
class Step(Record):
    block: int
    bin_s: float
    changes: list[StepChange]
    series: Series
    caps: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class CtlStatusTimes(Record):
    """Whole ``qosfs ctl status`` processes, start to exit, and the interpreter alone."""

    n: int
    median_ms: float
    max_ms: float
    python_median_ms: float
    busy_before_pct: float  # the machine (other tenants) just before the runs
    runs_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class LiveChangeResult(Record):
    low: str
    high: str
    summary: dict[str, DelaySummary]  # per method: set, reload, cli-set
    all_parked: bool
    step: Step
    repetitions: Json = None
    ctl_status: CtlStatusTimes | None = None  # absent from runs before issue 38


# -- fair share --


@dataclass(frozen=True, kw_only=True)
class FairPhase(Record):
    phase: int
    active: list[int]
    share: float
    achieved: dict[str, float | None]  # per uid
    worst_pct: float | None
    total: float
    skipped_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class FairshareResult(Record):
    cap: str
    phase_s: int
    idle_after_s: float
    phases: list[FairPhase]
    series: dict[str, Series]  # per uid
    policy: str
    uids: list[int] = field(default_factory=list)
    schedule: Json = None


# -- priorities --


@dataclass(frozen=True, kw_only=True)
class ClassShare(Record):
    class_: str = field(metadata=key("class"))
    expected: float
    achieved: float | None
    error_pct: float | None
    error_backend_pct: float | None


@dataclass(frozen=True, kw_only=True)
class PriorityScenario(Record):
    name: str
    low_min: str | None
    classes: list[ClassShare]
    windows: int = 0


@dataclass(frozen=True, kw_only=True)
class PrioritiesResult(Record):
    backend: str
    weights: dict[str, int]
    runtime_s: int
    writers: int
    policy: str
    scenarios: list[PriorityScenario]


# -- data loader --


@dataclass(frozen=True, kw_only=True)
class LoaderFigures(Record):
    """Medians of an epoch (cold, cached) or of a big file's re-read (MB/s only)."""

    mb_per_s: float
    samples_per_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    samples: float | None = None


@dataclass(frozen=True, kw_only=True)
class LoaderResult(Record):
    samples: int
    workers: int
    big_mib: int
    reps: int
    summary: dict[str, dict[str, LoaderFigures]]  # side -> cold/cached/reread
    runs: Json = None


# -- storage-bound --


@dataclass(frozen=True, kw_only=True)
class StorageFigures(Record):
    mb_per_s: float
    p99_ms: float
    p50_ms: float


@dataclass(frozen=True, kw_only=True)
class StorageSide(Record):
    alone: StorageFigures
    storm_alone: StorageFigures
    with_storm: StorageFigures
    storm: StorageFigures


@dataclass(frozen=True, kw_only=True)
class StorageResult(Record):
    sides: dict[str, StorageSide]  # bare, no-qos, policy
    reader_keeps_target: float
    p99_target: float


# -- envelope --


@dataclass(frozen=True, kw_only=True)
class EnvelopeResult(Record):
    seconds: int
    files: int
    reps: int
    summary: dict[str, dict[str, list[float]]]  # side -> figure -> one per repetition


# -- peer: libfuse's passthrough_hp beside native and qosfs --

# Columns of the two tables, in order; the workloads (rows) in order, with their units.
PEER_TMPFS_COLUMNS = ("native", "hp-single", "hp-multi", "hp-passthrough", "no-qos",
                      "policy")
PEER_DISK_COLUMNS = ("native", "hp-single", "hp-passthrough", "policy")
PEER_FIO = ("randread_4k_qd1_iops", "randread_4k_4jobs_iops", "randread_128k_qd1_mb_s",
            "read_1m_direct_mb_s")
PEER_LOADER = ("loader_cold_files_s", "loader_warm_files_s")


@dataclass(frozen=True, kw_only=True)
class PeerResult(Record):
    """bench.peer: each column's figure per workload (``tmpfs``: PEER_FIO and PEER_LOADER;
    ``disk``: PEER_LOADER); a column or workload that could not run is absent, with its
    one-line reason in ``errors``."""

    seconds: int  # fio runtime per job
    tmpfs_files: int
    tmpfs_file_kib: int
    tmpfs_workers: int
    disk_files: int
    disk_file_kib: int
    disk_workers: int
    disk: str | None  # what the disk table ran on ("ext4 on /dev/vda, /var/tmp"), or None
    peer: str | None  # the passthrough_hp binary measured, or None
    peer_missing: str | None  # why passthrough_hp was not measured (one line)
    peer_passthrough: bool | None  # its kernel passthrough column really passed through
    tmpfs: dict[str, dict[str, float]]  # column -> workload -> figure
    disk_figures: dict[str, dict[str, float]]
    errors: dict[str, str]  # "<table> <column>" -> one line
    # how busy the machine was just before each column ran, nothing of the suite's running
    # (other tenants; 100 = every CPU), per table
    busy_pct: dict[str, dict[str, float]] = field(default_factory=dict)
    qosfs_passthrough: Json = None  # `ctl status`'s "passthrough" entry, when it has one


# -- training (DLIO) --


@dataclass(frozen=True, kw_only=True)
class DlioShape(Record):
    """bench.training.Shape as written to JSON."""

    name: str
    record_length: int
    files: int
    files_quick: int
    batch_size: int
    computation_time: float
    read_threads: int


@dataclass(frozen=True, kw_only=True)
class StormShape(Record):
    """bench.training.Storm as written to JSON."""

    ranks: int
    shard: int
    interval: float


@dataclass(frozen=True, kw_only=True)
class CheckpointRound(Record):
    round: int
    kind: str
    mode: str
    ranks: int
    bytes: int
    start: float
    end: float
    duration_s: float
    blocked_s: float
    write_start: float | None = None
    write_s: float | None = None
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class PlanRow(Record):
    round: int
    way: str
    bytes: int
    measured_s: float
    planned_s: float
    error_pct: float
    cap_in_force: float | None = None
    planned_in_force_s: float | None = None
    error_in_force_pct: float | None = None


@dataclass(frozen=True, kw_only=True)
class TrainingScenario(Record):
    label: str
    serve: str
    storm: bool
    au_pct: list[float]
    read_mib_s: list[float]
    rounds: list[CheckpointRound]
    cap: float | None
    burst: float | None
    plan: list[PlanRow]
    daemon_cpu_pct: float | None
    epochs: Json = None  # DLIO's figures per epoch
    # s from the storm's start to its first round (0: writing when the first epoch starts)
    storm_lead_s: float | None = None
    cap_changes: Json = None


@dataclass(frozen=True, kw_only=True)
class ShapeRun(Record):
    shape: DlioShape
    files: int
    area: str
    config: Json  # the DLIO workload configuration, shown as it is
    scenarios: list[TrainingScenario]
    cap: float
    burst: float

    def scenario(self, label: str) -> TrainingScenario | None:
        return next((s for s in self.scenarios if s.label == label), None)


@dataclass(frozen=True, kw_only=True)
class TrainingResult(Record):
    shapes: dict[str, ShapeRun]
    storm: StormShape
    epochs: int
    latency_target: str
    versions: dict[str, str]
    au_pass_pct: float
    storm_keeps: float
    plan_pct: float
