"""The BPF programs that count what the kernel reads from passed-through backing files,
loaded for real (root, BPF, BTF) and made to count this test's own reads of a file it
watches: buffered reads of every size, reads past the end, O_DIRECT reads, a file that is
not watched, both ways of loading (BTF-typed and plain raw tracepoints)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosfs.core.bpf.btf import KernelTypes
from qosfs.core.mountinfo import mounts
from qosfs.passthrough.read_counting import COUNTED_FILESYSTEMS
from qosfs.passthrough.read_probes import ReadProbes
from qosfs.passthrough.read_programs import INDEX_SIZE, Offsets, ProbeError, kernel_layout

pytestmark = pytest.mark.root

KiB, MiB = 1 << 10, 1 << 20
SIZE = 9 * MiB + 12_345  # not a whole number of pages
SLOT = 7


def _fstype(path: Path) -> str | None:
    dev = os.stat(path).st_dev
    return next((m.fstype for m in mounts() if m.dev == f"{os.major(dev)}:{os.minor(dev)}"),
                None)


@pytest.fixture
def backing(tmp_path: Path) -> Path:
    if _fstype(tmp_path) not in COUNTED_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is on {_fstype(tmp_path)}, whose reads are not counted")
    path = tmp_path / "file.bin"
    path.write_bytes(os.urandom(SIZE))
    return path


def _load(typed: bool) -> ReadProbes:
    """Programs that count this process's reads too (tgid 1 is init, which reads none
    of the test's files), direct reads of a watched file included: there is no mount
    here (tests/mount/test_passthrough_counting.py shows those are left out)."""
    if os.geteuid() != 0:
        pytest.skip("loading BPF programs needs root")
    try:
        if typed:
            return ReadProbes.load(tgid=1, max_watched=16, max_counts=16,
                                   passthrough_only=False)
        offsets, _ = kernel_layout()
        probes = ReadProbes(16, 16)
        probes._attach_all(offsets, 1, None, passthrough_only=False, keyring=None)
        probes.mode = "raw_tp"
        return probes
    except ProbeError as exc:
        pytest.skip(f"BPF programs cannot be loaded here: {exc}")


@pytest.fixture(params=[True, False], ids=["tp_btf", "raw_tp"])
def probes(request: pytest.FixtureRequest) -> Iterator[ReadProbes]:
    p = _load(request.param)
    yield p
    p.close()


def _counted(probes: ReadProbes) -> tuple[int, int]:
    totals = probes.totals()
    assert set(totals) <= {(SLOT, os.getuid())}
    return totals.get((SLOT, os.getuid()), (0, 0))


def _drop_cache(fd: int) -> None:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def test_buffered_reads_are_counted_once_each_with_their_bytes(
        probes: ReadProbes, backing: Path) -> None:
    st = os.stat(backing)
    assert probes.watch(st.st_dev, st.st_ino, SLOT)
    fd = os.open(backing, os.O_RDONLY)
    try:
        # 4 KiB reads: one batch each; the last one is cut at the end of the file.
        n = sum(len(os.pread(fd, 4 * KiB, off)) for off in range(0, SIZE, 4 * KiB))
        assert n == SIZE
        assert _counted(probes) == (SIZE, -(-SIZE // (4 * KiB)))
        # 1 MiB reads of a cold file: the kernel asks for their pages batch by batch
        # (each batch a tracepoint hit); each read is counted once, the last cut at EOF.
        _drop_cache(fd)
        reads = 0
        while os.pread(fd, MiB, reads * MiB):
            reads += 1
        assert _counted(probes) == (2 * SIZE, -(-SIZE // (4 * KiB)) + reads)
        # A read far larger than the file moves the file once; a read at EOF moves nothing.
        before = _counted(probes)
        assert len(os.pread(fd, 64 * MiB, 0)) == SIZE
        assert os.pread(fd, MiB, SIZE) == b""
        assert _counted(probes) == (before[0] + SIZE, before[1] + 1)
    finally:
        os.close(fd)


def test_the_programs_are_attached_only_while_a_file_is_watched(
        probes: ReadProbes, backing: Path) -> None:
    """Attached, they cost every buffered read on the machine a call: a mount with
    nothing watched detaches them, and its first watched file attaches them again."""
    st = os.stat(backing)
    fd = os.open(backing, os.O_RDONLY)
    try:
        assert probes.watch(st.st_dev, st.st_ino, SLOT) and probes.attached
        assert len(os.pread(fd, 4 * KiB, 0)) == 4 * KiB
        assert _counted(probes) == (4 * KiB, 1)
        probes.unwatch(st.st_dev, st.st_ino)
        assert not probes.attached
        assert probes.watch(st.st_dev, st.st_ino, SLOT) and probes.attached
        assert len(os.pread(fd, 4 * KiB, 4 * KiB)) == 4 * KiB
        assert _counted(probes) == (8 * KiB, 2)
    finally:
        os.close(fd)


def test_o_direct_reads_are_counted_with_their_bytes_and_writes_are_not(
        probes: ReadProbes, backing: Path) -> None:
    st = os.stat(backing)
    assert probes.watch(st.st_dev, st.st_ino, SLOT)
    fd = os.open(backing, os.O_RDWR | os.O_DIRECT)
    buf = mmap.mmap(-1, MiB)  # page-aligned, as O_DIRECT wants
    try:
        done = reads = 0
        while (n := os.preadv(fd, [buf], done)) > 0:
            done += n
            reads += 1
        assert done == SIZE
        assert _counted(probes) == (SIZE, reads)
        os.pwritev(fd, [buf], 0)  # an O_DIRECT write: not a read
        assert _counted(probes) == (SIZE, reads)
    finally:
        os.close(fd)
        buf.close()


def _read_as(uid: int, path: Path, cpu: int) -> None:
    """Read *path* whole as *uid*, on *cpu*, in a child process (which opens it first,
    as root: the test's directories are root's alone)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.sched_setaffinity(0, {cpu})
            with open(path, "rb") as f:
                os.setuid(uid)
                code = 0 if len(f.read()) == SIZE else 2
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0


