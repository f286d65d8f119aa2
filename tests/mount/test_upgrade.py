"""``qosfs upgrade``: a new daemon process takes a live qosfs mount over from the running
one (qosfs.daemon.takeover.offer, qosfs.daemon.takeover.upgrade), through real mounts, source ->
mountpoint and in place (the long runs in place only: how qosfs is deployed, and the
harder case).

- A reader streaming a 1 GiB file (pread, every chunk checked, the stream xxhash-checked)
  and a writer appending with fsync keep the SAME descriptors across HANDOVERS
  ``qosfs upgrade`` runs in a row: no error, the data intact, each successor reporting
  its version ($QOSFS_VERSION) and its handover count in ``ctl status``, the old one
  exiting 0. The longest call of either is reported, with the longest before any
  handover for scale.
- Kernel passthrough: an open the kernel reads itself keeps its backing id across
  handovers, and its release in a successor gives the id back.
- A cap goes on from where it stood: a writer of a capped class, in debt, writes no more
  across upgrades than the cap allows once (each successor starting from a full burst
  would have let a burst more through per upgrade).
- The control socket and the metrics listener travel: ``status`` and ``/metrics``,
  polled in a loop during LISTENER_UPGRADES upgrades, never fail (the longest wait
  for an answer is reported), and the metrics port stays the same; the traffic
  counters go on from where they stood (no counter reset).
- Refused halfway: a successor with another protocol (or the build before protocol 2's
  hello: a rollback), one that refuses, one that
  vanishes at prepare, and one that vanishes after it said ready (the old daemon has
  stopped reading by then, and takes its session back) all leave the old daemon serving
  the same descriptors; a real successor takes over afterwards. Each failure is
  counted by how it failed (``ctl status``, ``qosfs_handovers_total``), and the count
  goes on in the successor.
- ``qosfs mount`` on the live mount hands it over too, with the policy it names in force
  (another cap for a class; the open descriptors carry on); a malformed policy is
  refused with its file and line before anything happens, and another source is
  refused by the successor: the old daemon serves on in both cases.
- A policy changed by ``ctl set`` while the successor prepares (it takes 2 s:
  faultinject ``handover=slow-ready``) is the one in force in the successor.
- A latency-controlled cap survives: a storm the controller holds at its floor for a
  protected reader is still held there by the successor from its first request (a
  successor starting without the controller's caps let the storm run uncapped until
  its first decision, and then cut from that rate).
- A mount made with ``--socket PATH`` is found from its mountpoint alone: its pointer
  (qosfs.daemon.pointer) leads ``qosfs upgrade MNT``, ``qosfs mount`` run again and
  ``qosfs ctl --socket MNT`` to PATH; successors keep it, the unmount removes it; after a
  ``kill -9``, ``qosfs mount`` without ``--socket`` finds the keeper beside PATH and
  takes the mount over, an open descriptor reading on.
- From the build before handover protocol 2 (:data:`PREVIOUS_BUILD`, taken out of the
  repository; skipped without it): its daemon's mount is taken over by this build, a
  reader and a writer going on; that build's ``qosfs upgrade`` on this build's daemon (a
  rollback) is refused with the reason, and the daemon serves on.
- A successor that hangs after it said ready (tests/faultinject.py ``handover=hang``:
  it adopted the session and never says it serves) is killed by the old daemon within
  its commit timeout, which takes the session back and serves the same descriptors on;
  the longest stall of the load is that wait.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import xxhash

from qosfs.control.address import default_socket_path
from qosfs.control.ctl import Client
from qosfs.daemon.takeover import fuse_session, offer
from qosfs.qos.latency.decider import CLIMB
from tests.mount.held_reader import HeldReader
from tests.mount.listener_polls import ListenerPolls, get_metrics
from tests.mount.timed_load import TimedLoad
from tests.mounting import BOTH_LAYOUTS, ROOT, is_mounted, unmount
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root]

_reason = fuse_session.unavailable_reason()
if _reason is not None:
    pytest.skip(f"handover unavailable: {_reason}", allow_module_level=True)

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 256 * KiB
DATA = 32 * MiB
STREAM = 1 << 30  # the file the 20-upgrade reader streams (issue 31: 1 GiB)
_PATTERN = random.Random(31).randbytes(MiB)


def stream_bytes(offset: int, size: int) -> bytes:
    """stream.bin's content at *offset* (a multiple of CHUNK; *size* at most a MiB from
    there): 1 MiB of seeded random bytes, each MiB stamped with its index, so that a
    chunk read from the wrong place never matches."""
    index, within = divmod(offset, MiB)
    block = index.to_bytes(8, "little") + _PATTERN[8:]
    return block[within:within + size]
HANDOVERS = 20
LISTENER_UPGRADES = 10
CAP = 8 * MiB  # the capped class's write bandwidth per second, and its burst
POLICY = """
[classes.data]
paths = ["data/**"]
passthrough = "reads"
[classes.capped]
paths = ["capped/**"]
write_bandwidth = "8MiB/s"
burst = "8MiB"
[classes.default]
passthrough = "off"  # plain/: reads the daemon serves (and counts) across upgrades
"""


class Generation:
    """One daemon process of the mount (the first, or a successor), its log in a file."""

    def __init__(self, name: str, cmd: list[str], log_path: Path,
                 build: Path = ROOT) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        env = {**os.environ, "QOSFS_VERSION": name}
        if build != ROOT:  # another build's qosfs package (`previous_build`)
            env["PYTHONPATH"] = str(build)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=build, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout: float = 30.0) -> None:
        def serving() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}: "
                                     f"{self.log()}")
            return "qosfs serving" in self.log()

        wait_for(f"{self.name} to serve", serving, timeout=timeout, interval=0.01)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@dataclass
class Mount:
    """A qosfs mount whose daemon is replaced by ``qosfs upgrade`` runs."""

    source: Path
    mountpoint: Path
    run: Path  # the control socket's directory (the handover socket is beside it)
    args: tuple[str, ...] = ()
    generations: list[Generation] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.run / "qosfs.sock"

    @property
    def handover_socket(self) -> Path:
        return self.run / "qosfs.handover"

    @property
    def current(self) -> Generation:
        return self.generations[-1]

    def mount(self, build: Path = ROOT) -> Generation:
        """The first daemon, of *build* (another build's tree: `previous_build`)."""
        cmd = [sys.executable, "-m", "qosfs", "mount", "--foreground", str(self.source)]
        if self.mountpoint != self.source:
            cmd.append(str(self.mountpoint))
        cmd += ["--socket", str(self.socket), *self.args]
        return self._start("G0", cmd, build)

    def upgrade(self, socket: bool = True) -> Generation:
        """One ``qosfs upgrade`` (*socket*: told the mount's ``--socket``, else given the
        mountpoint alone): the successor serves, the old daemon exits 0."""
        old = self.current
        name = f"G{len(self.generations)}"
        told = ["--socket", str(self.socket)] if socket else []
        new = self._start(name, [sys.executable, "-m", "qosfs", "upgrade",
                                 str(self.mountpoint), *told, "--foreground"])
        assert old.proc.wait(timeout=30) == 0, old.log()
        assert "handed over" in old.log()
        return new

    def mount_again(self, *args: str, socket: bool = True) -> Generation:
        """``qosfs mount`` once more on the live mount, with *args* in place of the first
        mount's options (*socket*: and its ``--socket``): the successor serves, the old
        daemon exits 0."""
        old = self.current
        cmd = [sys.executable, "-m", "qosfs", "mount", "--foreground", str(self.source)]
        if self.mountpoint != self.source:
            cmd.append(str(self.mountpoint))
        told = ["--socket", str(self.socket)] if socket else []
        new = self._start(f"G{len(self.generations)}", [*cmd, *told, *args])
        assert old.proc.wait(timeout=30) == 0, old.log()
        assert "handed over" in old.log()
        return new

    def _start(self, name: str, cmd: list[str], build: Path = ROOT) -> Generation:
        g = Generation(name, cmd, self.run / f"{name}.log", build)
        self.generations.append(g)
        g.wait_serving()
        return g

    def metrics_port(self) -> int:
        """The port the current daemon serves /metrics on (--metrics 0: any free one)."""
        found = wait_for("the metrics address in the log", lambda: re.search(
            r"serving metrics on http://127\.0\.0\.1:(\d+)/", self.current.log()))
        assert found is not None
        return int(found[1])

    def status(self) -> dict[str, Any]:
        """``ctl status --json``'s reply, asked from this process (a ``qosfs ctl`` process
        per question costs 0.3 s or more of interpreter start-up)."""
        with Client(str(self.socket)) as client:
            reply = client.request({"cmd": "status"})
        assert reply["ok"], reply
        return reply

    def close(self) -> None:
        if is_mounted(self.mountpoint):
            if all(g.proc.poll() is not None for g in self.generations):
                abort_connection(self.mountpoint)  # nobody serves it: nothing may wait
            if not unmount(self.mountpoint, timeout=30):
                abort_connection(self.mountpoint)
                subprocess.run(["umount", "-l", str(self.mountpoint)], check=False)
        for g in self.generations:
            with contextlib.suppress(subprocess.TimeoutExpired):
                g.proc.wait(timeout=10)
            g.close()


def abort_connection(mountpoint: Path) -> None:
    """Abort the FUSE connection mounted on *mountpoint* (found in mountinfo: a stat of
    the mountpoint could wait for ever)."""
    target = str(mountpoint.resolve())
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if fields[4] == target:
                minor = fields[2].split(":")[1]
                Path(f"/sys/fs/fuse/connections/{minor}/abort").write_text("1")


@pytest.fixture(params=["separate", "in-place"])
def mount(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Mount]:
    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    (src / "capped").mkdir()
    (src / "plain").mkdir()
    (src / "plain" / "big.bin").write_bytes(os.urandom(DATA))
    if request.param.endswith("+stream"):  # issue 31's 1 GiB stream, made underneath
        with open(src / "plain" / "stream.bin", "wb") as f:
            for block in range(STREAM // MiB):
                f.write(stream_bytes(block * MiB, MiB))
    (src / "plain" / "log.bin").write_bytes(b"")
    mnt = src if request.param.startswith("in-place") else tmp_path / "mnt"
    mnt.mkdir(exist_ok=True)
    run = tmp_path / "run"
    run.mkdir()
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    # --cache never: every read of the daemon-served file reaches a daemon.
    m = Mount(src, mnt, run, ("--cache", "never", "--policy", str(policy), "--metrics", "0"))
    try:
        m.mount()
        yield m
    finally:
        m.close()


@pytest.fixture
def start_load(mount: Mount) -> Iterator[Callable[..., Load]]:
    """Starts the load on *mount*; halted before the mount is closed, whatever happened."""
    started: list[Load] = []

    def start(stream: bool = False) -> Load:
        if stream:
            name, length, expected = "stream.bin", STREAM, stream_bytes
        else:
            data = (mount.mountpoint / "plain" / "big.bin").read_bytes()
            name, length = "big.bin", len(data)

            def expected(offset: int, size: int) -> bytes:
                return data[offset:offset + size]
        load = Load(mount.mountpoint / "plain" / name,
                    mount.mountpoint / "plain" / "log.bin", expected, length).start()
        started.append(load)
        return load

    yield start
    for load in started:
        load.halt()


@dataclass
class Load(TimedLoad):
    """A reader streaming a large file through one descriptor (each chunk compared, the
    whole stream hashed) and a writer appending with fsync through another, in threads,
    recording every error and the longest call."""

    path_read: Path
    path_write: Path
    expected: Callable[[int, int], bytes]  # the file's content at (offset, size)
    length: int
    read_bytes: int = 0
    written: int = 0

    def start(self) -> Load:
        self.rfd = os.open(self.path_read, os.O_RDONLY)
        self.wfd = os.open(self.path_write, os.O_WRONLY | os.O_APPEND)
        self.read_hash = xxhash.xxh64()
        self.expected_hash = xxhash.xxh64()
        self.out = xxhash.xxh64()
        self._spawn(self._read, self._write)
        return self

    def _read(self) -> None:
        off = 0
        while not self._stop.is_set():
            data = self._timed(functools.partial(os.pread, self.rfd, CHUNK, off))
            if data is None:
                continue
            want = self.expected(off, CHUNK)
            if data != want:
                self.errors.append(f"read at {off}: {len(data)} bytes differ")
            self.read_hash.update(data)
            self.expected_hash.update(want)
            self.read_bytes += len(data)
            off = (off + CHUNK) % self.length

    def _write(self) -> None:
        i = 0
        while not self._stop.is_set():
            block = (b"%08d" % i) * (64 * KiB // 8)
            if self._timed(functools.partial(os.write, self.wfd, block)) == len(block):
                self.out.update(block)
                self.written += len(block)
                self._timed(functools.partial(os.fsync, self.wfd))
            i += 1

    def stop(self) -> None:
        """Stop the callers (a hung call fails the test) and close their descriptors."""
        self._join(30)
        self.halt()

    def check(self, written_file: Path) -> None:
        assert self.errors == []
        assert self.read_bytes > 0 and self.written > 0
        assert self.read_hash.hexdigest() == self.expected_hash.hexdigest()
        data = written_file.read_bytes()
        assert len(data) == self.written
        assert xxhash.xxh64(data).hexdigest() == self.out.hexdigest()


def load_crossed(load: Load) -> Callable[[], bool]:
    """Whether the reader and the writer have each completed two calls since this was
    made (after a handover: a call in flight then may have been the predecessor's, the
    next one is the successor's)."""
    read, written = load.read_bytes, load.written
    return lambda: load.read_bytes >= read + 2 * CHUNK and load.written >= written + 2 * 64 * KiB


# In place only: how the systemd unit and the DaemonSet mount, and the harder case (the
# source lies under the mount; the successor reaches it through descriptors only).
# Source -> mountpoint handovers are exercised by the other tests of this module.
@pytest.mark.parametrize("mount", ["in-place+stream"], indirect=True)
def test_reader_and_writer_keep_their_descriptors_across_upgrades(
        mount: Mount, start_load: Callable[..., Load],
        record_property: Callable[[str, object], None]) -> None:
    load = start_load(stream=True)
    time.sleep(1)  # the longest call without a handover, for scale
    baseline, load.worst = load.worst, 0.0
    load.worst_by.clear()
    before = mount.status()
    assert before["version"] == "G0" and before["handovers"] == 0
    took = []
    for n in range(1, HANDOVERS + 1):
        t0 = time.monotonic()
        new = mount.upgrade()
        took.append(time.monotonic() - t0)
        status = mount.status()
        assert (status["pid"], status["version"], status["handovers"]) == \
            (new.proc.pid, f"G{n}", n)
        assert status["file_handles"] >= 2  # the load's opens were taken over
        wait_for("the reader and the writer to go on", load_crossed(load))
    load.stop()
    load.check(mount.mountpoint / "plain" / "log.bin")
    assert is_mounted(mount.mountpoint)
    assert mount.status()["internal_errors"] == {}
    worst_ms = round(load.worst * 1000, 1)
    record_property("worst_call_ms", worst_ms)
    record_property("baseline_worst_call_ms", round(baseline * 1000, 1))
    stalls = [float(found[1]) for g in mount.generations[1:]
              for found in re.finditer(r"([\d.]+) ms without a reader of /dev/fuse", g.log())]
    assert len(stalls) == HANDOVERS
    print(f"{HANDOVERS} upgrades: read {load.read_bytes // MiB} MiB, appended "
          f"{load.written // KiB} KiB; nobody reading /dev/fuse {min(stalls):.1f}-"
          f"{max(stalls):.1f} ms (median {sorted(stalls)[len(stalls) // 2]:.1f}); "
          f"longest call {worst_ms} ms across them ("
          + ", ".join(f"{k} {v * 1000:.1f}" for k, v in sorted(load.worst_by.items()))
          + f"), {baseline * 1000:.1f} ms before; "
          f"upgrade command {min(took):.2f}-{max(took):.2f} s")


def _read_bytes_total(port: int) -> float:
    """qosfs_read_bytes_total summed over the mount's accounts."""
    text = get_metrics("127.0.0.1", port).decode()
    return sum(float(found[1]) for found in
               re.finditer(r"^qosfs_read_bytes_total\{.*\} (\S+)$", text, re.MULTILINE))


def test_ctl_and_metrics_answer_throughout_upgrades(mount: Mount) -> None:
    port = mount.metrics_port()
    (mount.mountpoint / "plain" / "big.bin").read_bytes()  # a counter to carry on
    counted = _read_bytes_total(port)
    assert counted >= DATA
    polls = ListenerPolls(str(mount.socket), ("127.0.0.1", port)).start()
    try:
        for _ in range(LISTENER_UPGRADES):
            time.sleep(0.2)
            mount.upgrade()
            assert mount.metrics_port() == port  # the same listener, not a new one
        time.sleep(0.2)
    finally:
        polls.stop()
    print(f"{LISTENER_UPGRADES} upgrades: ctl status {polls.control.summary()}; "
          f"/metrics {polls.metrics.summary()}")
    assert polls.control.failures == [] and polls.metrics.failures == []
    assert polls.control.polls >= LISTENER_UPGRADES and polls.metrics.polls >= 10
    assert _read_bytes_total(port) >= counted  # carried on: no counter reset


def test_a_passed_through_open_keeps_its_backing_id_across_upgrades(mount: Mount) -> None:
    if not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False):
        pytest.skip("pyfuse3 without kernel passthrough")
    (mount.mountpoint / "data" / "x.bin").write_bytes(b"x" * MiB)
    fd = os.open(mount.mountpoint / "data" / "x.bin", os.O_RDONLY)
    try:
        entry = mount.status()["passthrough"]
        if entry["state"] != "active":
            pytest.skip(f"kernel passthrough unavailable: {entry['reason']}")
        assert entry["live_backing_ids"] == 1
        for _ in range(3):
            mount.upgrade()
            assert mount.status()["passthrough"]["live_backing_ids"] == 1
            assert os.pread(fd, 4, MiB - 4) == b"xxxx"
            # The new daemon counts what the kernel reads for the open it inherited.
            assert len(os.pread(fd, 256 * 1024, 0)) == 256 * 1024
            counting = mount.status()["passthrough"]["read_counting"]
            if counting["state"] == "on":
                wait_for("the inherited open's reads counted", lambda: mount.status()[
                    "passthrough"]["read_counting"]["read_bytes"].get("data", 0),
                    until=lambda n: n >= 256 * 1024)
    finally:
        os.close(fd)
    wait_for("the backing id to be released", lambda: mount.status()["passthrough"],
             until=lambda p: p["live_backing_ids"] == 0)


def _kill_9_and_recover(mount: Mount, *extra: str) -> Generation:
    """Kill the serving daemon once the keeper holds the connection, start a new one with
    the mount's options (and *extra*), and check it recovered; the new generation."""
    wait_for("the keeper to hold the connection", mount.status,
             until=lambda status: status["crash_protection"]["kept"])
    dead = mount.current
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait(timeout=10)
    where = [str(mount.source)] + ([str(mount.mountpoint)]
                                   if mount.mountpoint != mount.source else [])
    new = mount._start(f"G{len(mount.generations)}", [
        sys.executable, "-m", "qosfs", "mount", "--foreground", *where, *extra, *mount.args])
    assert f"recovering after the death of pid {dead.proc.pid}" in new.log(), new.log()
    return new


@pytest.mark.parametrize("how", ["upgrade", "kill-9"])
def test_an_idle_backing_id_is_carried_over_and_let_go_at_unlink(
        mount: Mount, how: str) -> None:
    """A backing id kept idle after its file's last close goes to a successor, after a
    handover (its state) or a crash (the journal): the next open takes it back rather
    than registering the file again, and ``rm`` through the mount still frees the
    file's blocks at once. A successor that did not know the id would leave the file
    pinned in the kernel until the unmount."""
    if not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False):
        pytest.skip("pyfuse3 without kernel passthrough")
    size = 32 * MiB
    data = os.urandom(size)
    (mount.mountpoint / "data" / "idle.bin").write_bytes(data)
    path = mount.mountpoint / "data" / "idle.bin"
    assert path.read_bytes() == data
    entry = mount.status()["passthrough"]
    if entry["state"] != "active":
        pytest.skip(f"kernel passthrough unavailable: {entry['reason']}")
    assert (entry["live_backing_ids"], entry["idle_backing_ids"]) == (0, 1)
    if how == "upgrade":
        mount.upgrade()
    else:
        _kill_9_and_recover(mount)
    entry = mount.status()["passthrough"]
    assert (entry["live_backing_ids"], entry["idle_backing_ids"]) == (0, 1)
    reused, registered = entry["reused_backing_ids"], entry["registered"]
    assert path.read_bytes() == data
    entry = mount.status()["passthrough"]
    assert entry["reused_backing_ids"] == reused + 1 and entry["registered"] == registered
    os.sync()
    st = os.statvfs(mount.source)
    before = st.f_bfree * st.f_frsize
    path.unlink()

    def freed() -> bool:
        os.sync()
        st = os.statvfs(mount.source)
        return st.f_bfree * st.f_frsize - before >= size * 0.9

    wait_for("the blocks freed", freed, timeout=20, interval=0.2)
    assert mount.status()["passthrough"]["idle_backing_ids"] == 0


@pytest.mark.parametrize("how", ["upgrade", "kill-9"])
def test_an_open_made_without_a_descriptor_reads_on_across_a_takeover(
        mount: Mount, how: str) -> None:
    """A reopen of a file whose backing id is idle takes the id and no descriptor of
    the daemon's. Held across a handover or a crash, it reads on, counted by the new
    daemon; an fsync and an fchmod of it reach the file; its release leaves the id
    idle, and nothing leaks."""
    if not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False):
        pytest.skip("pyfuse3 without kernel passthrough")
    data = os.urandom(4 * MiB + 5)
    path = mount.mountpoint / "data" / "lazy.bin"
    path.write_bytes(data)
    assert path.read_bytes() == data  # registers the id, idle after the close
    entry = mount.status()["passthrough"]
    if entry["state"] != "active":
        pytest.skip(f"kernel passthrough unavailable: {entry['reason']}")
    daemon = mount.current.proc.pid
    before = len(os.listdir(f"/proc/{daemon}/fd"))
    held = [os.open(path, os.O_RDONLY) for _ in range(20)]
    try:
        # None opened for them (20 before; a control connection may come and go).
        assert len(os.listdir(f"/proc/{daemon}/fd")) <= before + 2
        entry = mount.status()["passthrough"]
        assert entry["live_backing_ids"] == 1 and entry["registered"] == 1
        if how == "upgrade":
            mount.upgrade()
        else:
            _kill_9_and_recover(mount)
        registered = mount.status()["passthrough"]["registered"]
        counting = mount.status()["passthrough"]["read_counting"]
        counted = counting["read_bytes"].get("data", 0)
        for i, fd in enumerate(held):
            offset = i * 4096 * 51
            assert os.pread(fd, 8192, offset) == data[offset:offset + 8192]
        if counting["state"] == "on":
            # The successor counts the kernel's reads for the opens it inherited: its
            # credentials hold its predecessor's session keyring (qosfs.core.keyring).
            wait_for("the inherited opens' reads counted", lambda: mount.status()[
                "passthrough"]["read_counting"]["read_bytes"].get("data", 0) - counted,
                until=lambda n: n == 20 * 8192, timeout=10)
        os.fsync(held[0])
        os.fchmod(held[1], 0o640)
        assert stat.S_IMODE(os.stat(mount.source / "data" / "lazy.bin").st_mode) == 0o640
    finally:
        for fd in held:
            os.close(fd)

    def idle_again() -> bool:
        entry = mount.status()["passthrough"]
        return (entry["live_backing_ids"], entry["idle_backing_ids"]) == (0, 1)

    wait_for("every release answered", idle_again, timeout=20, interval=0.05)
    assert path.read_bytes() == data
    assert mount.status()["passthrough"]["registered"] == registered  # the id taken back


