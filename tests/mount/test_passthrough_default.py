"""Kernel passthrough by default, through real qosfs mounts: read-only opens of every class
whose reads nothing caps are read by the kernel itself, the ``default`` class included --
fio on a generic file name, the restore of a ``*.pt`` checkpoint (whose class caps writes
only) -- source -> mountpoint and in place; a class with a read cap, and one that sets
``passthrough = "off"``, stay in the daemon; ``qosfs explain`` says which, and why.

What was passed through is read from the counters the daemon exports (``ctl status``'s
``passthrough``: opens per class, live backing ids; each class's read bytes, which only
reads the daemon served move), the contents from the backing file's xxhash."""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import xxhash

from qosfs.control.ctl import call
from qosfs.daemon import cli
from tests.mounting import QosfsMount

pytestmark = [pytest.mark.mount, pytest.mark.root]

MiB = 1 << 20
SIZE = 8 * MiB + 4096 + 17
# What the tests read: a generic name (the default class) and a checkpoint (the
# embedded policy's checkpoints class takes writes only: its reads are default's).
FILES = ("misc/fio-test.bin", "checkpoints/model.pt")
KEPT_POLICY = """
[classes.capped]
paths = ["capped/**"]
read_bandwidth = "1GiB/s"

[classes.kept]
paths = ["kept/**"]
passthrough = "off"
"""


def digest(data: bytes) -> str:
    return xxhash.xxh64(data).hexdigest()


class Live:
    """A mount, its control socket, and the tree underneath it as the tests see it."""

    def __init__(self, mount: QosfsMount, sock: Path, backing: Path) -> None:
        self.mount, self.sock, self.backing = mount, sock, backing
        self.mnt = mount.mountpoint

    def status(self) -> dict[str, Any]:
        return call(str(self.sock), {"cmd": "status"})

    def kernel(self) -> dict[str, Any]:
        entry: dict[str, Any] = self.status()["passthrough"]
        return entry

    def read_bytes(self, cls: str) -> int:
        return int(next(lv["read_bytes"] for lv in self.status()["levels"]
                        if lv["level"] == "class" and lv["name"] == cls))


def _put(root: Path, rel: str) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(os.urandom(SIZE))


def _mount(tmp: Path, in_place: bool, *args: str) -> Iterator[Live]:
    """Mount *tmp*/src (on *tmp*/mnt, or over itself with *tmp*/view a bind mount of it
    taken before), with *args*; skip where kernel passthrough cannot work."""
    if not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False):
        pytest.skip("pyfuse3 without kernel passthrough: `make deps` builds it")
    src, sock = tmp / "src", tmp / "ctl.sock"
    for rel in (*FILES, "capped/f.bin", "kept/f.bin", "other/f.bin"):
        _put(src, rel)
    backing = src
    if in_place:
        backing = tmp / "view"
        backing.mkdir()
        subprocess.run(["mount", "--bind", str(src), str(backing)], check=True)
        mount = QosfsMount(src, src, "--socket", str(sock), *args,
                           log_path=tmp / "inplace.log")
    else:
        (tmp / "mnt").mkdir()
        mount = QosfsMount(src, tmp / "mnt", "--socket", str(sock), *args)
    try:
        with mount:
            live = Live(mount, sock, backing)
            if live.kernel()["state"] != "active":
                pytest.skip(f"kernel passthrough unavailable here: {live.kernel()['reason']}")
            yield live
            log = mount.log()
            assert "Traceback" not in log and "WARNING" not in log, log
    finally:
        if in_place:
            subprocess.run(["umount", str(backing)], check=False)


@pytest.fixture(params=["source-mountpoint", "in-place"])
def default_mount(request: pytest.FixtureRequest, tmp_tree: Path) -> Iterator[Live]:
    """The embedded default policy (no --policy)."""
    yield from _mount(tmp_tree, request.param == "in-place")


@pytest.fixture
def kept_mount(tmp_tree: Path) -> Iterator[Live]:
    """A policy with a read-capped class and a class that opts out of passthrough."""
    policy = tmp_tree / "policy.toml"
    policy.write_text(KEPT_POLICY)
    yield from _mount(tmp_tree, False, "--policy", str(policy))


