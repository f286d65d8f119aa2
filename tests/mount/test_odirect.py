"""Files opened O_DIRECT through the mount keep every byte, whatever the kernel sends.

The kernel sends requests on an O_DIRECT open that O_DIRECT itself would refuse: the
writeback of a shared mapping ends at EOF, mid-block, and ``dd oflag=direct`` writes a
last partial block after clearing O_DIRECT with fcntl, which FUSE never reports. The
daemon issued them on its O_DIRECT descriptor, got EINVAL, and the data was lost
(qosfs.passthrough.odirect ``buffered``). Each test runs the same steps on a plain
directory and through qosfs, on an ext4 made for the test: tmpfs serves O_DIRECT from
its page cache and takes any alignment, so the loss never shows there. Steps run in a
child process with a timeout, so a hung mount fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.mounting import QosfsMount

pytestmark = [pytest.mark.mount, pytest.mark.root]

MiB = 1 << 20
BLOCK = 4096  # O_DIRECT steps use whole pages: ext4 refuses less than its logical block
TIMEOUT = 60  # seconds a child may take before the mount counts as hung
OPS = Path(__file__).with_name("odirect_ops.py")

# The sequence of issue 28: a shared mapping of an O_DIRECT file whose size ends
# mid-page; msync writes the last pages back as one request that ends at EOF.
ISSUE_SEQUENCE = r"""
import errno, json, mmap, os, sys
P = sys.argv[1]
fd = os.open(P, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
buf = mmap.mmap(-1, 0x37000); buf.write(b"a" * 0x37000); os.pwrite(fd, buf, 0)
os.ftruncate(fd, 0x1546c); os.ftruncate(fd, 0x2918a)
m = mmap.mmap(fd, 0x2918a, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
m[0x25000:0x2918a] = b"b" * (0x2918a - 0x25000)
try:
    m.flush()
    synced = "ok"
except OSError as exc:
    synced = errno.errorcode[exc.errno]
m.close()
os.close(fd)
with open(P, "rb") as f:
    data = f.read()
print(json.dumps([synced, data.count(b"b")]))
"""

# A user's own unaligned O_DIRECT requests: what each one returned, or its errno.
UNALIGNED = r"""
import errno, json, mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
buf = mmap.mmap(-1, 8192); buf.write(b"a" * 8192)
seen = []
for call in (lambda: os.pwrite(fd, buf, 0), lambda: os.pwrite(fd, b"b" * 100, 10),
             lambda: len(os.pread(fd, 100, 5))):
    try:
        seen.append(call())
    except OSError as exc:
        seen.append(errno.errorcode[exc.errno])
os.close(fd)
print(json.dumps(seen))
"""


def _run(args: list[str], stdin: str = "") -> Any:
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=TIMEOUT,
                          check=False, cwd="/")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) if done.stdout else None


def _digest(path: Path) -> str:
    return xxhash.xxh3_64_hexdigest(path.read_bytes())


class Sides:
    """Where the steps run: through qosfs (``mounted``, its tree underneath at
    ``backing``) and on a plain directory of the same ext4 (``bare``)."""

    def __init__(self, mounted: Path, backing: Path, bare: Path) -> None:
        self.mounted, self.backing, self.bare = mounted, backing, bare


@pytest.fixture
def ext4(tmp_tree: Path) -> Iterator[Path]:
    """A 64 MiB ext4 on a loop device, mounted at tmp/ext4.

    mkfs runs on the loop device, not on the image file: for a block device it can open
    exclusively, mkfs knows it is not mounted; for a file it stats every mount listed,
    and one hung FUSE mount (another test's) hangs it.
    """
    if shutil.which("mkfs.ext4") is None or shutil.which("losetup") is None:
        pytest.skip("needs mkfs.ext4 and losetup (e2fsprogs, util-linux)")
    image, where = tmp_tree / "ext4.img", tmp_tree / "ext4"
    with open(image, "wb") as f:
        f.truncate(64 * MiB)
    found = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True,
                           text=True, timeout=TIMEOUT, check=False)
    if found.returncode != 0:
        pytest.skip(f"no loop device: {found.stderr.strip()}")
    loop = found.stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", loop], check=True, capture_output=True,
                       timeout=TIMEOUT)
        where.mkdir()
        subprocess.run(["mount", loop, str(where)], check=True, timeout=TIMEOUT)
        try:
            yield where
        finally:
            if subprocess.run(["umount", str(where)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(where)], check=False)
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)


@pytest.fixture(params=["beside", "inplace"])
def sides(request: pytest.FixtureRequest, ext4: Path, tmp_tree: Path) -> Iterator[Sides]:
    """qosfs over ext4/src, mounted on tmp/mnt or in place over ext4/src itself (then the
    tree underneath stays visible at tmp/view through a bind mount taken before)."""
    src, bare = ext4 / "src", ext4 / "bare"
    src.mkdir()
    bare.mkdir()
    inplace = request.param == "inplace"
    if inplace:
        backing, mounted = tmp_tree / "view", src
        backing.mkdir()
        subprocess.run(["mount", "--bind", str(src), str(backing)], check=True)
    else:
        backing, mounted = src, tmp_tree / "mnt"
        mounted.mkdir()
    m = QosfsMount(src, mounted, log_path=tmp_tree / "qosfs.log")
    try:
        m.start()
        yield Sides(mounted, backing, bare)
    finally:
        code = m.stop()
        if inplace:
            subprocess.run(["umount", str(backing)], check=False)
        assert code == 0, m.log()
        assert "Traceback" not in m.log(), m.log()


def test_mmap_writes_to_an_o_direct_file_reach_the_file(sides: Sides) -> None:
    """Issue 28: msync answered EINVAL and the mapped range read back as zeros."""
    native = _run([sys.executable, "-c", ISSUE_SEQUENCE, str(sides.bare / "f")])
    assert native == ["ok", 0x2918a - 0x25000]
    assert _run([sys.executable, "-c", ISSUE_SEQUENCE, str(sides.mounted / "f")]) == native
    assert _digest(sides.backing / "f") == _digest(sides.bare / "f")


def test_dd_oflag_direct_copies_a_size_that_is_no_multiple_of_its_block(sides: Sides) -> None:
    """dd writes the last partial block after clearing O_DIRECT; it got EINVAL."""
    data = sides.bare / "in"
    data.write_bytes(bytes(range(256)) * 400 + b"tail")  # 102,404 bytes: 1.56 blocks of 64k
    for out in (sides.bare / "out", sides.mounted / "out"):
        subprocess.run(["dd", f"if={data}", f"of={out}", "bs=64k", "oflag=direct",
                        "status=none"], check=True, timeout=TIMEOUT)
    assert _digest(sides.backing / "out") == _digest(data)
    assert _digest(sides.mounted / "out") == _digest(sides.bare / "out") == _digest(data)


def test_an_unaligned_o_direct_request_is_served_where_ext4_refuses_it(sides: Sides) -> None:
    """The trade-off of serving what O_DIRECT refuses: the daemon cannot tell a caller's
    own unaligned request from the ones above, so it serves it through the page cache."""
    native = _run([sys.executable, "-c", UNALIGNED, str(sides.bare / "u")])
    assert native == [8192, "EINVAL", "EINVAL"]
    assert _run([sys.executable, "-c", UNALIGNED, str(sides.mounted / "u")]) == [8192, 100, 100]
    assert (sides.backing / "u").read_bytes() == b"a" * 10 + b"b" * 100 + b"a" * 8082


_byte = st.integers(1, 255)
_via = st.sampled_from(["d", "b"])
_blocks = st.integers(0, 24).map(lambda n: n * BLOCK)
_length = st.integers(1, 6).map(lambda n: n * BLOCK)
_step = st.one_of(
    st.tuples(st.just("dwrite"), _blocks, _length, _byte),
    st.tuples(st.just("dread"), _blocks, _length),
    st.tuples(st.just("bwrite"), st.integers(0, 110_000), st.integers(1, 20_000), _byte),
    st.tuples(st.just("bread"), st.integers(0, 110_000), st.integers(1, 20_000)),
    st.tuples(st.just("mwrite"), _via, st.integers(0, MiB), st.integers(1, 20_000), _byte,
              st.booleans()),
    st.tuples(st.just("mread"), _via, st.integers(0, MiB), st.integers(1, 20_000)),
    st.tuples(st.just("truncate"), _via, st.integers(0, 120_000)),
)
_names = count()


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(_step, min_size=1, max_size=10))
def test_mixed_direct_buffered_and_mapped_io_matches_ext4(sides: Sides,
                                                         steps: list[tuple[Any, ...]]) -> None:
    """O_DIRECT, buffered and mapped reads, writes and truncates of one file observe and
    leave what they do on ext4 itself, and the file underneath holds the same bytes."""
    name = f"m{next(_names)}"
    text = json.dumps(steps)
    native = _run([sys.executable, str(OPS), str(sides.bare / name)], text)
    assert _run([sys.executable, str(OPS), str(sides.mounted / name)], text) == native
    assert _digest(sides.backing / name) == native["digest"]