def _data_written(mount: Mount) -> int:
    level = next(lv for lv in mount.status()["levels"]
                 if lv["level"] == "class" and lv["name"] == "data")
    return int(level["write_bytes"])


@pytest.mark.parametrize("how", ["upgrade", "kill-9"])
def test_a_joined_open_is_served_and_keeps_its_share_across_a_takeover(
        mount: Mount, how: str) -> None:
    """A writer that joined a passed-through inode with direct_io comes back the same
    after a handover or a crash recovery: still served by the (new) daemon, still
    holding its share of the backing id, which the last release gives back."""
    if not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False):
        pytest.skip("pyfuse3 without kernel passthrough")
    path = mount.mountpoint / "data" / "j.bin"
    path.write_bytes(b"j" * MiB)
    reader = os.open(path, os.O_RDONLY)
    writer = os.open(path, os.O_WRONLY)
    try:
        entry = mount.status()["passthrough"]
        if entry["state"] != "active":
            pytest.skip(f"kernel passthrough unavailable: {entry['reason']}")
        assert entry["served_write_joins"] == {"data": 1}
        if how == "upgrade":
            mount.upgrade()
        else:
            _kill_9_and_recover(mount, "--socket", str(mount.socket))
        assert mount.status()["passthrough"]["live_backing_ids"] == 1
        written = _data_written(mount)
        assert os.pwrite(writer, b"y" * 4096, 0) == 4096  # reaches the new daemon
        assert _data_written(mount) == written + 4096
        assert os.pread(reader, 8, 4092) == b"yyyyjjjj"  # the kernel reads on
        os.close(reader)
        reader = -1
        assert mount.status()["passthrough"]["live_backing_ids"] == 1  # the writer's share
    finally:
        for fd in (reader, writer):
            if fd >= 0:
                os.close(fd)
    wait_for("the backing id to be released", lambda: mount.status()["passthrough"],
             until=lambda p: p["live_backing_ids"] == 0)


