"""The mount's session keyring (qosfs.core.keyring): a successor finds its predecessor's
by name, the keys of the session keyring before stay reachable, another user's keyring
of the same name is not joined, and a refusal is said. Joining changes the calling
thread's credentials, so each join runs in a process of its own, never in the test
process."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from qosfs.core import keyring
from qosfs.passthrough import read_counting
from qosfs.passthrough.read_counting import KernelReadCounting
from tests.mounting import as_user

JOIN = """
import sys
from qosfs.core.keyring import join_mount_keyring
print(*join_mount_keyring(sys.argv[1]), flush=True)
sys.stdin.readline()  # holds the keyring until told to go
"""
# Another user's keyring of the name a mount's would have, searchable by anyone (the
# system's python: that user cannot reach this checkout).
SQUAT = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
serial = libc.syscall(250, ctypes.c_long(1), sys.argv[1].encode())
libc.syscall(250, ctypes.c_long(5), ctypes.c_long(serial), ctypes.c_long(0x3F3F3F3F))
print(serial, flush=True)
sys.stdin.readline()
"""
SYSTEM_PYTHON = "/usr/bin/python3"


def _joiner(mountpoint: str, script: str = JOIN,
            uid: int | None = None) -> tuple[subprocess.Popen[str], int]:
    python = sys.executable if uid is None else SYSTEM_PYTHON
    proc = subprocess.Popen([python, "-c", script, mountpoint], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            preexec_fn=None if uid is None else as_user(uid))
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if not line or not line[0].isdigit():
        proc.kill()
        pytest.skip(f"no session keyring here: {' '.join(line)}")
    return proc, int(line[0])



def test_a_successor_joins_its_predecessors_keyring_by_name() -> None:
    mountpoint = f"/test/{uuid.uuid4()}"
    first, serial = _joiner(mountpoint)
    try:
        second, again = _joiner(mountpoint)
        try:
            assert again == serial  # a handover's successor: the same keyring
        finally:
            second.communicate("\n", timeout=30)
        other, different = _joiner(mountpoint + "-other")
        other.communicate("\n", timeout=30)
        assert different != serial  # another mountpoint: a keyring of its own
        # The first process's session keyring before (its login's) is linked into it.
        with open("/proc/keys") as keys:
            line = next(k for k in keys if f"{keyring.PREFIX}{mountpoint}:" in k)
        assert line.rstrip().endswith(": 1"), line
    finally:
        first.communicate("\n", timeout=30)


def test_another_users_keyring_of_the_same_name_is_not_joined() -> None:
    """Were the name guessed (it carries a keyed hash of the mountpoint, keyed with a
    secret only root reads), the keyring found under it is not the daemon's own user's:
    the daemon leaves it at once for an anonymous one, and links nothing into it."""
    if os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip("needs root (another user, and the secret in /run/qosfs) and "
                    f"{SYSTEM_PYTHON}")
    mountpoint = f"/test/{uuid.uuid4()}"
    name = keyring.keyring_name(mountpoint)
    assert mountpoint in name and name != keyring.PREFIX + mountpoint
    squatter, theirs = _joiner(name, SQUAT, uid=65534)
    try:
        ours, serial = _joiner(mountpoint)
        ours.communicate("\n", timeout=30)
        assert serial != theirs
        with open("/proc/keys") as keys:
            line = next(k for k in keys if k.startswith(f"{theirs:08x} "))
        assert line.rstrip().endswith(": empty"), line  # nothing of ours linked in
    finally:
        squatter.communicate("\n", timeout=30)


def test_a_refused_keyctl_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: int | bytes) -> int:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(keyring, "_keyctl", refused)
    assert keyring.join_mount_keyring("/mnt/x") == (
        None, "session keyring: Operation not permitted")


def test_counting_without_a_keyring_says_other_mounts_reads_are_counted_too(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(read_counting, "join_mount_keyring",
                        lambda mountpoint: (None, "session keyring: Operation not permitted"))
    counting = KernelReadCounting.start(1, "/mnt/x")
    said = [r for r in caplog.records if r.name == read_counting.__name__]
    for record in said:  # as it should be (and why the programs did not load, if not)
        record.expected = True  # type: ignore[attr-defined]
    assert any("another mount" in r.getMessage() for r in said)
    try:
        if not counting.on:
            pytest.skip(f"BPF programs cannot be loaded here: {counting.off_reason}")
        assert counting.status()["reason"].endswith(
            "reads of its files through another mount of the same source are counted here "
            "too (session keyring: Operation not permitted)")
    finally:
        counting.close()
