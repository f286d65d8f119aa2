"""Shared fixtures: real mounts over temporary directories, always torn down."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounting import QosfsMount, is_mounted, mounted_under, reachable_tmpdir
from tests.redis_server import RedisServer

HAVE_FUSE = os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None
IS_ROOT = os.geteuid() == 0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("mount") and not HAVE_FUSE:
            item.add_marker(pytest.mark.skip(reason="needs /dev/fuse and fusermount3"))
        if item.get_closest_marker("root") and not IS_ROOT:
            item.add_marker(pytest.mark.skip(reason="needs root"))


@pytest.fixture(autouse=True)
def _no_unexpected_warnings(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A test fails if code in this process logged a WARNING or ERROR it did not expect."""
    yield
    bad = [r for r in caplog.get_records("call") if r.levelno >= logging.WARNING
           and not getattr(r, "expected", False)]
    assert not bad, f"unexpected log records: {[r.getMessage() for r in bad]}"


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    if report.failed:
        item.stash[_FAILED] = True
    return report


@pytest.fixture
def tmp_tree(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A directory for sources and mountpoints that other users can reach (for uid tests;
    :func:`tests.mounting.reachable_tmpdir` says why it is not under ``tmp_path``).
    Removed after the test, unless it failed (kept for the daemon logs, as ``tmp_path``
    would be) or something is still mounted under it."""
    path = reachable_tmpdir(request.node.name)
    yield path
    if not mounted_under(path) and not request.node.stash.get(_FAILED, False):
        shutil.rmtree(path)


@pytest.fixture
def qmount(tmp_tree: Path) -> Iterator[QosfsMount]:
    """qosfs mounted from tmp/src on tmp/mnt."""
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir(mode=0o755)
    mnt.mkdir()
    os.chmod(src, 0o755)
    m = QosfsMount(src, mnt)
    m.start()
    try:
        yield m
    finally:
        code = m.stop()
        assert code == 0, f"daemon exited with {code}: {m.log()}"
        assert "Traceback" not in m.log(), m.log()


@pytest.fixture
def inplace_mount(tmp_tree: Path) -> Iterator[tuple[QosfsMount, Path]]:
    """qosfs mounted in place over tmp/src; the backing tree stays visible at tmp/view
    through a bind mount taken before (root only)."""
    src, view = tmp_tree / "src", tmp_tree / "view"
    src.mkdir(mode=0o755)
    view.mkdir()
    os.chmod(src, 0o755)
    subprocess.run(["mount", "--bind", str(src), str(view)], check=True)
    m = QosfsMount(src, src, log_path=tmp_tree / "inplace.log")
    try:
        m.start()
        yield m, view
    finally:
        code = m.stop()
        subprocess.run(["umount", str(view)], check=False)
        assert not is_mounted(src) and not is_mounted(view)
        assert code == 0, m.log()


# Cgroups a test may make (root): the v2 hierarchy (unified, on a hybrid host), and v1's
# memory controller.
CGROUP2 = Path("/sys/fs/cgroup/unified") if Path("/sys/fs/cgroup/unified/cgroup.procs").exists() \
    else Path("/sys/fs/cgroup")


V1_MEMORY = Path("/sys/fs/cgroup/memory")


@pytest.fixture(params=["v2", "v1"])
def job_cgroup(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A cgroup "/qosfs-test-PID/job_771", as a scheduler would make for job 771: in the
    v2 hierarchy, or in a v1 controller's (Slurm's cgroup/v1 plugin; hybrid hosts)."""
    root = CGROUP2 if request.param == "v2" else V1_MEMORY
    if not (root / "cgroup.procs").exists():
        pytest.skip(f"no writable cgroup {request.param} hierarchy")
    top = root / f"qosfs-test-{os.getpid()}"
    job = top / "job_771"
    try:
        job.mkdir(parents=True)
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup: {exc}")
    try:
        yield job
    finally:
        for cg in (job, top):
            for _ in range(50):  # a cgroup can be removed once its processes are reaped
                try:
                    cg.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of its own on a Unix socket, killed (by PID) when the test ends."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()
