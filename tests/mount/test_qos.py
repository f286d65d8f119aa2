"""QoS through real mounts: caps hold, classification by path/uid/job, no collateral."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.mounting import QosfsMount, as_user

pytestmark = pytest.mark.mount

MiB = 1 << 20
POLICY = """
[classes.capped]
paths = ["capped/**"]
write_bandwidth = "40MiB/s"
read_bandwidth = "40MiB/s"
burst = "4MiB"

# The cache tests watch the daemon's choice of page cache for writers through a
# read-only mapping: passed through, that open would put the file in the kernel's hands
# (and the writer with it), so these classes keep their reads in the daemon.
[classes.writecap]
paths = ["wcap/**"]
write_bandwidth = "400MiB/s"
passthrough = "off"

[classes.rwdirect]
paths = ["rwd/**"]
cache = "direct-writes"
passthrough = "off"

[classes.jobcap]
job_env = "SLURM_JOB_ID"
jobs = ["77*"]
write_bandwidth = "20MiB/s"
burst = "2MiB"

[classes.usercap]
uids = [4242]
write_bandwidth = "20MiB/s"
burst = "2MiB"
"""

WRITE = r"""
import os, sys, time
path, total = sys.argv[1], int(sys.argv[2])
block = b"q" * (1 << 20)
t = time.monotonic()
with open(path, "wb") as f:
    for _ in range(total // len(block)):
        f.write(block)
        f.flush()
    os.fsync(f.fileno())
print(time.monotonic() - t)
"""


@pytest.fixture
def policy_mount(tmp_tree: Path):
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    for d in (src, mnt):
        d.mkdir()
        os.chmod(d, 0o777)
    for sub in ("capped", "free", "wcap", "rwd"):
        (src / sub).mkdir()
        os.chmod(src / sub, 0o777)
    policy = tmp_tree / "policy.toml"
    policy.write_text(POLICY)
    with QosfsMount(src, mnt, "--policy", str(policy)) as m:
        yield m


def _timed_write(path: Path, total: int, env: dict[str, str] | None = None,
                 user: int | None = None) -> float:
    python = "/usr/bin/python3" if user is not None else sys.executable
    out = subprocess.run([python, "-c", WRITE, str(path), str(total)], capture_output=True,
                         text=True, env={**os.environ, **(env or {})},
                         preexec_fn=as_user(user) if user is not None else None,
                         check=True)
    return float(out.stdout)


def test_write_cap_holds_and_uncapped_class_is_not_slowed(policy_mount) -> None:
    mnt = policy_mount.mountpoint
    results: dict[str, float] = {}
    capped = threading.Thread(target=lambda: results.__setitem__(
        "capped", _timed_write(mnt / "capped" / "ckpt", 100 * MiB)))
    capped.start()
    time.sleep(0.3)
    results["free"] = _timed_write(mnt / "free" / "data", 100 * MiB)
    capped.join()
    expected = (100 - 4) / 40  # the burst goes at once, the rest at the cap
    assert expected * 0.85 <= results["capped"] <= expected * 1.15, results
    # Uncapped: 100 MiB in well under the capped writer's 2.4 s, even on a loaded machine.
    assert results["free"] < results["capped"] / 2, results
    assert (policy_mount.source / "capped" / "ckpt").stat().st_size == 100 * MiB


def _write_here(path: Path, total: int) -> float:
    """Seconds this process takes to write *total* bytes to *path* (same pid every time,
    so the daemon's per-inode classification memo is what decides)."""
    block = b"m" * MiB
    t = time.monotonic()
    with open(path, "wb") as f:
        for _ in range(total // MiB):
            f.write(block)
            f.flush()
        os.fsync(f.fileno())
    return time.monotonic() - t


def test_a_renamed_file_is_classified_by_its_new_path_at_its_next_open(policy_mount) -> None:
    mnt, src = policy_mount.mountpoint, policy_mount.source
    capped_time = (20 - 4) / 40  # 20 MiB at 40 MiB/s after the 4 MiB burst
    assert _write_here(mnt / "free" / "f", 20 * MiB) < capped_time / 2
    # renamed through the mount: the next open is capped at once
    os.rename(mnt / "free" / "f", mnt / "capped" / "f")
    assert _write_here(mnt / "capped" / "f", 20 * MiB) >= capped_time * 0.85
    # renamed underneath, behind the daemon's back: seen within the kernel's entry timeout
    os.rename(src / "capped" / "f", src / "free" / "f")
    time.sleep(1.2)
    assert _write_here(mnt / "free" / "f", 20 * MiB) < capped_time / 2


def _resident_pages(mapping: mmap.mmap) -> int:
    """How many pages of *mapping* are in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = len(mapping)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec)


def _cached_after_writing(path: Path, size: int, mode: str = "wb") -> int:
    """Pages of *path* in the mount's page cache after writing it whole through a
    descriptor opened with *mode* ("wb": O_WRONLY, "r+b": O_RDWR), watched through a
    private mapping made beforehand (never written to: its pages are the cache's)."""
    with open(path, "rb") as r, mmap.mmap(r.fileno(), size, flags=mmap.MAP_PRIVATE,
                                          prot=mmap.PROT_READ | mmap.PROT_WRITE) as view:
        with open(path, mode, buffering=0) as w:
            w.write(b"w" * size)
        return _resident_pages(view)


def test_write_only_files_of_a_write_capped_class_bypass_the_page_cache(
        policy_mount) -> None:
    mnt, src = policy_mount.mountpoint, policy_mount.source
    size = 4 * MiB
    for sub in ("wcap", "free"):
        (src / sub / "f").write_bytes(bytes(size))
    # a class with a write cap: the checkpoint stream leaves nothing in the cache ...
    assert _cached_after_writing(mnt / "wcap" / "f", size) == 0
    # ... an uncapped class keeps the pages it wrote, as the directory underneath would,
    assert _cached_after_writing(mnt / "free" / "f", size) > 0
    # ... and so does a read-write open of the capped class (it may be mapped shared)
    assert _cached_after_writing(mnt / "wcap" / "f", size, "r+b") > 0
    assert (src / "wcap" / "f").read_bytes() == b"w" * size


def test_direct_writes_bypasses_the_page_cache_for_read_write_opens_too(
        policy_mount) -> None:
    mnt, src = policy_mount.mountpoint, policy_mount.source
    (src / "rwd" / "f").write_bytes(bytes(MiB))
    assert _cached_after_writing(mnt / "rwd" / "f", MiB, "r+b") == 0
    assert (src / "rwd" / "f").read_bytes() == b"w" * MiB
    with open(mnt / "rwd" / "f", "r+b") as f, pytest.raises(OSError) as err:
        mmap.mmap(f.fileno(), MiB)  # the documented price: no shared writable mapping
    assert err.value.errno == errno.ENODEV
    with open(mnt / "rwd" / "f", "rb") as f, mmap.mmap(f.fileno(), MiB,
                                                        prot=mmap.PROT_READ) as m:
        assert m[:1] == b"w"  # read-only opens keep the cache and map as usual


def test_a_read_write_file_of_a_write_capped_class_can_still_be_mapped_shared(
        policy_mount) -> None:
    path = policy_mount.mountpoint / "wcap" / "mapped"
    path.write_bytes(bytes(MiB))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), MiB) as m:
        m[:5] = b"hello"
        m.flush()
    assert (policy_mount.source / "wcap" / "mapped").read_bytes()[:5] == b"hello"


def test_read_cap_is_not_escaped_through_the_page_cache(policy_mount) -> None:
    path = policy_mount.source / "capped" / "dataset"
    path.write_bytes(os.urandom(40 * MiB))
    for _ in range(2):  # the second read would come from cache without direct_io
        t = time.monotonic()
        assert len((policy_mount.mountpoint / "capped" / "dataset").read_bytes()) == 40 * MiB
        elapsed = time.monotonic() - t
        assert elapsed >= (40 - 4) / 40 * 0.85, elapsed


def test_job_id_from_the_callers_environment_selects_the_class(policy_mount) -> None:
    mnt = policy_mount.mountpoint / "free"
    slow = _timed_write(mnt / "job", 30 * MiB, env={"SLURM_JOB_ID": "7712"})
    fast = _timed_write(mnt / "nojob", 30 * MiB, env={"SLURM_JOB_ID": "1"})
    assert (30 - 2) / 20 * 0.85 <= slow <= (30 - 2) / 20 * 1.15
    assert fast < slow / 2  # generous: the machine may be loaded by other jobs


@pytest.mark.root
def test_uid_selects_the_class(policy_mount) -> None:
    mnt = policy_mount.mountpoint / "free"
    slow = _timed_write(mnt / "user", 30 * MiB, user=4242)
    fast = _timed_write(mnt / "root", 30 * MiB)
    assert (30 - 2) / 20 * 0.85 <= slow <= (30 - 2) / 20 * 1.15
    assert fast < slow / 2  # generous: the machine may be loaded by other jobs
    assert (policy_mount.source / "free" / "user").stat().st_uid == 4242


def test_bad_policy_is_refused_before_mounting(tmp_tree: Path) -> None:
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir()
    mnt.mkdir()
    bad = tmp_tree / "bad.toml"
    bad.write_text('[classes.x]\npaths = ["a/**"]\nwrite_bandwidth = "-4MiB/s"\n')
    out = subprocess.run([sys.executable, "-m", "qosfs", "mount", "--policy", str(bad),
                          str(src), str(mnt)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 6
    assert out.stderr.startswith(f"qosfs: {bad}:3: classes.x.write_bandwidth: ")
    assert not os.path.ismount(mnt)


@pytest.mark.root
def test_a_job_pinned_by_cgroup_cannot_escape_by_setting_its_job_id(
        tmp_tree: Path, job_cgroup: Path) -> None:
    """job_env is advisory (the caller sets it); the cgroup its scheduler put it in is not."""
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir(mode=0o755)
    mnt.mkdir()
    os.chmod(src, 0o777)
    policy = tmp_tree / "policy.toml"
    policy.write_text(f'[classes.by-cgroup]\ncgroups = ["/{job_cgroup.parent.name}/job_771"]\n'
                      'write_bandwidth = "2MiB/s"\nburst = "1MiB"\n'
                      '[classes.by-env]\njob_env = "SLURM_JOB_ID"\njobs = ["772"]\n'
                      'write_bandwidth = "2MiB/s"\nburst = "1MiB"\n')

    def timed_dd(name: str, job_id: str, in_cgroup: bool) -> float:
        def enter() -> None:
            if in_cgroup:
                (job_cgroup / "cgroup.procs").write_text("0")
            as_user(4242)()

        start = time.monotonic()
        subprocess.run(["dd", "if=/dev/zero", f"of={mnt / name}", "bs=1M", "count=5",
                        "oflag=direct", "status=none"], check=True, preexec_fn=enter,
                       env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": job_id})
        return time.monotonic() - start

    with QosfsMount(src, mnt, "--policy", str(policy)):
        # In job 771's cgroup, claiming another job: still capped (4 MiB past the burst).
        assert timed_dd("pinned", "999", in_cgroup=True) > 1.5
        # Classified by the environment: the caller picks. As job 772 it is capped ...
        assert timed_dd("env-capped", "772", in_cgroup=False) > 1.5
        # ... and the same user escapes by claiming another job id (documented advisory).
        assert timed_dd("env-escaped", "999", in_cgroup=False) < 1.0


STREAMING_POLICY = """
[classes.ckpt]
paths = ["**/checkpoints/**"]
write_bandwidth = "16MiB/s"
burst = "2MiB"
detect_streaming_writes = "32MiB"

[classes.datasets]
paths = ["data/**"]
priority = "high"
"""


def _status(sock: Path) -> dict[str, Any]:
    from qosfs.control.ctl import Client

    with Client(str(sock)) as client:
        return client.request({"cmd": "status"})


def _stats(sock: Path) -> dict[str, Any]:
    from qosfs.control.ctl import Client

    with Client(str(sock)) as client:
        return client.request({"cmd": "stats"})


def _class_writes(status: dict[str, Any], name: str, level: str = "class") -> int:
    return int(next(lv for lv in status["levels"] if lv["level"] == level
                    and lv["name"] == name)["write_bytes"])


@pytest.mark.root
def test_a_stream_to_a_name_no_glob_knows_is_moved_and_capped(tmp_tree: Path) -> None:
    src, mnt, sock = tmp_tree / "src", tmp_tree / "mnt", tmp_tree / "ctl.sock"
    (src / "scratch" / "run7").mkdir(parents=True)
    mnt.mkdir()
    policy = tmp_tree / "policy.toml"
    policy.write_text(STREAMING_POLICY)
    with QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock)):
        start = time.monotonic()
        with open(mnt / "scratch" / "run7" / "state.blob", "wb", buffering=0) as f:
            for _ in range(96):
                f.write(b"s" * MiB)
        elapsed = time.monotonic() - start
        status = _status(sock)
        # 32 MiB went uncapped in default, then the open moved: 64 MiB at 16 MiB/s.
        assert status["streaming_moves"] == {"default": 1}
        assert _class_writes(status, "default") == 32 * MiB
        assert _class_writes(status, "ckpt") == 64 * MiB
        assert elapsed >= (64 - 2) / 16 * 0.85, elapsed
        # Random writes of the same size are not a stream: they stay where they are.
        with open(mnt / "scratch" / "run7" / "random.bin", "wb", buffering=0) as f:
            for i in range(48):
                f.seek(((i * 37) % 48) * MiB)
                f.write(b"r" * MiB)
        # A new open is classified afresh (the move lasts as long as the open).
        with open(mnt / "scratch" / "run7" / "state.blob", "r+b", buffering=0) as f:
            f.write(b"x" * MiB)
        status = _status(sock)
        assert status["streaming_moves"] == {"default": 1}
        assert _class_writes(status, "default") == (32 + 48 + 1) * MiB
    assert (src / "scratch" / "run7" / "state.blob").stat().st_size == 96 * MiB


@pytest.mark.root
def test_the_default_policy_moves_a_stream_before_300_mib(tmp_tree: Path) -> None:
    src, mnt, sock = tmp_tree / "src", tmp_tree / "mnt", tmp_tree / "ctl.sock"
    (src / "scratch" / "run7").mkdir(parents=True)
    mnt.mkdir()
    with QosfsMount(src, mnt, "--socket", str(sock)):
        with open(mnt / "scratch" / "run7" / "state.blob", "wb", buffering=0) as f:
            for _ in range(300):
                f.write(b"s" * MiB)
        status = _status(sock)
    assert status["streaming_moves"] == {"default": 1}
    assert _class_writes(status, "checkpoints") == (300 - 256) * MiB


@pytest.mark.root
def test_a_tenant_defined_by_its_cgroup_gets_its_cap(tmp_tree: Path, job_cgroup: Path) -> None:
    """A project (a Slurm job, a Kubernetes pod) as a tenant, which users cannot leave."""
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir(mode=0o755)
    mnt.mkdir()
    os.chmod(src, 0o777)
    policy = tmp_tree / "policy.toml"
    policy.write_text(f'[tenants.project-a]\ncgroups = ["/{job_cgroup.parent.name}/job_771"]\n'
                      'write_bandwidth = "2MiB/s"\nburst = "1MiB"\n')

    def timed_dd(name: str, in_cgroup: bool) -> float:
        def enter() -> None:
            if in_cgroup:
                (job_cgroup / "cgroup.procs").write_text("0")
            as_user(4242)()

        start = time.monotonic()
        subprocess.run(["dd", "if=/dev/zero", f"of={mnt / name}", "bs=1M", "count=5",
                        "oflag=direct", "status=none"], check=True, preexec_fn=enter)
        return time.monotonic() - start

    with QosfsMount(src, mnt, "--policy", str(policy)):
        assert timed_dd("member", in_cgroup=True) > 1.5  # 4 MiB past the burst at 2 MiB/s
        assert timed_dd("outsider", in_cgroup=False) < 1.0


def test_a_tenant_defined_by_an_environment_value_gets_its_cap(tmp_tree: Path) -> None:
    """A Kubernetes namespace or Run:ai project set in the pod's environment is a tenant;
    a class matching another variable (a job id) works in the same policy."""
    src, mnt, sock = tmp_tree / "src", tmp_tree / "mnt", tmp_tree / "ctl.sock"
    src.mkdir()
    mnt.mkdir()
    policy = tmp_tree / "policy.toml"
    policy.write_text('[tenants.team-a]\njob_env = "POD_NAMESPACE"\njobs = ["team-a*"]\n'
                      'write_bandwidth = "2MiB/s"\nburst = "1MiB"\n'
                      '[classes.hot-job]\njob_env = "SLURM_JOB_ID"\njobs = ["77"]\n')

    def timed_dd(name: str, **env: str) -> float:
        start = time.monotonic()
        subprocess.run(["dd", "if=/dev/zero", f"of={mnt / name}", "bs=1M", "count=5",
                        "oflag=direct", "status=none"], check=True,
                       env={"PATH": os.environ["PATH"], **env})
        return time.monotonic() - start

    with QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock)):
        assert timed_dd("member", POD_NAMESPACE="team-a-prod", SLURM_JOB_ID="77") > 1.5
        assert timed_dd("other-namespace", POD_NAMESPACE="team-b") < 1.0
        assert timed_dd("no-namespace") < 1.0
        status = _status(sock)
    assert _class_writes(status, "team-a", "tenant") == 5 * MiB
    assert _class_writes(status, "hot-job") == 5 * MiB  # the member's job id, read too
    assert _class_writes(status, "default") == 10 * MiB


@pytest.mark.parametrize("mode", ["ab", "r+b"])
def test_one_mib_python_writes_are_charged_one_write_op_each(tmp_tree: Path, mode: str) -> None:
    """A 1 MiB write from a buffer that does not start on a page reaches the daemon as two
    requests (1 MiB - offset, then offset bytes); a write_iops cap must see one write."""
    src, mnt, sock = tmp_tree / "src", tmp_tree / "mnt", tmp_tree / "ctl.sock"
    src.mkdir()
    mnt.mkdir()
    (src / "ckpt").write_bytes(b"")
    policy = tmp_tree / "policy.toml"
    policy.write_text('[classes.ckpt]\npaths = ["ckpt"]\nwrite_bandwidth = "64GiB/s"\n'
                      'write_iops = "100k"\n')
    chunk = bytearray(MiB + 4096)
    unaligned = memoryview(chunk)[48:48 + MiB]  # like a bytes object's data: 32-48 bytes in
    with QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock)):
        with open(mnt / "ckpt", mode, buffering=0) as f:
            for _ in range(512):
                assert f.write(unaligned) == MiB
        status = _status(sock)
        stats = _stats(sock)
    ckpt = next(lv for lv in status["levels"] if lv["name"] == "ckpt")
    assert (ckpt["write_bytes"], ckpt["write_ops"]) == (512 * MiB, 512)
    assert sum(a["write_ops"] for a in stats["accounts"] if a["class"] == "ckpt") == 512
    assert os.path.getsize(src / "ckpt") == 512 * MiB


