"""``python -m bench training``: MLPerf Storage's measure, the accelerator utilization (AU)
of DLIO's emulated training, under a checkpoint storm written by PyTorch itself.

DLIO (``dlio_benchmark``, the engine of MLPerf Storage; the ``training`` extra) emulates
one accelerator: its PyTorch data loader reads the dataset, and each batch "computes" for
a fixed time. AU = compute time / wall time of the epoch; MLPerf's pass line is 90% for
U-Net3D and ResNet-50. The suite writes each DLIO configuration itself (:data:`SHAPES`,
sized for a 2-CPU machine: an accelerator whose demand the mount can feed alone):

- ``unet3d``: U-Net3D-like, large npz samples (16 MiB, one per file), batch 4, 0.25 s
  per batch: it asks 256 MiB/s of the mount;
- ``resnet``: ResNet-50-like, small npz samples (112 KiB, one per file), batch 64, 0.12 s
  per batch: ~530 files/s (full mode only: DLIO's ResNet reads TFRecords with
  TensorFlow, which this extra leaves out, so the shape is kept and the format is npz).

The page cache must not hide the mount: DLIO 2.0.0 has no ``reader.odirect`` and this
machine's memory holds any dataset it can generate quickly. So every epoch is one DLIO
run (``epochs: 1``, a new shuffle seed each) and before each the dataset's pages are
evicted, file by file, with ``posix_fadvise(DONTNEED)`` on the backing file and on its
path through the mount (qosfs keeps the kernel's cache of an unchanged file across
opens). Unlike ``drop_caches`` this touches only the dataset and needs no ``sync``, which
would wait for the storm's dirty pages. The daemon's read bytes per epoch (``rchar``)
show the reads reached it.

The storm (:mod:`bench.suites.training.ckpt_storm`): 2 rank processes in a gloo group
holding 1 GiB of state each, a round every ``interval`` (8 s) seconds, in turn
``torch.save`` /
``dcp.save`` (the step waits) and a staged ``torch.save`` in a thread /
``dcp.async_save`` (training goes on), written under ``checkpoints/`` of the same tree,
which the default policy classifies as checkpoints. 2 GiB a round is more than this
machine writes through a FUSE mount in 8 s, so the rounds run back to back there.

Scenarios, in one run: the bare directory alone, under the storm and under a storm
already running when the job starts; qosfs ``--no-qos`` alone and under the storm; qosfs
with the embedded default policy alone, under the storm and under the running storm
(dataset reads pass through the kernel there: its first epoch is what the protection
from the first request is for); qosfs with a latency target (the default policy with
``target_read_latency`` on datasets) and the storm; a fixed checkpoints cap (no read
target, so nothing moves it) and the storm. The report shows each scenario's first
epoch on its own: the later ones start with the controller's state warm.
For the capped scenarios each checkpoint round's write time is compared with what
``qosfs plan`` predicts for its size and the cap (T = size x replicas / rate), for the
configured cap and for the mean cap in force during the round (:class:`CapWatch`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.core.context import Mounted, Run
from bench.core.system import REPO, BenchError, QosfsMount
from bench.suites.training.au_report import TrainingResult
from bench.suites.training.ckpt_storm import read_records

MiB = 1 << 20
AU_PASS = 90.0  # MLPerf Storage: U-Net3D and ResNet-50
STORM_KEEPS, PLAN_PCT = 0.95, 10.0  # issue targets: AU under storm vs alone; plan error
LATENCY_TARGET = "20ms"


@dataclass(frozen=True)
class Shape:
    """One DLIO workload, sized for this machine (see the module docstring)."""

    name: str
    record_length: int
    files: int  # training files (one sample each)
    files_quick: int
    batch_size: int
    computation_time: float  # seconds per batch: the emulated accelerator
    read_threads: int = 2


SHAPES = {
    "unet3d": Shape("unet3d", 16 * MiB, 288, 96, 4, 0.25),
    # 4096 files: the mount alone feeds this shape at 98% AU here. With 8192 files it
    # measured 72-90% through --no-qos alone against 97% on the bare directory, for a
    # reason not found yet (not the inode descriptor budget: see bench/ANALYSIS.md),
    # which would hide what the storm does.
    "resnet": Shape("resnet", 114688, 4096, 2048, 64, 0.12),
}


@dataclass(frozen=True)
class Storm:
    ranks: int
    shard: int  # bytes per rank per round
    interval: float


# 2 GiB a round, every 8 s: more than this machine writes through FUSE in 8 s, so the
# rounds run back to back (a storm, not a blip) whenever the mount cannot absorb them.
STORM = Storm(2, 1024 * MiB, 8.0)
STORM_LEAD = 5.0  # s from the storm's start to its first round (see _storm)
FIXED_CAP = "128MiB/s"  # the fixed-cap scenario's checkpoints cap (see _fixed_cap_policy)

RUNNING_LEAD = 0.0  # ... in the "running storm" scenarios: writing before DLIO starts

# (label, how it is served, seconds from the storm's start to its first round: None, no
# storm). A "running storm" writes from the start, so the first epoch begins in it (the
# issue: a reader starting into a storm was left unprotected for half an epoch); the
# others' first round comes some 3 s into the first epoch.
SCENARIOS: tuple[tuple[str, str, float | None], ...] = (
    ("bare", "bare", None), ("bare + storm", "bare", STORM_LEAD),
    ("bare + running storm", "bare", RUNNING_LEAD),
    ("no-qos", "no-qos", None), ("no-qos + storm", "no-qos", STORM_LEAD),
    ("default policy", "default", None),
    ("default policy + storm", "default", STORM_LEAD),
    ("default policy + running storm", "default", RUNNING_LEAD),
    ("latency target + storm", "latency", STORM_LEAD),
    (f"fixed cap {FIXED_CAP} + storm", "fixed", STORM_LEAD))
CAPPED = ("default", "latency", "fixed")


def missing() -> str | None:
    """Why DLIO cannot run here (None when it can): the suite is skipped then."""
    if importlib.util.find_spec("dlio_benchmark") is None:
        return "DLIO is not installed (`make bench-deps` installs the training extra)"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (the libs extra)"
    if mpiexec() is None:
        return "no mpiexec (the training extra's mpich)"
    return None


def mpiexec() -> str | None:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def workload_config(shape: Shape, *, data_folder: str, output_folder: str, files: int,
                    seed: int = 1, generate: bool = False) -> dict[str, Any]:
    """DLIO's workload configuration (the ``workload`` group of its Hydra config): one
    epoch of *shape* read from *data_folder*, or (*generate*) the dataset written."""
    return {
        "model": shape.name,
        "framework": "pytorch",
        "workflow": {"generate_data": generate, "train": not generate, "checkpoint": False},
        "dataset": {"data_folder": data_folder, "format": "npz", "num_files_train": files,
                    "num_samples_per_file": 1, "record_length": shape.record_length},
        "reader": {"data_loader": "pytorch", "batch_size": shape.batch_size,
                   "read_threads": shape.read_threads, "file_shuffle": "seed",
                   "sample_shuffle": "seed"},
        "train": {"epochs": 1, "computation_time": shape.computation_time, "seed": seed},
        "metric": {"au": AU_PASS / 100},
        "output": {"folder": output_folder},
    }


def write_workload(config_dir: Path, name: str, config: dict[str, Any]) -> Path:
    """``config_dir/workload/name.yaml`` (JSON, which is YAML) for ``--config-dir``."""
    path = config_dir / "workload" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


def parse_dlio_output(folder: Path, record_length: int) -> dict[str, Any]:
    """DLIO's figures from its output folder: ``summary.json`` (``metric``: AU in % and
    samples/s, one entry per epoch) and ``per_epoch_stats.json`` (each epoch's duration
    in seconds, a string). Read MiB/s per epoch = samples/s x *record_length*."""
    summary = json.loads((folder / "summary.json").read_text())
    metric = summary["metric"]
    au = [float(v) for v in metric["train_au_percentage"]]
    sps = [float(v) for v in metric["train_throughput_samples_per_second"]]
    epochs: dict[str, Any] = {}
    stats = folder / "per_epoch_stats.json"
    if stats.exists():
        epochs = json.loads(stats.read_text())
    durations = [float(epochs[k]["duration"]) for k in sorted(epochs, key=int)
                 if "duration" in epochs[k]]
    return {"au_pct": au, "samples_per_s": sps,
            "read_mib_s": [s * record_length / MiB for s in sps],
            "epoch_s": durations, "accelerators": summary.get("num_accelerators"),
            "au_expectation": metric.get("train_au_meet_expectation")}


def rounds_of(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per checkpoint round (all ranks): bytes written, duration from the first rank's
    start to the last rank's end, the longest time a rank's training waited, and the
    write time: the same span without an asynchronous save's staging (the copy of the
    state in memory that the training step waits for, before the first byte is written),
    which is what the planner's T is about."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for rec in records:
        by_round.setdefault(rec["round"], []).append(rec)
    out = []
    for n, recs in sorted(by_round.items()):
        if any("end" not in r for r in recs):
            continue
        end = max(r["end"] for r in recs)
        writing = min(r["start"] + (r["blocked_s"] if r["mode"] == "async" else 0.0)
                      for r in recs)
        out.append({"round": n, "kind": recs[0]["kind"], "mode": recs[0]["mode"],
                    "ranks": len(recs), "bytes": sum(r.get("bytes", 0) for r in recs),
                    "start": min(r["start"] for r in recs), "end": end,
                    "write_start": writing, "write_s": end - writing,
                    "duration_s": end - min(r["start"] for r in recs),
                    "blocked_s": max(r["blocked_s"] for r in recs),
                    "errors": [r["error"] for r in recs if "error" in r]})
    return out


def planned_seconds(nbytes: float, cap: float, replicas: int = 1) -> float:
    """What ``qosfs plan`` predicts for a checkpoint of *nbytes* under *cap* (bytes/s):
    the plan of a job writing that many bytes with storage that delivers the cap
    (efficiency 1), whose write time at its highest cap is T = size x replicas / rate."""
    from qosfs.plan.planner import PlanInputs, make_plan

    plan = make_plan(PlanInputs(params=nbytes, bytes_per_param=1.0, replicas=replicas,
                                backend_write=cap, efficiency=1.0,
                                interval=max(3600.0, 10 * nbytes * replicas / cap)))
    assert plan.timing is not None
    return plan.timing.cap_seconds


def plan_check(rounds: list[dict[str, Any]], cap: float,
               caps: list[tuple[float, float]] | None = None) -> list[dict[str, Any]]:
    """Each round's duration against the planner's T for the configured *cap*; error in
    % of T (+ = slower). With *caps* (the cap in force over time, :class:`CapWatch`)
    also against T for the mean cap in force during the round, which is what the
    planner predicts when the latency controller lowered the cap."""
    out = []
    for r in rounds:
        if not r["bytes"]:
            continue
        t = planned_seconds(r["bytes"], cap)
        took, began = r.get("write_s", r["duration_s"]), r.get("write_start", r.get("start"))
        row = {"round": r["round"], "way": f"{r['kind']}/{r['mode']}", "bytes": r["bytes"],
               "measured_s": took, "planned_s": t, "error_pct": 100.0 * (took - t) / t}
        in_force = mean_cap(caps, began, r["end"]) if caps else None
        if in_force is not None:
            t_in_force = planned_seconds(r["bytes"], in_force)
            row.update(cap_in_force=in_force, planned_in_force_s=t_in_force,
                       error_in_force_pct=100.0 * (took - t_in_force) / t_in_force)
        out.append(row)
    return out


def evict(files: list[Path]) -> None:
    """Drop the cached pages of *files* (clean pages only: no sync needed)."""
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _dlio(config: dict[str, Any], name: str, work: Path) -> Path:
    """One DLIO run of *config*; returns its output folder."""
    cfg_dir = work / f"cfg-{name}"
    write_workload(cfg_dir, name, config)
    out = Path(config["output"]["folder"])
    out.mkdir(parents=True, exist_ok=True)
    mpi = mpiexec()
    assert mpi is not None
    cmd = [mpi, "-n", "1", sys.executable, "-m", "bench.suites.training.dlio_entry", "--config-dir",
           str(cfg_dir), f"workload={name}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DFTRACER_ENABLE": "0",
           "OMP_NUM_THREADS": "1"}
    with open(out / "stdout.txt", "w") as log:
        proc = subprocess.run(cmd, cwd=str(work), env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=1800)
    if proc.returncode != 0:
        tail = (out / "stdout.txt").read_text(errors="replace").strip().splitlines()
        raise BenchError(f"dlio_benchmark exited with {proc.returncode}: "
                         f"{tail[-1] if tail else 'no output'}")
    return out


@contextmanager
def _storm(top: Path, work: Path, storm: Storm, lead: float) -> Iterator[Path]:
    """The checkpoint storm writing under *top*/checkpoints while the block runs, its
    first round *lead* s in (:data:`STORM_LEAD`: a trainer saves every N steps, not at
    step 0; DLIO starts its epoch about 2 s in, so the first round comes some 3 s into
    it, after a few latency-control windows of reading alone; :data:`RUNNING_LEAD`: the
    storm is writing when the block starts, one second in, so the first epoch begins in
    it); yields the records directory. Stopped by its stop file, killed (by its pid) if it
    does not stop; it stops by itself if this process is gone (``--parent``)."""
    records = work / f"storm-{time.monotonic_ns()}"
    records.mkdir()
    stop = records / "stop"
    cmd = [sys.executable, "-m", "bench.suites.training.ckpt_storm",
           str(top / "checkpoints" / "storm"), "--records", str(records), "--stop", str(stop),
           "--ranks", str(storm.ranks), "--shard", str(storm.shard),
           "--interval", str(storm.interval), "--lead", str(lead), "--parent", str(os.getpid())]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(records / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=err, stderr=err,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (records / "ready").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (records / "stderr.txt").read_text(errors="replace").strip()
                raise BenchError("the checkpoint storm did not start: "
                                 + (tail.splitlines()[-1] if tail else "no output"))
            time.sleep(0.1)
        if lead == RUNNING_LEAD:
            time.sleep(1.0)  # the ranks are writing their first round
        yield records
    finally:
        stop.touch()
        try:
            proc.wait(timeout=storm.interval * 4 + 120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session: the storm and its ranks
            proc.wait()
        shutil.rmtree(top / "checkpoints" / "storm", ignore_errors=True)


def _epochs(shape: Shape, top: Path, src: Path, files: int, epochs: int,
            work: Path, tag: str, mount: QosfsMount | None) -> list[dict[str, Any]]:
    data = sorted((src / "data" / shape.name).rglob("*.npz"))
    through = [top / p.relative_to(src) for p in data] if top != src else []
    out = []
    for epoch in range(1, epochs + 1):
        evict(data)
        evict(through)
        io0 = mount.io_bytes() if mount else None
        cfg = workload_config(shape, data_folder=str(top / "data" / shape.name),
                              output_folder=str(work / f"out-{tag}-{epoch}"), files=files,
                              seed=epoch)
        folder = _dlio(cfg, f"{shape.name}-{tag}-{epoch}", work)
        io1 = mount.io_bytes() if mount else None
        fig = parse_dlio_output(folder, shape.record_length)
        fig["daemon_read_mib"] = None if io0 is None or io1 is None else \
            (io1[0] - io0[0]) / MiB
        out.append(fig)
    return out


_SLOWDOWN_LINE = "target_read_slowdown = 1.3"
_CAP_LINE = 'write_bandwidth = "400MiB/s"'


def _default_text(*needed: str) -> str:
    from qosfs.policy.text import DEFAULT_POLICY_TEXT

    for line in needed:
        if line not in DEFAULT_POLICY_TEXT:
            raise BenchError(f"the default policy no longer has {line!r}: update "
                             "bench/training.py's scenarios")
    return DEFAULT_POLICY_TEXT


def _latency_policy(target: str) -> str:
    """The default policy with a read latency target on datasets instead of its slowdown
    target."""
    text = _default_text(_SLOWDOWN_LINE)
    return text.replace(_SLOWDOWN_LINE, f'target_read_latency = "{target}"')


def _fixed_cap_policy(cap: str) -> str:
    """The default policy with the checkpoints cap at *cap* and no read target on
    datasets, so no controller moves the cap: the planner's T can be checked as is."""
    text = _default_text(_SLOWDOWN_LINE, _CAP_LINE)
    return text.replace(_SLOWDOWN_LINE, "").replace(_CAP_LINE, f'write_bandwidth = "{cap}"')


