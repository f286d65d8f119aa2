"""What a benchmark needs from the machine: a scratch tmpfs, qosfs mounts, cold caches,
CPU accounting and a description of the machine for the report.

Everything that mounts is a context manager that unmounts on the way out, errors and
Ctrl-C included; the only processes it ever signals are the qosfs daemons it started.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import qosfs

REPO = Path(__file__).resolve().parents[2]


class BenchError(Exception):
    """A setup step failed (one-line message)."""


def _run(cmd: Sequence[str], check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise BenchError(f"{shlex.join(cmd)} failed ({proc.returncode}): "
                         f"{msg[-1] if msg else 'no message'}")
    return proc


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise BenchError(f"{what} needs root (mounting tmpfs, dropping caches)")


def _wait_unmounted(path: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.ismount(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def unmount(mountpoint: str | Path, attempts: int = 40) -> None:
    """``fusermount3 -u``, tried again while the mount is busy, then ``umount -l``.

    A FUSE mount is busy while any request to it is in flight, and qosfs's latency canary
    (qosfs.qos.latency.probe) keeps sending one every 2 ms for up to a window after a
    protected reader's last request: an unmount right after a run failed with EBUSY in 2
    of 37 tries (bench.opcost died on it). The next try, 50 ms later, worked.
    """
    mnt = str(mountpoint)
    for _ in range(attempts):
        if not os.path.ismount(mnt) or subprocess.run(
                ["fusermount3", "-u", mnt], capture_output=True).returncode == 0:
            return
        time.sleep(0.05)
    subprocess.run(["umount", "-l", mnt], capture_output=True)


@contextmanager
def tmpfs_area(size: str, subdirs: Sequence[str]) -> Iterator[Path]:
    """A fresh tmpfs of *size* with *subdirs* created in it; unmounted and removed after."""
    top = Path(tempfile.mkdtemp(prefix="qosfs-bench-"))
    mounted = False
    try:
        _run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "qosfs-bench", str(top)])
        mounted = True
        for sub in subdirs:
            (top / sub).mkdir()
        yield top
    finally:
        if mounted and _run(["umount", str(top)], check=False).returncode != 0:
            _run(["umount", "-l", str(top)], check=False)
        try:
            top.rmdir()
        except OSError:
            pass


@contextmanager
def disk_area(parent: str, subdirs: Sequence[str]) -> Iterator[Path]:
    """A fresh directory under *parent* (a disk-backed filesystem) with *subdirs*; removed
    with everything in it afterwards."""
    top = Path(tempfile.mkdtemp(prefix="qosfs-bench-disk-", dir=parent))
    try:
        for sub in subdirs:
            (top / sub).mkdir()
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding *path* (the longest mount prefix in
    /proc/mounts), for the report: "ext4", "tmpfs", ..."""
    best, fstype = "", "unknown"
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            mnt = fields[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, fields[2]
    return fstype


def _pids_serving(mountpoint: str) -> list[int]:
    """Our daemon for *mountpoint*: a process whose argv is ``... qosfs mount SRC MNT ...``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if "qosfs" in " ".join(args[:3]) and "mount" in args and mountpoint in args:
            pids.append(int(entry))
    return pids


class QosfsMount:
    """A qosfs daemon serving *source* on *mountpoint*, started by us."""

    def __init__(self, source: str, mountpoint: str, args: Sequence[str], log_file: str,
                 python: str = sys.executable) -> None:
        self.source = source
        self.mountpoint = mountpoint
        self.args = list(args)
        self.log_file = log_file
        self.cmd = [python, "-m", "qosfs", "mount", source, mountpoint,
                    "--log-file", log_file, *self.args]
        self.pid: int | None = None

    def __enter__(self) -> QosfsMount:
        # cwd and PYTHONPATH both name this tree, so the daemon runs this tree's qosfs even
        # when the interpreter's environment has another checkout installed (editable).
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.run(self.cmd, capture_output=True, text=True, cwd=str(REPO),
                              timeout=60, env=env)
        if proc.returncode != 0 or not os.path.ismount(self.mountpoint):
            line = (proc.stderr or proc.stdout).strip().splitlines()
            self.__exit__(None, None, None)  # in case it half-mounted
            raise BenchError(f"qosfs mount failed ({proc.returncode}): "
                             f"{line[-1] if line else 'mountpoint not mounted'}")
        pids = _pids_serving(self.mountpoint)
        self.pid = pids[0] if len(pids) == 1 else None
        return self

    def cpu_seconds(self) -> float | None:
        """User+system CPU the daemon (all its threads) has used so far."""
        return None if self.pid is None else cpu_seconds(self.pid)

    def io_bytes(self) -> tuple[int, int] | None:
        """(rchar, wchar) of the daemon: bytes through its read/write syscalls, backing
        store and /dev/fuse together (a check that cold reads really reached it)."""
        if self.pid is None:
            return None
        try:
            fields = dict(line.split(": ") for line in
                          Path(f"/proc/{self.pid}/io").read_text().splitlines())
        except (OSError, ValueError):
            return None
        return int(fields["rchar"]), int(fields["wchar"])

    def __exit__(self, *exc: object) -> None:
        mnt = self.mountpoint
        if os.path.ismount(mnt):
            unmount(mnt)
            if not _wait_unmounted(mnt, 15):
                _run(["umount", "-l", mnt], check=False)  # last resort
                _wait_unmounted(mnt, 5)
        if self.pid is not None:  # the daemon exits once unmounted; make sure of it
            deadline = time.monotonic() + 10
            while _alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(self.pid):
                os.kill(self.pid, signal.SIGKILL)


def unmount_and_reap(mnt: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Unmount a daemon's *mnt*, then wait *timeout* s for the daemon to end, and kill
    it if it does not (a bench's own mounts, on its way out)."""
    unmount(mnt)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_seconds(pid: int) -> float | None:
    """User+system CPU process *pid* (all its threads) has used so far; None once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def drop_caches() -> bool:
    """sync, then drop page cache, dentries and inodes. tmpfs keeps its data (its pages are
    the files); a FUSE mount loses its cached pages and the kernel forgets its dentries."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class CpuMeter:
    """Whole-machine busy share over an interval, from /proc/stat (all CPUs = 100%)."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals[:8]), idle

    def busy_pct(self) -> float:
        total, idle = self._read()
        dt = total - self._start[0]
        return 100.0 * (dt - (idle - self._start[1])) / dt if dt > 0 else 0.0


class CpuWatch:
    """Over an interval: the qosfs daemon's CPU share (100% = one core; None if unknown)
    and the whole machine's busy share."""

    def __init__(self, mount: QosfsMount | None) -> None:
        self.mount = mount
        self.meter = CpuMeter()
        self.t0 = time.monotonic()
        self.cpu0 = mount.cpu_seconds() if mount else None

    def figures(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        cpu1 = self.mount.cpu_seconds() if self.mount else None
        daemon = None if cpu1 is None or self.cpu0 is None else 100 * (cpu1 - self.cpu0) / wall
        return {"wall_s": wall, "daemon_cpu_pct": daemon,
                "machine_busy_pct": self.meter.busy_pct()}


def busy_pct_now(interval: float = 0.25) -> float:
    meter = CpuMeter()
    time.sleep(interval)
    return meter.busy_pct()


def wait_quiet(max_wait: float, threshold: float = 15.0) -> tuple[float, float]:
    """Wait (at most *max_wait* s) until the machine is under *threshold*% busy, so other
    tenants' bursts do not land in a measurement. Returns (seconds waited, last busy %)."""
    t0 = time.monotonic()
    busy = busy_pct_now()
    while busy > threshold and time.monotonic() - t0 < max_wait:
        busy = busy_pct_now()
    return time.monotonic() - t0, busy


def describe_disk(path: Path) -> str:
    """What *path* is on, for a report: "ext4 on /dev/vda1, mounted at /"."""
    proc = subprocess.run(["findmnt", "-no", "SOURCE,FSTYPE,TARGET", "--target", str(path)],
                          capture_output=True, text=True)
    fields = proc.stdout.split()
    if proc.returncode != 0 or len(fields) < 3:
        return str(path)
    return f"{fields[1]} on {fields[0]}, mounted at {fields[2]}"


def _first(path: str, key: str) -> str:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def git_commit() -> str | None:
    if shutil.which("git") is None:
        return None
    proc = _run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=False)
    if proc.returncode != 0:
        return None
    dirty = _run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                 check=False).stdout.strip()
    return proc.stdout.strip() + ("-dirty" if dirty else "")