# The balances travel the same way whatever the topology: one of them suffices.
@pytest.mark.parametrize("mount", ["in-place"], indirect=True)
def test_a_cap_goes_on_from_where_it_stood_across_upgrades(mount: Mount) -> None:
    upgrades = 4
    written = 0
    done = threading.Event()
    errors: list[OSError] = []

    def write() -> None:
        nonlocal written
        block = b"c" * MiB
        fd = os.open(mount.mountpoint / "capped" / "f.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while not done.is_set():
                written += os.write(fd, block)
        except OSError as exc:
            errors.append(exc)
        finally:
            os.close(fd)

    writer = threading.Thread(target=write, daemon=True)
    t0 = time.monotonic()
    writer.start()
    for _ in range(upgrades):
        time.sleep(1.0)
        mount.upgrade()
    time.sleep(1.0)
    done.set()
    writer.join(timeout=30)
    elapsed = time.monotonic() - t0
    assert not writer.is_alive() and errors == []
    allowed = CAP * elapsed + CAP + 2 * MiB  # the rate, one burst, the writes in flight
    print(f"capped writer: {written / MiB:.0f} MiB in {elapsed:.1f} s across {upgrades} "
          f"upgrades; the cap allows {allowed / MiB:.0f} MiB, a fresh burst per upgrade "
          f"{(allowed + upgrades * CAP) / MiB:.0f}")
    assert written <= allowed
    assert written >= CAP * (elapsed - 1.5)  # and it was not held back either
    assert "bucket balances carried over" in mount.current.log()


@pytest.mark.parametrize("mode", ["wrong-protocol", "previous-build", "refuse",
                                  "vanish-at-prepare", "vanish-after-ready"])
def test_a_refused_upgrade_leaves_the_old_daemon_serving(
        mount: Mount, start_load: Callable[[], Load], mode: str) -> None:
    load = start_load()
    old = mount.current
    peer = subprocess.run([sys.executable, "-m", "tests.mount.upgrade_peer",
                           str(mount.handover_socket), mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    # One that vanishes after ready may be killed by the old daemon before it is gone.
    assert peer.returncode in ((0, -signal.SIGKILL) if mode == "vanish-after-ready"
                               else (0,)), peer.stderr
    answered = "refused" if mode in ("wrong-protocol", "previous-build") else "prepare"
    assert peer.stdout.split()[0] == answered
    if mode == "previous-build":  # a rollback across a live handover: told why
        assert "protocol 1 only" in peer.stdout and "unmount" in peer.stdout
    time.sleep(0.5)
    assert old.proc.poll() is None, old.log()
    status = mount.status()  # the control socket answers: rebound if it was let go
    assert (status["pid"], status["handovers"]) == (old.proc.pid, 0)
    failed = "taken_back" if mode == "vanish-after-ready" else "refused"
    if mode == "vanish-after-ready":
        assert "taking the session back" in old.log()
    else:
        assert "refused, serving on" in old.log()
    assert status["handover_failures"] == {"refused": 0, "taken_back": 0, failed: 1}
    new = mount.upgrade()  # and a real successor still takes over
    status = mount.status()
    assert status["pid"] == new.proc.pid
    assert status["handover_failures"][failed] == 1  # carried on: the alert still sees it
    load.stop()
    load.check(mount.mountpoint / "plain" / "log.bin")


#: The build administrators upgrade from: the last before handover protocol 2 (the open
#: files as OpenRecords, issue 39), which sends protocol 1.
PREVIOUS_BUILD = "b31953a"


@pytest.fixture
def previous_build(tmp_path: Path) -> Path:
    """The qosfs package of :data:`PREVIOUS_BUILD`, taken out of this repository (it runs
    on this environment's pyfuse3); the test is skipped without git or the commit."""
    if shutil.which("git") is None:
        pytest.skip("git is needed to take the previous build out of the repository")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", PREVIOUS_BUILD, "qosfs"],
                             capture_output=True, timeout=60)
    if archive.returncode != 0:
        pytest.skip(f"the previous build {PREVIOUS_BUILD} is not in this repository: "
                    f"{archive.stderr.decode(errors='replace').strip()}")
    tree = tmp_path / "previous"
    tree.mkdir()
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True,
                   timeout=60)
    return tree


@BOTH_LAYOUTS
def test_an_upgrade_from_the_previous_build_carries_the_opens_on_and_no_rollback(
        tmp_path: Path, previous_build: Path, in_place: bool) -> None:
    """``qosfs upgrade`` from the build before protocol 2 works (this build's successor
    takes protocol 1 over): a reader and a writer go on through the same descriptors, the
    data intact. The way back, that build's ``qosfs upgrade`` on this build's daemon, is
    refused at the hello with the reason: this daemon serves on, the refusal counted."""
    src, run = tmp_path / "src", tmp_path / "run"
    mnt = src if in_place else tmp_path / "mnt"
    (src / "plain").mkdir(parents=True)
    for made in (mnt, run):
        made.mkdir(exist_ok=True)
    data = os.urandom(4 * MiB)
    (src / "plain" / "big.bin").write_bytes(data)
    (src / "plain" / "log.bin").write_bytes(b"")
    # --keeper none: a keeper process would import this tree's qosfs, not that build's.
    m = Mount(src, mnt, run, ("--cache", "never", "--keeper", "none"))
    load = None
    try:
        old = m.mount(previous_build)
        assert "qosfs.daemon.mount" in old.log()  # that build's module, gone from this one
        load = Load(mnt / "plain" / "big.bin", mnt / "plain" / "log.bin",
                    lambda off, size: data[off:off + size], len(data)).start()
        wait_for("the load to run", load_crossed(load))
        new = m.upgrade()
        status = m.status()
        assert (status["pid"], status["handovers"]) == (new.proc.pid, 1)
        assert status["file_handles"] >= 2
        assert "handover protocol 1," in new.log()
        wait_for("the reader and the writer to go on", load_crossed(load))

        back = subprocess.run(
            [sys.executable, "-m", "qosfs", "upgrade", str(mnt), "--socket", str(m.socket),
             "--foreground"], cwd=previous_build, capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": str(previous_build)}, timeout=60)
        assert back.returncode == 8, back.stderr  # EXIT_DAEMON
        assert "speaks handover protocol 1 only" in back.stderr, back.stderr
        assert "unmount, then mount" in back.stderr
        status = m.status()
        assert (status["pid"], status["handovers"]) == (new.proc.pid, 1)
        assert status["handover_failures"] == {"refused": 1, "taken_back": 0}
        assert new.proc.poll() is None and "refused, serving on" in new.log()
        wait_for("the reader and the writer to go on", load_crossed(load))
        load.stop()
        load.check(mnt / "plain" / "log.bin")
    finally:
        if load is not None:
            load.halt()
        m.close()


def test_a_successor_that_hangs_after_ready_is_killed_and_the_old_daemon_serves_on(
        mount: Mount, start_load: Callable[[], Load]) -> None:
    load = start_load()
    time.sleep(0.5)
    load.worst = 0.0
    old = mount.current
    hung = Generation("hung", [sys.executable, "tests/faultinject.py", "--fault",
                               "handover=hang", "--", "upgrade", str(mount.mountpoint),
                               "--socket", str(mount.socket), "--foreground"],
                      mount.run / "hung.log")
    try:
        returned = hung.proc.wait(timeout=offer.COMMIT_TIMEOUT + 60)
    finally:
        hung.close()
    assert returned == -signal.SIGKILL, hung.log()  # killed by the old daemon's pidfd
    assert "did not take" in old.log()  # its commit timeout, not another failure
    wait_for("the old daemon to serve again", old.log,
             until=lambda text: "serving" in text.rsplit("taking the session back", 1)[-1])
    assert old.proc.poll() is None, old.log()
    status = mount.status()
    assert (status["pid"], status["handovers"]) == (old.proc.pid, 0)
    assert status["handover_failures"] == {"refused": 0, "taken_back": 1}
    stalled = load.worst
    new = mount.upgrade()  # a real successor takes over, and carries the count on
    assert mount.status()["handover_failures"]["taken_back"] == 1
    scraped = get_metrics("127.0.0.1", mount.metrics_port()).decode()
    assert re.search(r'^qosfs_handovers_total\{[^}]*result="taken_back"[^}]*\} 1\.0$',
                     scraped, re.MULTILINE), scraped
    assert mount.status()["pid"] == new.proc.pid
    load.stop()
    load.check(mount.mountpoint / "plain" / "log.bin")
    print(f"a hung successor: the load stalled {stalled * 1000:.0f} ms at most "
          f"(commit timeout {offer.COMMIT_TIMEOUT:g} s plus the table's allowance)")
    assert offer.COMMIT_TIMEOUT * 0.9 <= stalled <= offer.COMMIT_TIMEOUT + 5


LATENCY_POLICY = """
[classes.reader]
paths = ["reader/**"]
priority = "high"
target_read_latency = "200us"
[classes.storm]
paths = ["storm/**"]
priority = "low"
"""


@BOTH_LAYOUTS
def test_a_latency_controlled_cap_survives_an_upgrade(tmp_path: Path, in_place: bool) -> None:
    src, run = tmp_path / "src", tmp_path / "run"
    mnt = src if in_place else tmp_path / "mnt"
    for d in (src / "reader", src / "storm", mnt, run):
        d.mkdir(parents=True, exist_ok=True)
    (src / "reader" / "shard").write_bytes(os.urandom(MiB))
    (tmp_path / "policy.toml").write_text(LATENCY_POLICY)
    # A target no read can meet: the storm is cut down to the controller's floor.
    m = Mount(src, mnt, run, ("--cache", "never", "--policy", str(tmp_path / "policy.toml")))
    stop = threading.Event()
    written = [0]

    def storm() -> None:
        chunk = b"s" * MiB
        fd = os.open(mnt / "storm" / "state", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while not stop.is_set():
                written[0] += os.pwrite(fd, chunk, (written[0] // MiB % 32) * MiB)
        finally:
            os.close(fd)

    def reader() -> None:
        with open(mnt / "reader" / "shard", "rb", buffering=0) as f:
            while not stop.is_set():
                f.seek(0)
                f.read(4096)
                time.sleep(0.005)

    threads = [threading.Thread(target=t, daemon=True) for t in (storm, reader)]
    try:
        m.mount()
        for t in threads:
            t.start()

        def storm_cap() -> float | None:
            for t in m.status()["latency_control"]["throttled"]:
                if t["class"] == "storm":
                    cap: float | None = t["write_bandwidth"]
                    return cap
            return None

        floor = wait_for("the storm to be cut to the floor", storm_cap,
                         until=lambda cap: cap is not None and cap <= 2 * MiB,
                         timeout=30, interval=0.1)
        assert floor is not None
        held = storm_cap()  # the cap in force just before (it saws around the floor)
        before, t0 = written[0], time.monotonic()
        m.upgrade()
        carried = storm_cap()  # the successor's, a window or two after the old one's
        time.sleep(1.0)
        moved, took = written[0] - before, time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        m.close()
    print(f"storm held at {floor / MiB:.2f} MiB/s before the upgrade, "
          f"{(carried or 0) / MiB:.2f} MiB/s in the successor; it wrote "
          f"{moved / MiB:.1f} MiB in the {took:.1f} s of the upgrade and the second after")
    # At the caps in force, plus the bucket's burst and a write in flight; uncapped it
    # moves hundreds of MiB in a second.
    assert moved <= max(floor, held or 0, carried or 0) * took + 4 * MiB
    # Carried on, not reset: a fresh controller has no cap on the storm (None) and its
    # first cut is a quarter of the storm's rate, tens of MiB/s. The carried cap is the old
    # daemon's last one, and that need not be the floor: a window in which the reader made
    # no request is an idle one, and the cap doubles (seen once in 6 runs: 1.0 -> 1.3 ->
    # 2.5 MiB/s while the successor started; its first window cut it back to 1.0). Allow
    # two doublings and a climb over what was seen.
    assert carried is not None and carried <= max(floor, held or 0) * 4 * (1 + CLIMB), \
        (floor, held, carried)
    assert "latency control carried over (1 classes capped automatically)" in \
        m.current.log()


def _class_limits(status: dict[str, Any], name: str) -> dict[str, float]:
    (level,) = [lv for lv in status["levels"]
                if lv["level"] == "class" and lv["name"] == name]
    limits: dict[str, float] = level["limits"]
    return limits


def _qosfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qosfs", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_qosfs_mount_on_the_live_mount_hands_it_over_with_the_policy_it_names(
        mount: Mount, start_load: Callable[[], Load], tmp_path: Path) -> None:
    load = start_load()
    assert _class_limits(mount.status(), "capped")["write_bandwidth"] == CAP
    changed = tmp_path / "changed.toml"
    changed.write_text(POLICY.replace('write_bandwidth = "8MiB/s"',
                                      'write_bandwidth = "4MiB/s"'))
    new = mount.mount_again("--cache", "never", "--metrics", "0", "--policy", str(changed))
    status = mount.status()
    assert (status["pid"], status["handovers"]) == (new.proc.pid, 1)
    assert status["policy_source"] == str(changed)
    assert _class_limits(status, "capped")["write_bandwidth"] == CAP // 2
    assert "differs from the running mount" not in new.log()  # the same options
    assert "policy generation 2 in force" in new.log()  # swapped in, as a reload
    again = mount.mount_again()  # no --policy: the policy in force carries on
    status = mount.status()
    assert (status["pid"], status["handovers"]) == (again.proc.pid, 2)
    assert status["policy_source"] == str(changed)
    assert re.search(r"fs_options=.*cache='auto'.* differs from the running mount's "
                     r".*cache='never'", again.log())  # said, and the mount's kept
    load.stop()
    load.check(mount.mountpoint / "plain" / "log.bin")


def test_qosfs_mount_on_the_live_mount_refuses_a_bad_policy_or_another_source(
        mount: Mount, start_load: Callable[[], Load], tmp_path: Path) -> None:
    load = start_load()
    old = mount.current
    where = [str(mount.source)] + ([str(mount.mountpoint)]
                                   if mount.mountpoint != mount.source else [])
    bad = tmp_path / "bad.toml"
    bad.write_text(POLICY.replace('burst = "8MiB"', 'burst = "eight"'))
    refused = _qosfs("mount", "--foreground", *where, "--socket", str(mount.socket),
                     "--policy", str(bad))
    assert refused.returncode == 6, refused.stderr
    assert refused.stderr.startswith(f"qosfs: {bad}:8:"), refused.stderr  # file:line
    other = tmp_path / "other"
    other.mkdir()
    elsewhere = _qosfs("mount", "--foreground", str(other), str(mount.mountpoint),
                       "--socket", str(mount.socket))
    assert elsewhere.returncode != 0
    assert f"is a mount of {mount.source}, not of {other}" in elsewhere.stderr
    status = mount.status()
    assert old.proc.poll() is None and status["pid"] == old.proc.pid
    assert status["policy_source"] == str(tmp_path / "policy.toml")
    assert status["handover_failures"] == {"refused": 1, "taken_back": 0}  # the source
    load.stop()
    load.check(mount.mountpoint / "plain" / "log.bin")


def test_a_policy_changed_while_the_successor_prepares_is_in_force_in_it(
        mount: Mount) -> None:
    old = mount.current
    slow = Generation("G1", [sys.executable, "tests/faultinject.py", "--fault",
                             "handover=slow-ready", "--", "upgrade", str(mount.mountpoint),
                             "--socket", str(mount.socket), "--foreground"],
                      mount.run / "G1.log")
    mount.generations.append(slow)
    wait_for("the successor to prepare", slow.log,
             until=lambda text: "taking" in text and "over from pid" in text)
    changed = subprocess.run([sys.executable, "-m", "qosfs", "ctl", "--socket",
                              str(mount.socket), "set", "capped", "write_bandwidth=2MiB/s"],
                             cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert changed.returncode == 0, changed.stderr
    slow.wait_serving()
    assert old.proc.wait(timeout=30) == 0, old.log()
    status = mount.status()
    assert status["pid"] == slow.proc.pid and status["handover_failures"]["taken_back"] == 0
    assert _class_limits(status, "capped")["write_bandwidth"] == 2 * MiB


def test_a_mount_made_with_socket_is_found_from_its_mountpoint_alone(mount: Mount) -> None:
    derived = default_socket_path(str(mount.mountpoint))
    assert os.readlink(derived) == str(mount.socket)  # the pointer
    upgraded = mount.upgrade(socket=False)
    assert os.readlink(derived) == str(mount.socket)  # kept by the successor
    asked = _qosfs("ctl", "--socket", str(mount.mountpoint), "status", "--json")
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["pid"] == upgraded.proc.pid
    again = mount.mount_again(*mount.args, socket=False)
    assert "differs from the running mount" not in again.log()  # its --socket included
    status = mount.status()
    assert (status["pid"], status["handovers"]) == (again.proc.pid, 2)
    assert unmount(mount.mountpoint)
    assert again.proc.wait(timeout=30) == 0, again.log()
    assert not os.path.lexists(derived) and not mount.socket.exists()


def test_a_mount_made_with_socket_is_taken_over_after_kill_9_from_its_mountpoint_alone(
        mount: Mount) -> None:
    expected = xxhash.xxh3_128((mount.source / "plain" / "big.bin").read_bytes()).hexdigest()
    reader = HeldReader(mount.mountpoint / "plain" / "big.bin")
    try:
        # The first mount's options but --socket: `qosfs mount` as a supervisor runs it.
        new = _kill_9_and_recover(mount)
        # --cache never: the second half is read by the new daemon, on the same descriptor.
        assert reader.finish() == {"digest": expected}
        assert mount.status()["pid"] == new.proc.pid  # it serves the mount's own socket
        assert os.readlink(default_socket_path(str(mount.mountpoint))) == str(mount.socket)
    finally:
        reader.close(mount.mountpoint)
