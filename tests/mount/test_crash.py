"""kill -9 of a daemon without a keeper (``--keeper none``) in the middle of throttled
traffic: nothing fsynced is lost, callers get ENOTCONN, and ``qosfs mount`` recovers the
stale mount. (test_crash_recovery: with a keeper, callers never notice.)

The writer fsyncs every MiB and reports the length and xxhash of what it had fsynced;
after the kill, that prefix must be in the source exactly. The reader must get an error
(not hang) and the file must be untouched. Then the ``qosfs mount`` command (the real
CLI, daemonized) finds the dead mount, unmounts it and mounts again.
(``test_lifecycle`` covers the plain kill -9 of an idle mount.)
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from tests.mount.test_lifecycle import _unmount
from tests.mounting import ROOT, QosfsMount, is_mounted

pytestmark = [pytest.mark.mount, pytest.mark.root]

MiB = 1 << 20
POLICY = """
[classes.ckpt]
paths = ["ckpt/**"]
write_bandwidth = "4MiB/s"
burst = "1MiB"
[classes.data]
paths = ["data/**"]
read_bandwidth = "4MiB/s"
burst = "1MiB"
"""

# Writes seeded random 256 KiB blocks, fsyncs every MiB and reports what is durable.
WRITER = r"""
import json, os, random, sys, xxhash
rnd, h, done = random.Random(7), xxhash.xxh3_128(), 0
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
try:
    while True:
        for _ in range(4):
            block = rnd.randbytes(256 * 1024)
            done += os.write(fd, block)
            h.update(block)
        os.fsync(fd)
        print(json.dumps({"synced": done, "digest": h.hexdigest()}), flush=True)
except OSError as exc:
    print(json.dumps({"errno": exc.errno}), flush=True)
"""

# Reads the file in 1 MiB blocks, reporting each block's digest, until an error.
READER = r"""
import json, os, sys, xxhash
fd = os.open(sys.argv[1], os.O_RDONLY)
off = 0
try:
    while block := os.pread(fd, 1 << 20, off):
        print(json.dumps({"off": off, "digest": xxhash.xxh3_128(block).hexdigest()}),
              flush=True)
        off += len(block)
except OSError as exc:
    print(json.dumps({"errno": exc.errno}), flush=True)
"""


def _prefix_digest(path: Path, size: int) -> str:
    with open(path, "rb") as f:
        return xxhash.xxh3_128(f.read(size)).hexdigest()


def _recover(src: Path, mnt: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "qosfs", "mount", str(src), str(mnt),
                          "--keeper", "none"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""


@pytest.mark.parametrize("traffic", ["checkpoint-write", "dataset-read"])
def test_kill_9_under_throttled_traffic_loses_nothing_and_mount_recovers(
        tmp_tree: Path, traffic: str) -> None:
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    for d in (src, mnt, src / "ckpt", src / "data"):
        d.mkdir()
    policy = tmp_tree / "policy.toml"
    policy.write_text(POLICY)
    dataset = os.urandom(32 * MiB)
    (src / "data" / "set").write_bytes(dataset)
    m = QosfsMount(src, mnt, "--policy", str(policy), "--keeper", "none").start()
    try:
        target = mnt / ("ckpt/model.pt" if traffic == "checkpoint-write" else "data/set")
        proc = subprocess.Popen([sys.executable, "-c",
                                 WRITER if traffic == "checkpoint-write" else READER,
                                 str(target)], stdout=subprocess.PIPE, text=True)
        # A few MiB through (the burst, then the 4 MiB/s cap): wait for three reports.
        assert proc.stdout is not None
        early = [proc.stdout.readline() for _ in range(3)]
        assert m.proc is not None
        m.proc.kill()
        m.proc.wait(10)
        out, _ = proc.communicate(timeout=30)  # the caller is told, not left hanging
        reports = [json.loads(line) for line in early + out.splitlines() if line.strip()]
        assert reports[-1]["errno"] in (errno.ENOTCONN, errno.ECONNABORTED), reports[-1]
        progress = [r for r in reports if "errno" not in r]
        assert len(progress) >= 3, reports  # the burst and the cap's pace, then the kill
        with pytest.raises(OSError) as info:
            os.statvfs(mnt)  # statfs always asks the daemon (stat may answer from cache)
        assert info.value.errno == errno.ENOTCONN  # the stale mount
        if traffic == "checkpoint-write":
            last = progress[-1]
            backing = src / "ckpt" / "model.pt"
            assert backing.stat().st_size >= last["synced"]
            assert _prefix_digest(backing, last["synced"]) == last["digest"]
        else:
            for r in progress:  # what the reader got was the file's content
                chunk = dataset[r["off"]:r["off"] + MiB]
                assert xxhash.xxh3_128(chunk).hexdigest() == r["digest"]
            assert (src / "data" / "set").read_bytes() == dataset
        _recover(src, mnt)  # the CLI, daemonized: finds the stale mount, mounts again
        if traffic == "checkpoint-write":
            assert _prefix_digest(mnt / "ckpt" / "model.pt", last["synced"]) == last["digest"]
        else:
            assert (mnt / "data" / "set").read_bytes()[:MiB] == dataset[:MiB]
    finally:
        _unmount(mnt)
        m.stop()
    assert not is_mounted(mnt)