def _version_of(module: str) -> str:
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:
        return "unknown"


def machine_info(fio_version: str) -> dict[str, Any]:
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "kernel": platform.release(),
        "cpu_model": _first("/proc/cpuinfo", "model name"),
        "nproc": len(os.sched_getaffinity(0)),
        "mem_total": _first("/proc/meminfo", "MemTotal"),
        "git_commit": git_commit(),
        "fio_version": fio_version,
        "python": platform.python_version(),
        "pyfuse3": _version_of("pyfuse3"),
        "trio": _version_of("trio"),
        "qosfs": _version_of("qosfs"),
        "qosfs_path": str(Path(qosfs.__file__).resolve().parent),
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
        # idle states decide how fast a sleeping daemon or fio wakes up (see the report)
        "cpuidle_driver": _read("/sys/devices/system/cpu/cpuidle/current_driver"),
        "cpuidle_governor": _read("/sys/devices/system/cpu/cpuidle/current_governor"),
        "guest_halt_poll_ns": _read("/sys/module/haltpoll/parameters/guest_halt_poll_ns"),
    }


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


@contextmanager
def qosfs_mount(source: Path, mnt: Path, work: Path, pythonpath: str,
                extra: list[str], nofile: int | None = None,
                ) -> Iterator[tuple[Path, int | None]]:
    """qosfs with the embedded default policy (as users mount it), in the foreground, its
    daemon run with *pythonpath* (empty: this process's) and, if given, *nofile* as its
    descriptor limit (soft and hard: the daemon raises its soft limit to the hard one)."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [sys.executable, "-m", "qosfs", "mount", "--foreground", str(source), str(mnt),
         "--socket", str(work / f"ctl-{mnt.name}.sock"),
         "--log-file", str(work / f"{mnt.name}.log"), *extra], env=env, cwd=str(work),
        preexec_fn=limit)
    try:
        for _ in range(600):
            if os.path.ismount(mnt) or proc.poll() is not None:
                break
            time.sleep(0.05)
        if not os.path.ismount(mnt):
            raise RuntimeError(f"qosfs did not mount {mnt} (see {work / mnt.name}.log)")
        yield mnt, proc.pid
    finally:
        unmount(mnt)
        proc.wait(timeout=30)
