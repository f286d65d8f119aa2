"""Prometheus metrics: a custom collector that publishes a
:class:`~qosfs.control.snapshot.Snapshot`.

The hot path never touches prometheus_client: ``Counter.labels().inc()`` takes a lock and
a label lookup per call. Requests bump plain integers (:mod:`qosfs.qos.accounting`,
:mod:`qosfs.qos.levels`); at scrape time the exporter takes a snapshot on the event loop and
this collector turns it into metric families, in a worker thread.

Families (label sets in braces; an empty label value means "not applicable"). Every
sample also carries ``mount`` (the mountpoint), so one node's mounts read apart:

Traffic, per account ``{class, tenant, uid}`` (uid only for ``per_user`` classes):
``qosfs_read_bytes_total``, ``qosfs_write_bytes_total``, ``qosfs_ops_total{op}``
(read, write, meta; meta ops are classified and counted only when some ``meta_iops`` cap
exists), ``qosfs_throttled_seconds_total`` (time requests spent waiting for tokens),
``qosfs_request_duration_seconds{op}`` (histogram of the whole request, throttle wait
included) and ``qosfs_backend_duration_seconds{op}`` (the backing syscall alone).

Enforcement, per level ``{level, class, tenant, uid}`` (level: class, user, tenant,
backend; the labels naming the level are filled, the same as traffic's, so a rate and its
cap match on ``class`` without ``label_replace``):
``qosfs_queue_depth`` (requests parked now), ``qosfs_level_throttled_seconds_total``,
``qosfs_limit_bytes_per_second{direction}``, ``qosfs_limit_ops_per_second{op}`` (caps in
force; unlimited ones are absent).

Latency control (:mod:`qosfs.qos.latency`), when some class has a target:
``qosfs_latency_target_seconds{class}``, ``qosfs_latency_observed_seconds{class}`` (the
estimate of the last window; absent when not judged), ``qosfs_latency_target_met{class}``
(1 met or idle, 0 missed), ``qosfs_latency_control_state{state}`` (1 for the current one
of idle, watching, throttling, unreachable), ``qosfs_latency_auto_limit_bytes_per_second
{class, direction}`` (automatic caps; the cap in force is in ``qosfs_limit_...``) and
``qosfs_latency_control_decisions_total{action}`` (decrease, increase, release). How a
class's protection began: ``qosfs_latency_active{class}`` (1 while it opens, reads or
makes metadata requests), ``qosfs_latency_first_cut_after_seconds{class, reason}`` (from
its becoming active to the first cut of the classes below; reason starting, learning or
missed; absent before a cut), ``qosfs_latency_baseline_seconds{class, source}`` (a
relative target's baseline, learned during this activity or remembered from an earlier
one) and ``qosfs_latency_reads_observed{class}`` (0 when its reads bypass the daemon: its
estimate is then the canary's timed reads of its backing file, plus the canary's round
trips while it opens files).

Identity: ``qosfs_build_info{version, python, pyfuse3, trio}``, ``qosfs_mount_info
{mountpoint, source}``, ``qosfs_policy_info{source, hash}`` (hash of the policy in force as
rendered: nodes running the same policy show the same hash) and the daemon's ``process_*``.

Cluster (when a ``[cluster]`` table exists): ``qosfs_cluster_state{state}``,
``qosfs_cluster_renewals_total{result}``, ``qosfs_cluster_cap_per_second`` and
``qosfs_cluster_grant_per_second`` ``{level, class, tenant, uid, limit}``, and Redis timings.

Policy: ``qosfs_policy_generation``, ``qosfs_policy_changes_total{command, result}``
(command: set, reload; result: applied, rejected), ``qosfs_policy_last_reload_success``.

Resources (see ``_RESOURCES``): ``qosfs_inode_descriptors``, ``..._budget``,
``qosfs_inodes``, ``qosfs_parked_requests``, ``qosfs_parked_bytes``,
``qosfs_parking_refused_total``, ``qosfs_killed_callers_total``,
``qosfs_open_refused_total``, ``qosfs_user_accounts``, ``qosfs_users_expired_total``,
``qosfs_backing_thread_hops_total``, ``qosfs_backing_prefetches_total``,
and ``qosfs_internal_errors_total{where, type}`` (unexpected exceptions the daemon
survived: a request answered EIO, a service restarted; :mod:`qosfs.core.failures`).

Handovers (``qosfs upgrade``, :mod:`qosfs.daemon.takeover.offer`): ``qosfs_handovers_total{result}``
(completed, refused, taken_back), counted over the mount's daemon processes.

Kernel passthrough (:mod:`qosfs.passthrough.kernel`): ``qosfs_passthrough_active``,
``qosfs_passthrough_backing_ids``, ``qosfs_passthrough_registrations_total{result}``,
``qosfs_passthrough_opens_total{class}``,
``qosfs_passthrough_uncapped_opens_total{class, access}``,
``qosfs_passthrough_joins_served``, ``qosfs_passthrough_served_joins_total{class, access}``
and ``qosfs_passthrough_capped_uncapped_opens_total{class, reason}``. A passed-through
open's bytes are in no figure: the daemon never sees them.

Per-uid series are bounded by the policy's ``[metrics]`` table (see
:mod:`qosfs.qos.accounting`): at most ``user_series`` uids per class, idle ones folded away.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from qosfs import __version__
from qosfs.control.snapshot import Snapshot
from qosfs.core.limit_kinds import BY_KEY
from qosfs.qos.accounting import HistogramSnapshot

# prometheus_client's formatter of bucket bounds, untyped there: typed here once.
_go_float: Callable[[float], str] = floatToGoString

__all__ = ["CONTENT_TYPE", "SnapshotCollector", "render", "render_for"]

#: The classic text format every Prometheus version reads (what prometheus_client's own
#: server answers when the scraper does not negotiate).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_ACCOUNT = ["class", "tenant", "uid"]
# Levels carry the same labels as traffic (the one a level is named by is filled, the
# others empty), so a rate and its cap line up in one query without label_replace:
# class and user levels set class (and uid), tenant levels set tenant, the backend none.
_LEVEL = ["level", "class", "tenant", "uid"]


def _label(value: object) -> str:
    return "" if value is None else str(value)


def _level_labels(level: str, name: str, uid: int | None = None) -> list[str]:
    if level == "tenant":
        return [level, "", name, ""]
    if level == "backend":
        return [level, "", "", ""]
    return [level, name, "", _label(uid)]


def _buckets(h: HistogramSnapshot) -> list[tuple[str, float]]:
    return [(_go_float(bound), float(n)) for bound, n in h.cumulative()]


class SnapshotCollector:
    """A prometheus_client collector over one snapshot (build one per scrape)."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap

    def __repr__(self) -> str:
        return f"<SnapshotCollector generation={self.snap.generation}>"

    def _families(self) -> Iterator[Metric]:
        yield from self._traffic()
        yield from self._levels()
        yield from self._latency()
        yield from self._policy()
        yield from self._resources()
        yield from self._cluster()
        yield from self._identity()
        # process_* (open fds against their limit, memory, CPU) of the daemon itself.
        yield from ProcessCollector(registry=None).collect()

    def collect(self) -> Iterator[Metric]:
        """Every family, each sample labelled with the mount it describes: one daemon
        serves one mount, and a node with several mounts reads them apart by ``mount``
        without relabelling rules (``qosfs_mount_info`` also gives the source)."""
        mount = str(self.snap.info.get("mountpoint", ""))
        if not mount:  # a snapshot of no mount (tests, bench): nothing to tell apart
            yield from self._families()
            return
        for metric in self._families():
            metric.samples = [s._replace(labels={**s.labels, "mount": mount})
                              for s in metric.samples]
            yield metric

    def _traffic(self) -> Iterator[Metric]:
        read = CounterMetricFamily("qosfs_read_bytes", "Bytes read through the mount.",
                                   labels=_ACCOUNT, unit="bytes")
        write = CounterMetricFamily("qosfs_write_bytes", "Bytes written through the mount.",
                                    labels=_ACCOUNT, unit="bytes")
        ops = CounterMetricFamily("qosfs_ops", "Requests served, by operation.",
                                  labels=[*_ACCOUNT, "op"])
        throttled = CounterMetricFamily(
            "qosfs_throttled_seconds", "Time requests spent waiting for tokens.",
            labels=_ACCOUNT, unit="seconds")
        whole = HistogramMetricFamily(
            "qosfs_request_duration_seconds",
            "Read/write request duration: throttle wait plus backing syscall.",
            labels=[*_ACCOUNT, "op"], unit="seconds")
        backend = HistogramMetricFamily(
            "qosfs_backend_duration_seconds",
            "Duration of the backing store syscall of a read/write, without throttling.",
            labels=[*_ACCOUNT, "op"], unit="seconds")
        for (cls, tenant, uid), acc in self.snap.accounts:
            labels = [cls, _label(tenant), _label(uid)]
            read.add_metric(labels, acc.read_bytes)
            write.add_metric(labels, acc.write_bytes)
            ops.add_metric([*labels, "read"], acc.read_ops)
            ops.add_metric([*labels, "write"], acc.write_ops)
            ops.add_metric([*labels, "meta"], acc.meta_ops)
            throttled.add_metric(labels, acc.throttled_seconds)
            for op in ("read", "write"):
                h = getattr(acc, f"{op}_latency")
                whole.add_metric([*labels, op], _buckets(h), h.sum_seconds)
                h = getattr(acc, f"{op}_backend")
                backend.add_metric([*labels, op], _buckets(h), h.sum_seconds)
        yield from (read, write, ops, throttled, whole, backend)

    def _levels(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("qosfs_queue_depth",
                                  "Requests waiting for tokens at a level now.", labels=_LEVEL)
        throttled = CounterMetricFamily(
            "qosfs_level_throttled_seconds",
            "Time requests spent waiting for tokens at this level.", labels=_LEVEL,
            unit="seconds")
        bandwidth = GaugeMetricFamily(
            "qosfs_limit_bytes_per_second", "Bandwidth cap in force (absent: unlimited).",
            labels=[*_LEVEL, "direction"])
        iops = GaugeMetricFamily("qosfs_limit_ops_per_second",
                                 "Operations-per-second cap in force (absent: unlimited).",
                                 labels=[*_LEVEL, "op"])
        # A user's level is exported only for uids with series of their own ([metrics]
        # user_series bounds them; ctl status still lists every active user).
        labelled = {(cls, uid) for (cls, _, uid), _ in self.snap.accounts if uid is not None}
        for row in self.snap.levels:
            if row.uid is not None and (row.name, row.uid) not in labelled:
                continue
            labels = _level_labels(row.level, row.name, row.uid)
            depth.add_metric(labels, row.queue_depth)
            throttled.add_metric(labels, row.throttled_seconds)
            for key, value in row.limits.items():
                kind = BY_KEY[key]
                family = bandwidth if kind.per_byte else iops
                family.add_metric([*labels, kind.label], value)
        yield from (depth, throttled, bandwidth, iops)

    def _latency(self) -> Iterator[Metric]:
        lc = self.snap.latency
        if not lc or not lc.get("protected"):
            return
        target = GaugeMetricFamily("qosfs_latency_target_seconds",
                                   "Read latency target of a protected class.",
                                   labels=["class"], unit="seconds")
        observed = GaugeMetricFamily(
            "qosfs_latency_observed_seconds",
            "Estimated read latency percentile of a protected class over the last window.",
            labels=["class"], unit="seconds")
        met = GaugeMetricFamily("qosfs_latency_target_met",
                                "1 if the last window met the target (or had no reads).",
                                labels=["class"])
        active = GaugeMetricFamily("qosfs_latency_active",
                                   "1 while a protected class opens, reads or makes metadata "
                                   "requests.", labels=["class"])
        first_cut = GaugeMetricFamily(
            "qosfs_latency_first_cut_after_seconds",
            "Seconds from a protected class becoming active to the first cut of the classes "
            "below it, and why.", labels=["class", "reason"], unit="seconds")
        baseline = GaugeMetricFamily("qosfs_latency_baseline_seconds",
                                     "Baseline latency of a relative target, and its source.",
                                     labels=["class", "source"], unit="seconds")
        observed_reads = GaugeMetricFamily(
            "qosfs_latency_reads_observed",
            "0 when a protected class's reads bypass the daemon (judged on the canary's reads "
            "of its backing file).",
            labels=["class"])
        for p in lc["protected"]:
            if p["target_seconds"] is not None:  # a relative target still learning: absent
                target.add_metric([p["class"]], p["target_seconds"])
            if p["latency_seconds"] is not None:
                observed.add_metric([p["class"]], p["latency_seconds"])
            met.add_metric([p["class"]], 0.0 if p["verdict"] == "missed" else 1.0)
            active.add_metric([p["class"]], 0.0 if p.get("active_since") is None else 1.0)
            if p.get("first_cut_after_seconds") is not None:
                first_cut.add_metric([p["class"], p["first_cut_reason"]],
                                     p["first_cut_after_seconds"])
            if p.get("baseline_seconds") is not None:
                baseline.add_metric([p["class"], p.get("baseline_source") or ""],
                                    p["baseline_seconds"])
            observed_reads.add_metric([p["class"]],
                                      1.0 if p.get("reads_observed", True) else 0.0)
        state = GaugeMetricFamily("qosfs_latency_control_state",
                                  "1 for the latency controller's current state.",
                                  labels=["state"])
        for name in ("idle", "watching", "throttling", "unreachable"):
            state.add_metric([name], 1.0 if lc["state"] == name else 0.0)
        auto = GaugeMetricFamily("qosfs_latency_auto_limit_bytes_per_second",
                                 "Bandwidth cap set by the latency controller.",
                                 labels=["class", "direction"])
        for t in lc["throttled"]:
            for direction in ("read", "write"):
                if t[f"{direction}_bandwidth"] is not None:
                    auto.add_metric([t["class"], direction], t[f"{direction}_bandwidth"])
        decisions = CounterMetricFamily("qosfs_latency_control_decisions",
                                        "Cap changes made by the latency controller.",
                                        labels=["action"])
        for action, n in lc["decisions"].items():
            decisions.add_metric([action], n)
        yield from (target, observed, met, state, auto, decisions, active, first_cut,
                    baseline, observed_reads)

    def _cluster(self) -> Iterator[Metric]:
        c = self.snap.cluster
        if c is None:
            return
        state = GaugeMetricFamily("qosfs_cluster_state",
                                  "1 for the cluster coordination's current state.",
                                  labels=["state"])
        for name in ("starting", "leased", "fallback"):
            state.add_metric([name], 1.0 if c["state"] == name else 0.0)
        renewals = CounterMetricFamily("qosfs_cluster_renewals",
                                       "Lease renewals with Redis, by result.",
                                       labels=["result"])
        renewals.add_metric(["ok"], c["renewals"])
        renewals.add_metric(["failed"], c["failures"])
        denied = CounterMetricFamily(
            "qosfs_cluster_saturated_renewals",
            "Renewals of a cluster bucket this mount wanted more of than it had.")
        denied.add_metric([], c["denials"])
        rtt = CounterMetricFamily("qosfs_cluster_redis_seconds",
                                  "Time spent in successful lease renewals with Redis.",
                                  unit="seconds")
        rtt.add_metric([], c["redis_seconds_sum"])
        last = GaugeMetricFamily("qosfs_cluster_redis_last_seconds",
                                 "Round trip of the last successful lease renewal.",
                                 unit="seconds")
        last.add_metric([], c["redis_seconds_last"])
        cap = GaugeMetricFamily("qosfs_cluster_cap_per_second",
                                "A cluster-wide cap in force (bytes/s or ops/s).",
                                labels=[*_LEVEL, "limit"])
        grant = GaugeMetricFamily("qosfs_cluster_grant_per_second",
                                  "This mount's share of a cluster-wide cap, enforced now.",
                                  labels=[*_LEVEL, "limit"])
        for lv in c["levels"]:
            name = lv["level"]  # a class's name, or "tenant:NAME"
            labels = [*(_level_labels("tenant", name[7:]) if name.startswith("tenant:")
                        else _level_labels("class", name)), lv["key"]]
            cap.add_metric(labels, lv["cap"])
            if lv["enforced"] != float("inf"):
                grant.add_metric(labels, lv["enforced"])
        yield from (state, renewals, denied, rtt, last, cap, grant)

    def _identity(self) -> Iterator[Metric]:
        """What runs where: the build, the mount, and the policy by content hash (two
        nodes with different hashes run different policies)."""
        info = self.snap.info
        yield InfoMetricFamily("qosfs_build", "The qosfs build serving this mount.",
                               value={"version": __version__,
                                      "python": platform.python_version(),
                                      "pyfuse3": _version("pyfuse3"), "trio": _version("trio")})
        if "mountpoint" in info:
            yield InfoMetricFamily("qosfs_mount", "The mount these metrics describe.",
                                   value={"mountpoint": str(info["mountpoint"]),
                                          "source": str(info.get("source", ""))})
        if "policy_hash" in info:
            yield InfoMetricFamily("qosfs_policy", "The policy in force, by content hash.",
                                   value={"source": str(self.snap.policy_source or ""),
                                          "hash": str(info["policy_hash"])})

    def _policy(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("qosfs_policy_generation",
                                "Policy generation in force (0: no policy, --no-qos).",
                                value=self.snap.generation)
        changes = CounterMetricFamily("qosfs_policy_changes",
                                      "Policy changes asked for through ctl set/reload/SIGHUP.",
                                      labels=["command", "result"])
        for command in ("set", "reload"):
            for result in ("applied", "rejected"):
                changes.add_metric([command, result],
                                   self.snap.changes.get((command, result), 0))
        yield changes
        yield GaugeMetricFamily("qosfs_policy_last_reload_success",
                                "0 while the last reload of the mount's policy file was "
                                "rejected, else 1.",
                                value=1.0 if self.snap.last_reload_ok else 0.0)


    def _resources(self) -> Iterator[Metric]:
        """What the daemon holds against its limits (``ctl status`` shows the same)."""
        info = self.snap.figures()
        for key, name, kind, text in _RESOURCES:
            if key in info:
                family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                yield family(name, text, value=info[key])
        if "streaming_moves" in info:
            moves = CounterMetricFamily(
                "qosfs_streaming_moves", "Writable opens moved to the streaming class after "
                "writing a stream (detect_streaming_writes), by the class they left.",
                labels=["class"])
            for cls, n in sorted(info["streaming_moves"].items()):
                moves.add_metric([cls], n)
            yield moves
        if "passthrough" in info:
            yield from _passthrough(info["passthrough"])
        if "handovers" in info:
            yield _handovers(info["handovers"], info.get("handover_failures", {}))
        if "internal_errors" in info:
            errors = CounterMetricFamily(
                "qosfs_internal_errors", "Unexpected exceptions the daemon survived (the "
                "request answered EIO, the service restarted), by handler or service and "
                "exception type; the first of each kind is logged.", labels=["where", "type"])
            for where, kinds in sorted(info["internal_errors"].items()):
                for kind, n in sorted(kinds.items()):
                    errors.add_metric([where, kind], n)
            yield errors


def _handovers(completed: int, failures: dict[str, int]) -> Metric:
    """Planned handovers of the mount to a new daemon process (``qosfs upgrade``), by
    result, counted over the mount's processes (each successor carries the counts on),
    so that a failure stays visible after a retry succeeded; every result is present
    from the start, so that ``increase()`` sees the first failure."""
    family = CounterMetricFamily(
        "qosfs_handovers", "Handovers of the mount to a new daemon process, by result: "
        "completed; refused (the successor failed before this daemon stopped reading, "
        "nobody noticed); taken_back (it failed after, and this daemon took the session "
        "back: callers stalled until then). Counted over the mount's processes.",
        labels=["result"])
    family.add_metric(["completed"], completed)
    for result in ("refused", "taken_back"):
        family.add_metric([result], failures.get(result, 0))
    return family


def _passthrough(kp: dict[str, Any]) -> Iterator[Metric]:
    """Kernel passthrough (``ctl status`` ``passthrough``). A passed-through open's reads
    never reach the daemon: its class's opens are counted here (and in its open files),
    its metadata requests as before, its reads and bytes by the kernel's counting
    (:func:`_read_counting`), in the class's read counters."""
    yield GaugeMetricFamily("qosfs_passthrough_active", "1 if read-only opens of "
                            "classes whose reads nothing caps may be passed through to the "
                            "kernel on this mount, 0 if not (ctl status says why).",
                            value=1.0 if kp["state"] == "active" else 0.0)
    yield GaugeMetricFamily("qosfs_passthrough_backing_ids", "Inodes passed through to the "
                            "kernel now (one backing id each, shared by their opens).",
                            value=kp["live_backing_ids"])
    yield GaugeMetricFamily("qosfs_passthrough_idle_backing_ids", "Backing ids kept "
                            "registered after their file's last close, for its next open "
                            "(closed when the kernel forgets the inode, at unlink, and "
                            "after a minute).", value=kp.get("idle_backing_ids", 0))
    registrations = CounterMetricFamily(
        "qosfs_passthrough_registrations", "Backing files registered with the kernel, "
        "refused by it (served by the daemon instead), declined because the daemon "
        "served the inode at the time, and opens that took back an idle backing id "
        "(reused: no registration).", labels=["result"])
    for result in ("registered", "refused", "declined"):
        registrations.add_metric([result], kp[result])
    registrations.add_metric(["reused"], kp.get("reused_backing_ids", 0))
    yield registrations
    opens = CounterMetricFamily(
        "qosfs_passthrough_opens", "Opens passed through to the kernel, by class: their "
        "reads never reach the daemon; where they are counted (qosfs_passthrough_read_"
        "counting) qosfs_read_bytes_total includes them.", labels=["class"])
    for cls, n in sorted(kp["opens"].items()):
        opens.add_metric([cls], n)
    yield opens
    if "read_counting" in kp:
        yield from _read_counting(kp["read_counting"])
    uncapped = CounterMetricFamily(
        "qosfs_passthrough_uncapped_opens", "Opens of a class that is not passed through "
        "which joined an inode passed through now (the kernel serves an inode's opens all "
        "through passthrough or none), so their reads or writes went uncapped.",
        labels=["class", "access"])
    for access, key in (("read", "uncapped_read_opens"), ("write", "uncapped_write_opens")):
        for cls, n in sorted(kp[key].items()):
            uncapped.add_metric([cls, access], n)
    yield uncapped
    if "joins" not in kp:  # a snapshot of a build that served no joins (tests, bench)
        return
    yield GaugeMetricFamily(
        "qosfs_passthrough_joins_served", "1 if an open that must join an inode passed "
        "through now (a writer, a capped reader) is served by the daemon with direct_io, "
        "its caps holding; 0 if it joins uncapped (ctl status says why).",
        value=1.0 if kp["joins"] == "served" else 0.0)
    served = CounterMetricFamily(
        "qosfs_passthrough_served_joins", "Opens that joined an inode passed through now "
        "with direct_io, by class: their reads and writes were served by the daemon, "
        "admitted and counted as any.", labels=["class", "access"])
    for access in ("read", "write"):
        for cls, n in sorted(kp[f"served_{access}_joins"].items()):
            served.add_metric([cls, access], n)
    yield served
    escaped = CounterMetricFamily(
        "qosfs_passthrough_capped_uncapped_opens", "Of the uncapped joins "
        "(qosfs_passthrough_uncapped_opens_total), the opens a cap of their class, tenant "
        "or user bounded at open, by class; reason: why joins could not be served by the "
        "daemon on this mount: kernel (older than 6.9) or pyfuse3 (no passthrough "
        "patch).", labels=["class", "reason"])
    for cls, n in sorted(kp["capped_uncapped_opens"].items()):
        escaped.add_metric([cls, kp["joins_blocked_by"] or ""], n)
    yield escaped


def _read_counting(rc: dict[str, Any]) -> Iterator[Metric]:
    """The counting of passed-through reads (qosfs.passthrough.read_counting): whether it
    runs, what it added to the read counters per class, and the opens it could not count
    per class and reason (an alert's input: reads that no counter shows)."""
    yield GaugeMetricFamily("qosfs_passthrough_read_counting", "1 if the reads the kernel "
                            "serves for passed-through opens are counted into "
                            "qosfs_read_bytes_total and qosfs_read_ops_total, 0 if not "
                            "(ctl status says why).", value=1.0 if rc["state"] == "on" else 0.0)
    served = CounterMetricFamily(
        "qosfs_passthrough_read_bytes", "Bytes the kernel read for passed-through opens, "
        "by class: already included in qosfs_read_bytes_total (this is their share).",
        labels=["class"])
    for cls, n in sorted(rc["read_bytes"].items()):
        served.add_metric([cls], n)
    yield served
    reads = CounterMetricFamily(
        "qosfs_passthrough_reads", "Read calls the kernel served for passed-through opens, "
        "by class (included in the class's read ops).", labels=["class"])
    for cls, n in sorted(rc["reads"].items()):
        reads.add_metric([cls], n)
    yield reads
    uncounted = CounterMetricFamily(
        "qosfs_passthrough_uncounted_opens", "Opens passed through whose reads cannot be "
        "counted, by class and reason (no BPF, a backing filesystem the tracepoints do not "
        "see, the table of watched files full): their bytes are in no counter.",
        labels=["class", "reason"])
    for cls, reasons in sorted(rc["uncounted_opens"].items()):
        for reason, n in sorted(reasons.items()):
            uncounted.add_metric([cls, reason], n)
    yield uncounted
    yield CounterMetricFamily("qosfs_passthrough_lost_read_bytes", "Bytes read by the "
                              "kernel that found its table of counts full: in no class.",
                              value=rc["lost_bytes"])


# ctl status key -> metric: descriptors held for inodes (qosfs.passthrough.inodes), requests
# parked for tokens and those refused past the parking bounds (qosfs.qos.bounds),
# parked requests answered because their caller was killed (qosfs.passthrough.interrupts),
# and opens refused past a uid's share of the daemon's descriptors (qosfs.passthrough.handles).
_RESOURCES = (
    ("inode_fds", "qosfs_inode_descriptors", "gauge",
     "Descriptors the daemon holds for inodes the kernel knows."),
    ("inode_fd_budget", "qosfs_inode_descriptors_budget", "gauge",
     "How many inode descriptors the daemon caches at most."),
    ("inodes", "qosfs_inodes", "gauge", "Inodes the kernel currently knows."),
    ("inode_objects", "qosfs_inode_objects", "gauge",
     "Of those, the ones held as objects (the rest are in compact arrays)."),
    ("inode_thaws", "qosfs_inode_thaws", "counter",
     "Inodes taken out of the compact arrays again because a request named them."),
    ("parked_requests", "qosfs_parked_requests", "gauge",
     "Requests waiting for tokens now, over every class."),
    ("parked_bytes", "qosfs_parked_bytes", "gauge",
     "Write data held by requests waiting for tokens."),
    ("parking_refused", "qosfs_parking_refused", "counter",
     "Requests answered EAGAIN because a parking bound was reached."),
    ("killed_callers", "qosfs_killed_callers", "counter",
     "Parked requests answered at once because their caller was killed."),
    ("open_refused", "qosfs_open_refused", "counter",
     "Opens answered ENFILE because the uid held its share of the daemon's descriptors."),
    ("user_accounts", "qosfs_user_accounts", "gauge",
     "uids with series of their own in per_user classes ([metrics] user_series)."),
    ("users_expired", "qosfs_users_expired", "counter",
     "uid accounts folded into their class's uid=\"\" series after going idle."),
    ("backing_thread_hops", "qosfs_backing_thread_hops", "counter",
     "Backing-store calls that ran in a worker thread (a read the page cache missed, "
     "fsync, every call on a network filesystem)."),
    ("backing_prefetches", "qosfs_backing_prefetches", "counter",
     "Opens of a small file on a local disk that started reading it before its first "
     "READ, so that the READ is served without a thread."),
)


def _version(dist: str) -> str:
    # Imported here, at the first scrape: importlib.metadata (and the email package it
    # brings) was ~16 ms of every daemon's start, for a figure only /metrics shows.
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def render(snap: Snapshot) -> bytes:
    """The Prometheus text exposition of ``snap`` (safe to call from any thread)."""
    return generate_latest(SnapshotCollector(snap))


def render_for(snap: Snapshot, accept: str) -> tuple[bytes, str]:
    """``snap`` in the format a scraper's ``Accept`` header asks for, and its content type:
    OpenMetrics when asked (Prometheus asks first), else the classic text format."""
    encode, content_type = choose_encoder(accept)
    return encode(SnapshotCollector(snap)), content_type