def test_a_second_uid_on_the_same_cpu_is_counted_apart_and_forget_clears_the_slot(
        probes: ReadProbes, backing: Path) -> None:
    """The first uid to read a file on a CPU is counted in the slot's array entry, a
    second one in the hash: both exact, each under its own uid; after forget the slot
    counts from nothing (for the next file that gets it)."""
    st = os.stat(backing)
    assert probes.watch(st.st_dev, st.st_ino, SLOT)
    cpu = min(os.sched_getaffinity(0))
    for uid in (2001, 2002, 2001):
        _read_as(uid, backing, cpu)
    totals = probes.totals([SLOT])
    assert set(totals) == {(SLOT, 2001), (SLOT, 2002)}
    assert totals[SLOT, 2001][0] == 2 * SIZE and totals[SLOT, 2002][0] == SIZE
    assert totals[SLOT, 2001][1] == 2 * totals[SLOT, 2002][1] > 0
    assert probes.totals() == totals  # every slot looked at: the same
    probes.forget(SLOT, [2001, 2002])
    assert probes.totals() == {}
    _read_as(2002, backing, cpu)  # the entry is 2002's now, from nothing
    assert probes.totals([SLOT]) == {(SLOT, 2002): totals[SLOT, 2002]}


def test_changed_totals_leave_out_what_was_not_read_and_keep_a_uid_whole(
        probes: ReadProbes, backing: Path) -> None:
    """The drain's reading: a slot not read since the last one is left out, unless the
    hash holds counts of it, since one uid may be counted in the array on one CPU and in
    the hash on another: its total must come whole, never the hash's part alone."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    st = os.stat(backing)
    assert probes.watch(st.st_dev, st.st_ino, SLOT)
    assert probes.changed_totals([SLOT]) == {}
    _read_as(2001, backing, cpus[0])  # 2001 owns the slot's entry on the first CPU
    _read_as(2002, backing, cpus[1])  # 2002 on the second
    first = probes.changed_totals([SLOT])
    assert {k: v[0] for k, v in first.items()} == {(SLOT, 2001): SIZE, (SLOT, 2002): SIZE}
    assert probes.changed_totals([SLOT]) == {}  # nothing read since
    _read_as(2002, backing, cpus[0])  # in the hash: the first CPU's entry is 2001's
    second = probes.changed_totals([SLOT])
    assert second[SLOT, 2002][0] == 2 * SIZE  # the array's part and the hash's
    assert second == probes.totals([SLOT])


def test_a_slot_given_to_the_next_file_is_seen_even_with_the_same_count(
        probes: ReadProbes, backing: Path) -> None:
    """The drain finds changed slots by comparing each CPU's region with its last
    reading. A slot forgotten and given to the next file, which the same uid reads as
    much on the same CPU, ends with the very bytes the last reading saw: it must still
    be reported, as the next file's count."""
    st = os.stat(backing)
    cpu = min(os.sched_getaffinity(0))
    assert probes.watch(st.st_dev, st.st_ino, SLOT)
    _read_as(2001, backing, cpu)
    first = probes.changed_totals([SLOT])
    assert first[SLOT, 2001][0] == SIZE
    probes.unwatch(st.st_dev, st.st_ino)
    probes.forget(SLOT, [2001])  # as the drain does, after its reading
    assert probes.watch(st.st_dev, st.st_ino, SLOT)  # "the next file", before the next
    _read_as(2001, backing, cpu)
    assert probes.changed_totals([SLOT]) == first