def policy_for(serve: str) -> str | None:
    """The policy text of scenario kind *serve* (None: the embedded default policy, or
    no policy at all for bare and --no-qos)."""
    if serve == "latency":
        return _latency_policy(LATENCY_TARGET)
    if serve == "fixed":
        return _fixed_cap_policy(FIXED_CAP)
    return None


def checkpoint_cap(policy_text: str | None) -> tuple[float, float]:
    """(write cap, burst) of the checkpoints class in *policy_text* (None: the default)."""
    from qosfs.policy.loading import default_policy, parse_policy

    policy = default_policy() if policy_text is None else parse_policy(policy_text)
    ckpt = policy.class_by_name("checkpoints")
    assert ckpt is not None
    return float(ckpt.limits.get("write_bandwidth")), float(ckpt.limits.get("burst"))


class CapWatch:
    """The checkpoints cap in force over time: the configured cap, or the lower one the
    latency controller set, polled from ``ctl status`` every *interval* s in a thread.
    Samples are (wall-clock time, bytes/s), the clock the storm's records use."""

    def __init__(self, socket: str, configured: float, interval: float = 0.25) -> None:
        self.socket, self.configured, self.interval = socket, configured, interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cap-watch", daemon=True)

    def _loop(self) -> None:
        from qosfs.control.ctl import Client, checked
        from qosfs.core.errors import QosfsError

        try:
            with Client(self.socket) as client:
                while not self._stop.is_set():
                    reply = checked(client.request({"cmd": "status"}))
                    self.samples.append((time.time(), cap_in_force(reply, self.configured)))
                    self._stop.wait(self.interval)
        except (OSError, QosfsError):
            return  # the mount went away: the samples so far stand

    def __enter__(self) -> CapWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def cap_in_force(status: dict[str, Any], configured: float) -> float:
    """The checkpoints write cap a ``status`` reply says is in force."""
    lc = status.get("latency_control") or {}
    for t in lc.get("throttled", []):
        if t["class"] == "checkpoints" and t["write_bandwidth"] is not None:
            return min(configured, float(t["write_bandwidth"]))
    return configured