def test_a_write_iops_cap_counts_callers_writes_not_kernel_splits(tmp_tree: Path) -> None:
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir()
    mnt.mkdir()
    policy = tmp_tree / "policy.toml"
    policy.write_text('[classes.ckpt]\npaths = ["ckpt"]\nwrite_iops = 40\nburst_iops = 1\n')
    unaligned = memoryview(bytearray(MiB + 4096))[48:48 + MiB]
    with QosfsMount(src, mnt, "--policy", str(policy)):  # noqa: SIM117
        with open(mnt / "ckpt", "wb", buffering=0) as f:
            start = time.monotonic()
            for _ in range(80):
                f.write(unaligned)
            took = time.monotonic() - start
    assert 1.5 < took < 3.0  # 80 writes at 40/s; split in two each, it took 4 s


@pytest.mark.root
@pytest.mark.parametrize("backend", ["", '[backend]\nwrite_bandwidth = "64GiB/s"\n'])
def test_a_file_renamed_to_a_checkpoint_name_while_open_is_capped_from_then_on(
        tmp_tree: Path, backend: str) -> None:
    src, mnt, sock = tmp_tree / "src", tmp_tree / "mnt", tmp_tree / "ctl.sock"
    src.mkdir()
    mnt.mkdir()
    policy = tmp_tree / "policy.toml"
    policy.write_text(backend + STREAMING_POLICY.replace('paths = ["**/checkpoints/**"]',
                                                         'paths = ["**/*.pt"]'))
    with QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock)):
        with open(mnt / "state.tmpfile", "wb", buffering=0) as f:
            start = time.monotonic()
            for _ in range(8):
                f.write(b"a" * MiB)
            assert time.monotonic() - start < 1.0  # default: not capped
            os.rename(mnt / "state.tmpfile", mnt / "state.pt")
            start = time.monotonic()
            for _ in range(8):
                f.write(b"b" * MiB)
            # ckpt is 16 MiB/s with a 2 MiB burst: the 8 MiB charged at the rename and
            # these 8 MiB, less the burst, take about 0.9 s.
            assert time.monotonic() - start >= (16 - 2) / 16 * 0.85
        status = _status(sock)
    assert status["rename_charged_bytes"] == {"ckpt": 8 * MiB}
    assert _class_writes(status, "ckpt") == 16 * MiB
    assert _class_writes(status, "default") == 0
    if backend:  # the storage did take all 16 MiB: the move between classes keeps them
        assert _class_writes(status, "backend", "backend") == 16 * MiB
