"""Start and stop real qosfs mounts for tests: always unmounted, never left stale."""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent

#: Runs a test twice, ``in_place`` False (the mountpoint apart from its source) and True
#: (the mount covers its source, as systemd and the DaemonSet deploy it).
BOTH_LAYOUTS = pytest.mark.parametrize("in_place", [False, True], ids=["apart", "in-place"])


def as_user(uid: int, gid: int | None = None,
            groups: Sequence[int] = ()) -> Callable[[], None]:
    """A ``preexec_fn`` that runs the child as *uid*, group *gid* (default: *uid*) and
    only the supplementary *groups*, as an unprivileged user of the mount would."""
    def drop() -> None:
        os.setgroups(list(groups))
        os.setgid(uid if gid is None else gid)
        os.setuid(uid)

    return drop


def is_mounted(path: str | os.PathLike[str]) -> bool:
    """Whether something is mounted on *path*, asking nothing of *path* itself: its
    parent is resolved, never the mountpoint, whose daemon may not answer (a stat of a
    dead-locked mount waits for ever)."""
    parent, name = os.path.split(os.path.abspath(path))
    target = os.path.join(os.path.realpath(parent), name)
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return any(line.split()[4] == target for line in f)


#: How long an unmount is tried again while the mount is busy (:func:`unmount`).
BUSY_FOR = 5.0


def unmount(mountpoint: str | os.PathLike[str], timeout: float = 20.0) -> bool:
    """``fusermount3 -u``, tried again every 50 ms for up to :data:`BUSY_FOR` seconds
    while it fails with EBUSY; whether the mount is gone.

    A FUSE mount is busy while any request to it is in flight. A test's own callers are
    done when it unmounts, but qosfs's latency canary (qosfs.qos.latency.probe) sends one
    every 2 ms for up to a window after a protected class's last request, and a caller
    killed in a throttled request is gone only once its request is answered: a
    single try failed with EBUSY on a loaded machine, and the daemon, still mounted,
    was killed. docs/administration.md tells administrators the same: try again.
    subprocess.TimeoutExpired if one try hangs (nobody answers the mount).
    """
    path = str(mountpoint)
    for _ in range(int(BUSY_FOR / 0.05)):
        done = subprocess.run(["fusermount3", "-u", path], capture_output=True,
                              timeout=timeout)
        if done.returncode == 0 or not is_mounted(path):
            return True
        if b"busy" not in done.stderr:
            return False
        time.sleep(0.05)
    return False


def abort_connection(mountpoint: str | os.PathLike[str]) -> bool:
    """Abort the FUSE connection mounted at *mountpoint* (fusectl), without a system call
    on the mount: what frees callers stuck on a dead daemon's requests (a killed process
    waits for a request that was sent; only an answer or an abort ends it). Returns
    whether there was one to abort."""
    target = os.path.abspath(mountpoint)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == target and " - fuse" in line:
                minor = fields[2].split(":")[1]
                with open(f"/sys/fs/fuse/connections/{minor}/abort", "w") as abort:
                    abort.write("1")
                return True
    return False


def reachable_tmpdir(name: str) -> Path:
    """A new directory for sources and mountpoints that other users can reach (for uid
    tests), in the system's temporary directory, its name from *name*.

    Not under pytest's ``tmp_path``: every pytest session that starts on the machine
    resets ``/tmp/pytest-of-<user>`` to 0700, which cut off the uids of tests already
    running in other sessions (EACCES in mid-test)."""
    label = re.sub(r"[^\w.-]", "_", name)[:30]
    path = Path(tempfile.mkdtemp(prefix=f"qosfs-{label}-"))
    os.chmod(path, 0o755)
    for parent in path.parents:  # a TMPDIR of 0700 parents: open a path through them
        if parent == Path("/"):
            break
        mode = parent.stat().st_mode
        if not mode & 0o001:
            os.chmod(parent, mode | 0o711)
    return path


#: Where the scale and memory tests make their big trees: a tmpfs of their own. On the
#: VMs' ext4 a million empty files took 30-80 s to make (more right after another big
#: tree was removed: 3.8 s for 200,000 once, 69 s the next time) and 13 s to remove; on
#: tmpfs a few seconds, and the unmount frees them at once. The daemon serves a tmpfs as
#: it serves a disk (inodes named by file handle, the compact tables), which is what
#: those tests measure.
BIG_TREE_TMPFS = "mode=0755,nr_inodes=2m"


@contextmanager
def scratch_fs(path: Path, fstype: str = "tmpfs", options: str = "mode=0755",
               ) -> Iterator[Path]:
    """*path* (made if missing) with a filesystem of its own, *fstype* mounted with
    *options*, unmounted on the way out (lazily if something still holds it)."""
    path.mkdir(mode=0o755, exist_ok=True)
    subprocess.run(["mount", "-t", fstype, "-o", options, "qosfs-test", str(path)],
                   check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def mounted_under(path: Path) -> bool:
    """Whether anything is mounted below *path* (asking nothing of the mounts)."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return any(line.split()[4].startswith(f"{path}/") for line in f)


class QosfsMount:
    """A foreground qosfs daemon in a subprocess, so the test knows its PID."""

    def __init__(self, source: Path, mountpoint: Path, *args: str,
                 log_path: Path | None = None, nofile: int | None = None,
                 wrapper: Sequence[str] = (), entry: Sequence[str] = ("-m", "qosfs")) -> None:
        self.source = source
        self.nofile = nofile  # the daemon's RLIMIT_NOFILE (soft and hard), if set
        self.wrapper = list(wrapper)  # runs the daemon, e.g. setpriv with a bounding set
        # What the interpreter runs: qosfs, or e.g. tests/faultinject.py with its faults.
        self.entry = list(entry)
        self.mountpoint = mountpoint
        self.args = args
        self.log_path = log_path or mountpoint.parent / f"qosfs-{mountpoint.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> QosfsMount:
        cmd = [*self.wrapper, sys.executable, *self.entry, "mount", "--foreground",
               str(self.source)]
        if self.mountpoint != self.source:
            cmd.append(str(self.mountpoint))
        cmd += list(self.args)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        limit = self.nofile
        preexec = None if limit is None else (
            lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
        self.proc = proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                            cwd=ROOT, preexec_fn=preexec)

        def serving() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"qosfs exited with {proc.returncode}: {self.log()}")
            # The daemon's own line once everything answers ("serving metrics on ..."
            # comes earlier, before INIT and the crash keeper).
            return (is_mounted(self.mountpoint)
                    and b"qosfs serving " in self.log_path.read_bytes())

        try:
            wait_for("qosfs to serve", serving, timeout=timeout, interval=0.05)
        except AssertionError:
            self.stop()
            raise RuntimeError(f"qosfs did not become ready: {self.log()}") from None
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int | None:
        """Unmount politely, then by force; returns the daemon's exit code."""
        if self.proc is None:
            return None
        if is_mounted(self.mountpoint):
            try:
                unmount(self.mountpoint, timeout)
            except subprocess.TimeoutExpired:
                # The daemon no longer answers (a dead-locked mount): only its death ends
                # the requests that wait on it, fusermount3's included.
                self.proc.kill()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(timeout)
        if is_mounted(self.mountpoint):  # last resort: never leave a stale mount behind
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
        if is_mounted(self.mountpoint) and shutil.which("umount"):
            subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)
        self._log.close()
        self.proc = None
        return code

    def __enter__(self) -> QosfsMount:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
