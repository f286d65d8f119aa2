"""A bug in the QoS layer costs the requests it touches, never the mount.

The daemon runs under tests/faultinject.py, which breaks one piece of qosfs (admission
of a class, letting go of an open, the rate sampler) the way a bug would. Each test
checks that callers of the broken class get EIO, that other classes are served as
before, that the failures are counted in ``ctl status`` and logged once per kind, and
that the mount comes down cleanly (exit 0).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from qosfs.control.ctl import call
from tests.mount.test_faults import errno_of
from tests.mounting import ROOT, QosfsMount, is_mounted
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root]

# Direct I/O, and passthrough off: one read() or write() of the caller is one request to
# the daemon (not a read of the kernel's), so the failures can be counted exactly. The
# meta_iops cap (far above demand) makes metadata operations go through admission, where
# the "meta" fault sits.
POLICY = """
[classes.broken]
paths = ["broken", "broken/**"]
cache = "direct"
passthrough = "off"
meta_iops = 1000000

[classes.closing]
paths = ["closing", "closing/**"]

[classes.data]
paths = ["data", "data/**"]
cache = "direct"
passthrough = "off"
"""


@contextmanager
def faulty_mount(tmp_tree: Path, *faults: str) -> Iterator[tuple[QosfsMount, Path, Path]]:
    """qosfs from tmp/src on tmp/mnt with *faults* injected; yields (mount, mnt, socket).
    The daemon must end with exit 0 however the test went."""
    src, mnt, sock = tmp_tree / "src", tmp_tree / "mnt", tmp_tree / "ctl.sock"
    mnt.mkdir()
    for name in ("broken", "closing", "data"):
        (src / name).mkdir(parents=True)
        (src / name / "f").write_bytes(name.encode() * 1024)
    policy = tmp_tree / "policy.toml"
    policy.write_text(POLICY)
    entry = [str(ROOT / "tests" / "faultinject.py"),
             *(arg for fault in faults for arg in ("--fault", fault)), "--"]
    m = QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock), entry=entry)
    m.start()
    try:
        yield m, mnt, sock
    finally:
        log = m.log()
        code = m.stop()
        assert code == 0, log


def internal_errors(sock: Path) -> dict[str, dict[str, int]]:
    errors: dict[str, dict[str, int]] = call(str(sock), {"cmd": "status"})["internal_errors"]
    return errors


def logged(m: QosfsMount, where: str) -> int:
    """How many times the daemon logged an unexpected failure in *where*."""
    return sum(1 for line in m.log().splitlines()
               if " ERROR " in line and f"unexpected failure in {where}:" in line)


def test_a_bug_on_the_data_path_answers_eio_and_the_mount_keeps_serving(
        tmp_tree: Path) -> None:
    with faulty_mount(tmp_tree, "read=broken", "write=broken") as (m, mnt, sock):
        for _ in range(5):
            assert errno_of((mnt / "broken" / "f").read_bytes) == "EIO"
        with open(mnt / "broken" / "new", "wb", buffering=0) as f:  # open: not broken
            for _ in range(3):
                assert errno_of(lambda: f.write(b"w" * 4096)) == "EIO"
        # Another class reads and writes as if nothing happened.
        assert (mnt / "data" / "f").read_bytes() == b"data" * 1024
        (mnt / "data" / "new").write_bytes(b"n" * 8192)
        assert (tmp_tree / "src" / "data" / "new").read_bytes() == b"n" * 8192
        assert internal_errors(sock) == {"read": {"ValueError": 5},
                                         "write": {"ValueError": 3}}
        assert logged(m, "read") == logged(m, "write") == 1  # once per kind, not per request
        assert m.log().count("Traceback") == 2
        stats = call(str(sock), {"cmd": "stats"})
        data = next(a for a in stats["accounts"] if a["class"] == "data")
        assert data["read_bytes"] == 4096 and data["write_bytes"] == 8192
        assert is_mounted(mnt)


def _descriptors_of(m: QosfsMount, suffix: str) -> list[str]:
    """The daemon's descriptors open on a path ending in *suffix* (one closed between
    the listing and its readlink, as a release on its way does, is not)."""
    assert m.proc is not None
    fds = f"/proc/{m.proc.pid}/fd"
    held = []
    for fd in os.listdir(fds):
        try:
            if os.readlink(f"{fds}/{fd}").endswith(suffix):
                held.append(fd)
        except FileNotFoundError:
            pass
    return held


def test_a_bug_on_the_metadata_path_answers_eio_and_the_mount_keeps_serving(
        tmp_tree: Path) -> None:
    with faulty_mount(tmp_tree, "meta=broken", "release=closing") as (m, mnt, sock):
        for _ in range(3):
            assert errno_of(lambda: os.stat(mnt / "broken" / "f")) == "EIO"
        assert errno_of(lambda: os.listdir(mnt / "broken")) == "EIO"
        # Releases fail inside the daemon; close() never hears of it (FUSE_RELEASE is
        # answered after the caller's close returned).
        for _ in range(4):
            assert (mnt / "closing" / "f").read_bytes() == b"closing" * 1024
        # The daemon let go of each open's descriptor; the inode's own O_PATH one stays.
        # (The kernel sends a release after close() returned: the last may be on its way.)
        wait_for("the releases", lambda: _descriptors_of(m, "/src/closing/f"),
                 until=lambda held: len(held) <= 1, timeout=5, interval=0.05)
        assert sorted(os.listdir(mnt)) == ["broken", "closing", "data"]
        assert os.stat(mnt / "data" / "f").st_size == 4096
        assert (mnt / "data" / "f").read_bytes() == b"data" * 1024
        errors = internal_errors(sock)
        assert errors.pop("release") == {"KeyError": 4}
        # stat: the lookup of f in broken; listdir: its opendir (the kernel may also ask
        # for broken's attributes again once they expire).
        assert errors.pop("lookup")["ValueError"] >= 3
        assert errors.pop("opendir") == {"ValueError": 1}
        assert set(errors) <= {"getattr"}, errors
        assert logged(m, "lookup") == logged(m, "opendir") == logged(m, "release") == 1
        assert is_mounted(mnt)


def test_a_failing_service_is_restarted_and_the_mount_keeps_serving(tmp_tree: Path) -> None:
    trigger = tmp_tree / "break-sampler"
    with faulty_mount(tmp_tree, f"sampler={trigger}") as (m, mnt, sock):
        trigger.touch()
        wait_for("the sampler to fail", lambda: internal_errors(sock).get("control"),
                 interval=0.1)
        assert (mnt / "data" / "f").read_bytes() == b"data" * 1024
        trigger.unlink()
        errors = internal_errors(sock)
        assert list(errors) == ["control"] and errors["control"]["RuntimeError"] >= 1
        assert logged(m, "control") == 1
        # Restarted: the service that failed also answers SIGHUP, and reloads again (a
        # SIGHUP during the pause before the restart is ignored, so ask until it works).
        assert m.proc is not None
        pid = m.proc.pid

        def generation() -> int:
            found: int = call(str(sock), {"cmd": "status"})["generation"]
            if found == 1:
                os.kill(pid, signal.SIGHUP)
            return found

        wait_for("a reload by SIGHUP", generation, until=lambda found: found > 1,
                 interval=0.5)
        (mnt / "data" / "new").write_bytes(b"n" * 4096)
        assert is_mounted(mnt)


def test_the_wrapper_runs_qosfs_itself() -> None:
    """tests/faultinject.py without faults is the plain CLI (what the tests above rely on)."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "tests" / "faultinject.py"), "--",
                          "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("qosfs ")
