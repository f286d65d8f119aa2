"""The mount's session keyring (qosfs.core.keyring): a successor finds its predecessor's
by name, the keys of the session keyring before stay reachable, and a refusal is said.
Joining changes the calling thread's credentials, so each join runs in a process of its
own, never in the test process."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from qosfs.core import keyring
from qosfs.passthrough import read_counting
from qosfs.passthrough.read_counting import KernelReadCounting

JOIN = """
import sys
from qosfs.core.keyring import join_mount_keyring
print(*join_mount_keyring(sys.argv[1]), flush=True)
sys.stdin.readline()  # holds the keyring until told to go
"""


def _joiner(mountpoint: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", JOIN, mountpoint], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
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
