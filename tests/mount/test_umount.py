"""``qosfs umount``: it returns only once nothing of the mount holds its source, so that a
script can unmount the source's own filesystem next. Issue 38: right after
``fusermount3 -u`` returned, a ``umount`` of the backing filesystem failed with "target
is busy" (2 of 5 tries on a tmpfs here): the daemon was still closing its descriptors
into it, and its keeper holds the source's root until told to let go.

Each test gives qosfs a filesystem of its own as the source (a small tmpfs, mounted and
unmounted by the test), mounts qosfs on it as a script does (``qosfs mount``, which
daemonizes), stops it with ``qosfs umount`` and at once ``umount``s the tmpfs:

- ROUNDS times in a row, source -> mountpoint and in place, after reading and writing
  through the mount;
- after a ``kill -9`` of the daemon, its holder keeping the connection (and the
  source's root) for a successor; the dead daemon's files go too (with a ``--socket``
  elsewhere, found through its pointer);
- a mount with a file open under it stays mounted and served ("busy", exit 4), and
  unmounts once the file is closed;
- a path that is not a qosfs mount (the tmpfs itself) is refused and stays mounted.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosfs.control.address import beside_socket, default_socket_path
from qosfs.daemon.takeover import keeper
from tests.mounting import BOTH_LAYOUTS, ROOT, is_mounted
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root]

ROUNDS = 5
MiB = 1 << 20


def _qosfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qosfs", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _exited(pidfd: int) -> bool:
    """Whether the process of *pidfd* has exited (a zombie has: its files are closed)."""
    return bool(select.select([pidfd], [], [], 0)[0])


class Stage:
    """A tmpfs as the source, and the qosfs mounts on it, with the processes they start
    (by pidfd: a daemonized daemon is not the test's child)."""

    def __init__(self, top: Path) -> None:
        self.backing = top / "backing"
        self.mountpoint = top / "mnt"
        self.backing.mkdir()
        self.mountpoint.mkdir()
        self.processes: dict[str, int] = {}  # "daemon" / "keeper" -> pidfd

    def mount_backing(self) -> None:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "tmpfs",
                        str(self.backing)], check=True)

    def mount_qosfs(self, in_place: bool, socket: Path | None = None) -> Path:
        """``qosfs mount`` (daemonized) on the tmpfs, with ``--socket`` *socket* if given;
        the mountpoint, once the keeper holds the connection (the daemon starts it once
        the mount is initialised)."""
        mnt = self.backing if in_place else self.mountpoint
        where = [str(self.backing)] + ([] if in_place else [str(mnt)])
        told = [] if socket is None else ["--socket", str(socket)]
        done = _qosfs("mount", *where, "--cache", "never", *told)
        assert done.returncode == 0, done.stderr
        status = wait_for("the keeper to hold the connection", lambda: self.status(mnt),
                          until=lambda s: s["crash_protection"]["kept"])
        self._close_pidfds()
        control = str(socket) if socket is not None else default_socket_path(str(mnt))
        holder = keeper.holder_pid(keeper.keeper_socket_path(control))
        assert holder is not None
        self.processes = {"daemon": os.pidfd_open(status["pid"]),
                          "keeper": os.pidfd_open(holder)}
        return mnt

    def status(self, mnt: Path) -> dict[str, object]:
        asked = _qosfs("ctl", "--socket", str(mnt), "status", "--json")
        assert asked.returncode == 0, asked.stderr
        reply: dict[str, object] = json.loads(asked.stdout)
        return reply

    def running(self) -> list[str]:
        return [what for what, fd in self.processes.items() if not _exited(fd)]

    def _close_pidfds(self) -> None:
        for fd in self.processes.values():
            os.close(fd)
        self.processes = {}

    def close(self) -> None:
        """Unmount whatever is left, end the processes it started, by pidfd."""
        for path in (self.mountpoint, self.backing, self.backing):  # qosfs in place first
            if is_mounted(path):
                subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)
            if is_mounted(path):
                subprocess.run(["umount", "-l", str(path)], capture_output=True)
        for fd in self.processes.values():
            if not _exited(fd):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        self._close_pidfds()