def changes_of(samples: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The samples where the cap changed (and the first): the trajectory, compactly."""
    return [x for i, x in enumerate(samples) if i == 0 or x[1] != samples[i - 1][1]]


def mean_cap(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """The time-weighted mean of the sampled cap over [start, end]: each sample holds
    until the next one (the first also before it, the last after it); None without
    samples or for an empty span."""
    if end <= start or not samples:
        return None
    edges = [t for t, _ in samples[1:]] + [float("inf")]
    total = 0.0
    for (_, cap), t_next, t_this in zip(samples, edges, [-float("inf"), *edges[:-1]],
                                        strict=True):
        overlap = min(end, t_next) - max(start, t_this)
        if overlap > 0:
            total += cap * overlap
    return total / (end - start)


def _shape_run(run: Run, shape: Shape, storm: Storm, epochs: int) -> dict[str, Any]:
    area = "disk" if run.disk is not None else "tmpfs"
    src = run.scratch(f"training-{shape.name}", area)
    work = run.scratch(f"training-{shape.name}-work")
    files = int(run.pick(shape.files, shape.files_quick))
    run.log(f"  training {shape.name}: generating {files} x "
            f"{shape.record_length / MiB:.2f} MiB samples on {area}")
    _dlio(workload_config(shape, data_folder=str(src / "data" / shape.name),
                          output_folder=str(work / "out-generate"), files=files,
                          generate=True), f"{shape.name}-generate", work)
    scenarios = []
    for label, serve, lead in SCENARIOS:
        (src / "checkpoints").mkdir(exist_ok=True)
        tag = label.replace(" + ", "-").replace(" ", "-").replace("/", "")
        scenarios.append(_scenario(run, shape, storm, src, work, files, epochs,
                                   label, serve, lead, tag))
    cap, burst = checkpoint_cap(None)
    return {"shape": asdict(shape), "files": files, "area": area,
            "config": workload_config(shape, data_folder="<top>/data/" + shape.name,
                                      output_folder="<out>", files=files),
            "scenarios": scenarios, "cap": cap, "burst": burst}


def _scenario(run: Run, shape: Shape, storm: Storm, src: Path, work: Path, files: int,
              epochs: int, label: str, serve: str, lead: float | None,
              tag: str) -> dict[str, Any]:
    """One scenario: *epochs* DLIO epochs over *src* served as *serve*, under the storm
    unless *lead* is None (its first round *lead* s after it starts); for a capped one
    the cap in force is watched for the planner check."""
    stormy = lead is not None
    policy = policy_for(serve)
    cap, burst = checkpoint_cap(policy) if serve in CAPPED else (0.0, 0.0)
    rounds: list[dict[str, Any]] = []
    caps: list[tuple[float, float]] = []
    with _served(run, src, serve, policy) as (top, mounted):
        mount = mounted.mount if mounted else None
        cpu0 = mount.cpu_seconds() if mount else None
        t0 = time.monotonic()
        with ExitStack() as stack:
            if mounted is not None and serve in CAPPED:
                caps = stack.enter_context(CapWatch(mounted.socket, cap)).samples
            records = (stack.enter_context(_storm(top, work, storm, lead))
                       if lead is not None else None)
            figs = _epochs(shape, top, src, files, epochs, work, tag, mount)
        elapsed = time.monotonic() - t0
        cpu1 = mount.cpu_seconds() if mount else None
    if records is not None:
        rounds = rounds_of(read_records(records))
    au = [a for f in figs for a in f["au_pct"]]
    run.log(f"  training {shape.name} {label}: AU " + ", ".join(f"{a:.1f}%" for a in au)
            + (f"; {len(rounds)} checkpoints, "
               + ", ".join(f"{r['duration_s']:.2f}s" for r in rounds) if stormy else ""))
    return {"label": label, "serve": serve, "storm": stormy, "storm_lead_s": lead,
            "epochs": figs, "au_pct": au,
            "read_mib_s": [v for f in figs for v in f["read_mib_s"]], "rounds": rounds,
            "cap": cap or None, "burst": burst or None,
            "plan": plan_check(rounds, cap, caps) if serve in CAPPED else [],
            "cap_changes": changes_of(caps),
            "daemon_cpu_pct": None if cpu0 is None or cpu1 is None
            else 100.0 * (cpu1 - cpu0) / elapsed}


@contextmanager
def _served(run: Run, src: Path, serve: str,
            policy: str | None) -> Iterator[tuple[Path, Mounted | None]]:
    """*src* as the scenario reads it: itself (bare) or through a qosfs mount."""
    if serve == "bare":
        yield src, None
        return
    with run.mount(src, policy, no_qos=serve == "no-qos") as mounted:
        yield mounted.path, mounted


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("dlio_benchmark", "torch", "mpi4py", "mpich", "numpy", "tensorflow"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def run(run: Run) -> TrainingResult:
    why = missing()
    if why:
        raise BenchError(why)
    storm = STORM  # --quick too: a smaller storm measured no effect at all in quick mode
    epochs = run.repetitions(3, 2)
    shapes = ["unet3d"] if run.quick else list(SHAPES)
    results = {name: _shape_run(run, SHAPES[name], storm, epochs) for name in shapes}
    return TrainingResult.from_json({
        "shapes": results, "storm": asdict(storm), "epochs": epochs,
        "latency_target": LATENCY_TARGET, "versions": _versions(), "au_pass_pct": AU_PASS,
        "storm_keeps": STORM_KEEPS, "plan_pct": PLAN_PCT})
