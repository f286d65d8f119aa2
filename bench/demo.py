"""``python -m bench demo``: the point of qosfs in about a minute, on this machine.

A dataset reader (random reads, the latency a GPU waits on) runs alone and next to a
checkpoint storm, three ways: on the bare directory (what a user has without qosfs),
through qosfs with QoS off (``--no-qos``) and through qosfs with the embedded default
policy. The storm also runs alone, so the table shows what checkpoints keep too. The
targets (issue "The protector must not be the bottleneck"): with the default policy the
reader keeps >= 80% of its solo throughput and <= 1.5x its solo p99, and checkpoints
move at >= 25% of what they get alone. The storm alone runs 10 s, and through the policy
its rate is set against what the checkpoints cap allows in that time (the cap, plus its
burst once): the cap holds within +-2% (issue "Protected reads at native speed").
"""

from __future__ import annotations

from bench.core.fio import FioMetrics, find_fio
from bench.core.storm import STORM_ALONE, Row, scenarios
from bench.core.system import QosfsMount, require_root, tmpfs_area

READER_KEEPS, P99_AT_MOST, CHECKPOINTS_KEEP, CAP_HOLDS = 0.80, 1.5, 0.25, 0.02


def _print(rows: list[Row]) -> None:
    print(f"\n{'scenario':42} {'reader MB/s':>11} {'of alone':>8} {'p99 ms':>7} "
          f"{'x alone':>7} {'ckpt MB/s':>9} {'of alone':>8}")
    alone: FioMetrics | None = None
    storm_alone: FioMetrics | None = None
    for name, metrics, storm in rows:
        if name.startswith("reader alone"):
            alone = metrics
        if name.startswith("checkpoint storm alone"):
            storm_alone = metrics
            print(f"{name:42} {'':>11} {'':>8} {'':>7} {'':>7} "
                  f"{metrics.bw_bytes / 1e6:9.0f} {'100%':>8}")
            continue
        assert alone is not None
        ckpt = "" if storm is None else f"{storm.bw_bytes / 1e6:.0f}"
        ckpt_share = "" if storm is None or storm_alone is None else \
            f"{storm.bw_bytes / storm_alone.bw_bytes:.0%}"
        print(f"{name:42} {metrics.bw_bytes / 1e6:11.0f} "
              f"{metrics.bw_bytes / alone.bw_bytes:8.0%} {metrics.clat_p99_us / 1e3:7.2f} "
              f"{metrics.clat_p99_us / alone.clat_p99_us:7.2f} {ckpt:>9} {ckpt_share:>8}")


def _checkpoint_allowance(seconds: float) -> float:
    """Bytes/s the default policy's checkpoints cap lets through over *seconds* from a full
    bucket: the cap, plus the bucket's depth once."""
    from qosfs.core.limit_kinds import BY_KEY
    from qosfs.policy.loading import default_policy

    rule = next(c for c in default_policy().classes if c.name == "checkpoints")
    cap = rule.limits.write_bandwidth
    assert cap is not None
    return cap + rule.limits.burst_of(BY_KEY["write_bandwidth"], cap) / seconds


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


def run(quick: bool = True) -> int:
    require_root("the demo mounts a scratch tmpfs and qosfs")
    fio = find_fio()
    rows: list[Row] = []
    with tmpfs_area("3g", ["bare", "src", "mnt"]) as top:
        for d in ("bare", "src"):
            (top / d / "data").mkdir()
            (top / d / "checkpoints").mkdir()
        log = str(top / "qosfs.log")
        print("qosfs demo: dataset reader (random 4k-1M reads, 2 jobs) next to a checkpoint "
              "storm (4 writers, 1 MiB writes), on tmpfs")
        scenarios(fio, "bare directory", top / "bare", rows)
        with QosfsMount(str(top / "src"), str(top / "mnt"), ["--no-qos"], log):
            scenarios(fio, "qosfs --no-qos", top / "mnt", rows)
        with QosfsMount(str(top / "src"), str(top / "mnt"), [], log):
            scenarios(fio, "qosfs default policy", top / "mnt", rows)
    _print(rows)
    reader_alone, storm_alone = rows[-3][1], rows[-2][1]
    _, reader, storm = rows[-1]
    assert storm is not None
    keeps = reader.bw_bytes / reader_alone.bw_bytes
    p99 = reader.clat_p99_us / reader_alone.clat_p99_us
    ckpt = storm.bw_bytes / storm_alone.bw_bytes
    uncapped = storm.bw_bytes / rows[4][1].bw_bytes  # the storm alone through --no-qos
    bare = rows[2][1]
    print(f"\nTargets with the default policy: reader keeps {keeps:.0%} (>= "
          f"{READER_KEEPS:.0%}: {_met(keeps >= READER_KEEPS)}), p99 {p99:.2f}x alone (<= "
          f"{P99_AT_MOST}: {_met(p99 <= P99_AT_MOST)}); checkpoints keep {ckpt:.0%} of what "
          f"they get alone under the policy (>= {CHECKPOINTS_KEEP:.0%}: "
          f"{_met(ckpt >= CHECKPOINTS_KEEP)}). For scale, no target: that is {uncapped:.0%} "
          f"of what the mount carries for them uncapped (the cap alone allows "
          f"{storm_alone.bw_bytes / rows[4][1].bw_bytes:.0%}); the reader moved "
          f"{reader.bw_bytes / 1e6:.0f} MB/s against {bare.bw_bytes / 1e6:.0f} MB/s on the "
          "bare directory under the same storm.")
    allowed = _checkpoint_allowance(float(STORM_ALONE))
    held = storm_alone.bw_bytes / allowed - 1
    print(f"Checkpoint cap: the storm alone moved {storm_alone.bw_bytes / 1e6:.0f} MB/s over "
          f"{STORM_ALONE} s, {held:+.1%} of what the cap allows in that time "
          f"({allowed / 1e6:.0f} MB/s: cap and burst; within +-{CAP_HOLDS:.0%}: "
          f"{_met(abs(held) <= CAP_HOLDS)}).")
    print("The default policy caps checkpoint writes (**/checkpoints/**, *.pt, *.distcp, "
          "...); see `qosfs policy default`.")
    return 0