def test_a_reading_reports_the_one_slot_read_among_many_and_no_other(
        probes: ReadProbes, backing: Path) -> None:
    """Slots read and slots not read side by side, in the same block of the region and
    in others: a reading reports exactly the slots counted since the last one."""
    st = os.stat(backing)
    cpu = min(os.sched_getaffinity(0))
    watched = set(range(probes.max_watched))
    assert probes.changed_totals(watched) == {}
    for slot in (0, SLOT, probes.max_watched - 1):
        assert probes.watch(st.st_dev, st.st_ino, slot)
        _read_as(2001, backing, cpu)
        assert set(probes.changed_totals(watched)) == {(slot, 2001)}, slot
        assert probes.changed_totals(watched) == {}
        probes.unwatch(st.st_dev, st.st_ino)


def test_a_file_that_is_not_watched_is_not_counted(probes: ReadProbes, backing: Path,
                                                   tmp_path: Path) -> None:
    other = tmp_path / "other.bin"
    other.write_bytes(os.urandom(MiB))
    st = os.stat(backing)
    assert probes.watch(st.st_dev, st.st_ino, SLOT)
    assert other.read_bytes()
    assert _counted(probes) == (0, 0)
    probes.unwatch(st.st_dev, st.st_ino)
    assert backing.read_bytes()
    assert _counted(probes) == (0, 0)


def test_the_daemons_own_reads_are_skipped(backing: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("loading BPF programs needs root")
    try:
        probes = ReadProbes.load(tgid=os.getpid(), max_watched=16, max_counts=16,
                                 passthrough_only=False)
    except ProbeError as exc:
        pytest.skip(f"BPF programs cannot be loaded here: {exc}")
    try:
        st = os.stat(backing)
        assert probes.watch(st.st_dev, st.st_ino, SLOT)
        assert len(backing.read_bytes()) == SIZE
        assert probes.totals() == {}
    finally:
        probes.close()


def test_the_layout_cache_answers_what_the_btf_says(tmp_path: Path) -> None:
    try:
        offsets, ids = kernel_layout(tmp_path / "layout.json")
    except ProbeError as exc:
        pytest.skip(str(exc))
    assert (tmp_path / "layout.json").exists()
    assert kernel_layout(tmp_path / "layout.json") == (offsets, ids)
    assert offsets == Offsets.of(KernelTypes.of_running_kernel())


@pytest.mark.parametrize("first", ["other", "backing"])
def test_files_whose_inode_numbers_share_an_index_entry_are_each_counted(
        probes: ReadProbes, backing: Path, first: str) -> None:
    """Two watched files with the same low bits of their inode numbers: one in the index
    entry, the other in the hash (whichever came first takes the entry); each counted
    under its own slot, and still after the other is let go."""
    st = os.stat(backing)
    other = (st.st_dev, st.st_ino + INDEX_SIZE, 9)  # same low bits; never read
    mine = (st.st_dev, st.st_ino, SLOT)
    for dev, ino, slot in ([other, mine] if first == "other" else [mine, other]):
        assert probes.watch(dev, ino, slot)
    assert len(backing.read_bytes()) == SIZE
    assert _counted(probes)[0] == SIZE
    probes.unwatch(other[0], other[1])
    assert len(backing.read_bytes()) == SIZE
    assert _counted(probes)[0] == 2 * SIZE
    probes.unwatch(st.st_dev, st.st_ino)
    probes.unwatch(st.st_dev, st.st_ino)  # not watched: nothing happens
    assert len(backing.read_bytes()) == SIZE
    assert _counted(probes)[0] == 2 * SIZE
    assert probes.watch(st.st_dev, st.st_ino, SLOT)  # the entry is free again
    assert len(backing.read_bytes()) == SIZE
    assert _counted(probes)[0] == 3 * SIZE


def test_at_most_max_watched_files_are_watched(probes: ReadProbes, backing: Path) -> None:
    st = os.stat(backing)
    fakes = [(st.st_dev, st.st_ino + i * INDEX_SIZE // 4) for i in range(1, 17)]
    assert all(probes.watch(dev, ino, i + 1) for i, (dev, ino) in enumerate(fakes))
    assert not probes.watch(st.st_dev, st.st_ino, SLOT)  # 16 is the fixture's room
    probes.unwatch(*fakes[0])
    assert probes.watch(st.st_dev, st.st_ino, SLOT)