@pytest.fixture
def stage(tmp_tree: Path) -> Iterator[Stage]:
    staged = Stage(tmp_tree)
    try:
        yield staged
    finally:
        staged.close()


def _umount_backing(stage: Stage) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["umount", str(stage.backing)], capture_output=True, text=True)


@BOTH_LAYOUTS
def test_umount_returns_once_the_source_can_be_unmounted(stage: Stage, in_place: bool) -> None:
    for round_ in range(ROUNDS):
        stage.mount_backing()
        data = os.urandom(MiB)
        (stage.backing / "data.bin").write_bytes(data)
        mnt = stage.mount_qosfs(in_place)
        assert (mnt / "data.bin").read_bytes() == data
        (mnt / "written.bin").write_bytes(data)  # a file the daemon created and wrote
        done = _qosfs("umount", str(mnt))
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
        freed = _umount_backing(stage)  # at once, as a script's next line
        assert freed.returncode == 0, f"round {round_}: {freed.stderr}"
        assert stage.running() == []


@pytest.mark.parametrize("socket", [False, True], ids=["default-socket", "--socket"])
def test_after_kill_9_umount_waits_for_the_keeper_to_let_the_source_go(
        stage: Stage, tmp_tree: Path, socket: bool) -> None:
    """And removes what the dead daemon left: its sockets, its journal, the pointer to a
    --socket elsewhere (found through that pointer)."""
    stage.mount_backing()
    run = tmp_tree / "run"
    run.mkdir()
    mnt = stage.mount_qosfs(in_place=False, socket=run / "q.sock" if socket else None)
    signal.pidfd_send_signal(stage.processes["daemon"], signal.SIGKILL)
    wait_for("the daemon to die", lambda: _exited(stage.processes["daemon"]))
    assert stage.running() == ["keeper"]  # holding the connection for a successor
    done = _qosfs("umount", str(mnt))
    assert done.returncode == 0, done.stderr
    assert f"the daemon of {mnt} does not answer" in done.stderr  # said, not waited for
    assert _umount_backing(stage).returncode == 0
    assert stage.running() == []
    control = str(run / "q.sock") if socket else default_socket_path(str(mnt))
    left = [path for path in (default_socket_path(str(mnt)), control,
                              beside_socket(control, ".handover"), keeper.journal_path(control))
            if os.path.lexists(path)]
    assert left == []  # the dead daemon's files, and the pointer


def test_a_busy_mount_stays_mounted_and_served_until_its_files_are_closed(
        stage: Stage) -> None:
    stage.mount_backing()
    mnt = stage.mount_qosfs(in_place=False)
    with open(mnt / "open.txt", "w") as f:
        busy = _qosfs("umount", "--timeout", "1", str(mnt))
        assert busy.returncode == 4
        assert busy.stderr == (f"qosfs: {mnt} is busy: a process has a file or directory "
                               f"open under it (fuser -vm {mnt}); it stays mounted\n")
        assert is_mounted(mnt) and stage.running() == ["daemon", "keeper"]
        f.write("still served")
    assert (mnt / "open.txt").read_text() == "still served"
    done = _qosfs("umount", str(mnt))
    assert done.returncode == 0, done.stderr
    assert _umount_backing(stage).returncode == 0


def test_a_path_that_is_not_a_qosfs_mount_is_refused_and_left_mounted(stage: Stage) -> None:
    stage.mount_backing()
    refused = _qosfs("umount", str(stage.backing))
    assert (refused.returncode, refused.stderr) == (
        4, f"qosfs: {stage.backing} is not a qosfs mount\n")
    assert is_mounted(stage.backing)
    assert _umount_backing(stage).returncode == 0