def test_reads_of_a_generic_name_and_of_a_checkpoint_are_passed_through(
        default_mount: Live) -> None:
    m = default_mount
    for rel in FILES:
        want = digest((m.backing / rel).read_bytes())
        with open(m.mnt / rel, "rb", buffering=0) as f:
            rng = random.Random(rel)
            backing = (m.backing / rel).read_bytes()
            for _ in range(2000):  # 4 KiB random reads, QD1
                off = rng.randrange(0, SIZE // 4096) * 4096
                assert os.pread(f.fileno(), 4096, off) == backing[off:off + 4096]
            assert m.kernel()["live_backing_ids"] == 1  # this open, passed through now
            chunks = []
            off = 0
            while chunk := os.pread(f.fileno(), MiB, off):  # a sequential restore
                chunks.append(chunk)
                off += len(chunk)
        assert digest(b"".join(chunks)) == want, rel
    kernel = m.kernel()
    assert kernel["opens"] == {"default": len(FILES)}, kernel
    assert kernel["live_backing_ids"] == 0  # given back with the opens
    assert m.read_bytes("default") == 0  # the kernel read every byte
    assert m.read_bytes("checkpoints") == 0


def test_fio_on_a_generic_name_is_passed_through(default_mount: Live) -> None:
    fio = shutil.which("fio")
    if fio is None:
        pytest.skip("fio is not installed")
    rel = FILES[0]
    out = subprocess.run(
        [fio, "--name=rr", f"--filename={default_mount.mnt / rel}", "--rw=randread",
         "--bs=4k", "--ioengine=psync", "--iodepth=1", f"--size={SIZE // 4096 * 4096}",
         "--output-format=json"],
        check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    assert job["error"] == 0 and job["read"]["total_ios"] == SIZE // 4096  # each block once
    kernel = default_mount.kernel()
    assert kernel["opens"].get("default", 0) >= 1, kernel
    assert default_mount.read_bytes("default") == 0  # no byte came through the daemon
    assert digest((default_mount.mnt / rel).read_bytes()) == \
        digest((default_mount.backing / rel).read_bytes())


def test_a_read_capped_class_and_an_opted_out_class_stay_in_the_daemon(
        kept_mount: Live) -> None:
    m = kept_mount
    for rel in ("capped/f.bin", "kept/f.bin", "other/f.bin"):
        assert digest((m.mnt / rel).read_bytes()) == digest((m.backing / rel).read_bytes())
    assert m.read_bytes("capped") >= SIZE
    assert m.read_bytes("kept") >= SIZE
    # Beside them, the default class of the same policy is passed through.
    assert m.read_bytes("default") == 0
    assert m.kernel()["opens"] == {"default": 1}


def explain(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict[str, Any], str]:
    """``qosfs explain`` of a live mount (the command line, in process): JSON and text."""
    answers = []
    for extra in (["--json"], []):
        code = cli.main(["explain", *args, *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        answers.append(out)
    body: dict[str, Any] = json.loads(answers[0])
    return body, answers[1]


def test_explain_says_the_kernel_serves_the_default_class(
        default_mount: Live, capsys: pytest.CaptureFixture[str]) -> None:
    for rel in FILES:
        body, text = explain(capsys, str(default_mount.mnt / rel), "--socket",
                             str(default_mount.sock))
        assert body["class"]["name"] == "default", rel
        served = body["served_by"]
        assert served["by"] == "kernel" and served["passthrough"] is True
        assert "no level caps the class's reads" in served["reason"]
        assert "served   the kernel (kernel passthrough: no level caps the class's reads)" \
            in text
    body, _ = explain(capsys, str(default_mount.mnt / FILES[1]), "--op", "write",
                      "--socket", str(default_mount.sock))
    assert body["class"]["name"] == "checkpoints"
    assert body["served_by"]["by"] == "daemon"


def test_explain_says_why_a_class_stays_in_the_daemon(
        kept_mount: Live, capsys: pytest.CaptureFixture[str]) -> None:
    sock = str(kept_mount.sock)
    capped, text = explain(capsys, str(kept_mount.mnt / "capped/f.bin"), "--socket", sock)
    assert capped["served_by"]["by"] == "daemon"
    assert capped["served_by"]["reason"] == "the class caps its reads"
    assert "served   the daemon (the class caps its reads)" in text
    kept, text = explain(capsys, str(kept_mount.mnt / "kept/f.bin"), "--socket", sock)
    assert kept["served_by"] == {"by": "daemon", "passthrough": False, "page_cache": "used",
                                 "reason": 'passthrough = "off" keeps the class\'s reads '
                                           "in the daemon"}
    other, _ = explain(capsys, str(kept_mount.mnt / "other/f.bin"), "--socket", sock)
    assert other["served_by"]["by"] == "kernel"


def _direct_reads(path: Path) -> tuple[str, bytes]:
    """An O_DIRECT read into a buffer 16 bytes past a page boundary: its outcome, then one
    into a page-aligned buffer.

    The unaligned buffer is placed, not left to the allocator: os.pread's buffer lands
    wherever malloc puts it, now and then on a 512-byte boundary, which a disk whose DMA
    alignment is 511 (virtio-blk) accepts, so the bare read and the mount's differed by
    luck."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with mmap.mmap(-1, 8192) as buf:
            view = memoryview(buf)
            try:
                try:
                    unaligned = f"read {os.preadv(fd, [view[16:16 + 4096]], 4096)}"
                except OSError as exc:
                    unaligned = errno.errorcode[exc.errno]
                assert os.preadv(fd, [view[:4096]], 4096) == 4096
                return unaligned, bytes(view[:4096])
            finally:
                view.release()
    finally:
        os.close(fd)


def test_an_o_direct_read_passed_through_follows_the_backing_filesystem(
        default_mount: Live) -> None:
    """Passed through, an O_DIRECT read is the backing filesystem's: an unaligned buffer
    fails (EINVAL on ext4) or not exactly as it does on the file itself (docs/policy.md)."""
    rel = FILES[0]
    want = _direct_reads(default_mount.backing / rel)
    assert _direct_reads(default_mount.mnt / rel) == want
    assert want[1] == (default_mount.backing / rel).read_bytes()[4096:8192]
    assert default_mount.kernel()["opens"] == {"default": 1}
