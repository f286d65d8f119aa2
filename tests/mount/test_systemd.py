"""systemd/qosfs@.service as systemd would run it: sd_notify, reload, stop, crash restart.

systemd is not PID 1 in the test container, so the tests do what it would: parse the
unit, expand its specifiers and variables for an instance whose mountpoint is a temporary
directory (with /etc and /run moved there too), give the daemon ``$NOTIFY_SOCKET`` (a
datagram socket the test reads) and a stderr named by ``$JOURNAL_STREAM``, and run
ExecStart, ExecReload and the stop signal. The unit's binary, /usr/local/bin/qosfs, is the
launcher ``make install`` writes (``python -P -m qosfs``); here the worktree's
``python -m qosfs`` stands in for it.
"""

from __future__ import annotations

import errno
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import xxhash

from qosfs.control.address import default_socket_path
from qosfs.control.ctl import Client
from qosfs.core.mountinfo import mount_type
from qosfs.daemon import preflight, serve
from tests.mount import posix_scenarios
from tests.mount.test_fidelity import SCENARIOS, TEST_GID, TEST_UID, _run_as_user
from tests.mounting import ROOT, as_user, is_mounted
from tests.systemd_units import (
    UNIT,
    command,
    environment,
    escape_path,
    parse_unit,
    specifiers,
)
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root]

LAUNCHER = "/usr/local/bin/qosfs"
QOSFS = [sys.executable, "-m", "qosfs"]
SAMPLE = ROOT / "systemd" / "mnt-mlfs.toml"
MiB = 1 << 20


class Notifications:
    """The receiving end of ``$NOTIFY_SOCKET``, in the abstract namespace like systemd's
    own tests do (no path length limit, nothing to clean up)."""

    def __init__(self) -> None:
        self.address = f"@qosfs-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind("\0" + self.address[1:])
        self.stored: list[str] = []  # names of descriptors sent to the store

    def ready(self, timeout: float = 0.0) -> bool:
        return bool(select.select([self.sock], [], [], timeout)[0])

    def next(self, timeout: float = 20.0) -> str:
        """The next state notification. Descriptors sent to the store (FDSTORE=1, the
        crash keeper's) are noted by name in ``stored`` and dropped, and so are their
        removals: this stand-in does not pass them to a restart
        (tests/mount/test_systemd_box.py shows systemd does)."""
        while True:
            assert self.ready(timeout), f"no notification within {timeout} s"
            message = self.sock.recv(4096).decode()  # descriptors sent along are closed
            if not message.startswith(("FDSTORE=1", "FDSTOREREMOVE=1")):
                return message
            self.stored.append(message.split("FDNAME=", 1)[-1])

    def assert_empty(self) -> None:
        while self.ready():
            message = self.sock.recv(4096)
            assert message.startswith((b"FDSTORE=1", b"FDSTOREREMOVE=1")), \
                f"unexpected notification {message!r}"

    def close(self) -> None:
        self.sock.close()


class Instance:
    """qosfs@<escaped tmp/mlfs>.service: in place over a temporary directory."""

    def __init__(self, tmp: Path) -> None:
        self.mnt = tmp / "mlfs"
        self.mnt.mkdir(mode=0o755)
        self.name = escape_path(str(self.mnt))
        self.etc, self.run_dir = tmp / "etc", tmp / "run"
        (self.etc / "qosfs").mkdir(parents=True)
        self.run_dir.mkdir()
        self.policy = self.etc / "qosfs" / f"{self.name}.toml"
        self.policy.write_text(SAMPLE.read_text())  # the sample works as shipped
        # Port 0: any free port; the daemon logs the one it got.
        (self.etc / "qosfs" / f"{self.name}.env").write_text("QOSFS_METRICS=127.0.0.1:0\n")
        self.unit = parse_unit(UNIT)
        self.spec = specifiers(self.name, etc=self.etc, run=self.run_dir)
        self.notify = Notifications()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.successors: list[int] = []  # daemons `qosfs upgrade` started, not children
        self.logs: list[Path] = []

    def argv(self, key: str, step: int | None = None) -> list[str]:
        """The command of *key*; of its *step*-th line (from 0) if it has several, which
        systemd runs in order, stopping at the first that fails (ExecReload)."""
        lines = self.unit["Service"][key]
        if step is None:
            [line] = lines
        else:
            line = lines[step]
        argv = command(line, self.spec, environment(self.unit, self.spec))
        assert argv[0] == LAUNCHER
        return QOSFS + argv[1:]

    def env(self, stderr_fd: int) -> dict[str, str]:
        st = os.fstat(stderr_fd)
        return {**os.environ, **environment(self.unit, self.spec),
                "NOTIFY_SOCKET": self.notify.address, "INVOCATION_ID": uuid.uuid4().hex,
                "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}

    def start(self, wrapper: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """ExecStart, with stdout and stderr on one stream as under StandardOutput=journal."""
        log = self.mnt.parent / f"journal-{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "wb") as stream:
            proc = subprocess.Popen([*wrapper, *self.argv("ExecStart")], stdout=stream,
                                    stderr=stream, cwd=ROOT, env=self.env(stream.fileno()))
        self.procs.append(proc)
        return proc

    def log(self) -> str:
        return self.logs[-1].read_text(errors="replace")

    def await_ready(self, proc: subprocess.Popen[bytes]) -> None:
        """Wait for the first notification and check, at that moment, that all three
        services answer; nothing may come before it."""
        def notified() -> bool:
            assert proc.poll() is None, f"exited with {proc.returncode}: {self.log()}"
            return self.notify.ready(0.01)

        wait_for(f"a notification (log: {self.logs[-1]})", notified, timeout=30, interval=0)
        assert self.notify.next() == "READY=1"
        assert mount_type(str(self.mnt)) == "fuse.qosfs"
        os.stat(self.mnt)  # answers (a dead or half-made mount would raise or hang)
        with Client(default_socket_path(str(self.mnt))) as client:
            status = client.request({"cmd": "status"})
        assert status["ok"] and status["mountpoint"] == str(self.mnt)
        port = re.search(r"serving metrics on http://127\.0\.0\.1:(\d+)/metrics", self.log())
        assert port, self.log()
        url = f"http://127.0.0.1:{port[1]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert re.search(rb"^qosfs_policy_generation\{mount=\"[^\"]+\"\} 1\.0$",
                             reply.read(), re.MULTILINE)
        self.notify.assert_empty()

    def stop(self) -> None:
        for pid in self.successors:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            _kill_if_alive(pid, grace=20)
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        for _ in range(5):  # in place: every layer we left, never one that is not ours
            if mount_type(str(self.mnt)) != "fuse.qosfs":
                break
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        # A daemon killed by the test (or by a failure) leaves its socket in /run/qosfs.
        Path(default_socket_path(str(self.mnt))).unlink(missing_ok=True)
        self.notify.close()


@pytest.fixture
def instance(tmp_tree: Path) -> Iterator[Instance]:
    inst = Instance(tmp_tree)
    try:
        yield inst
    finally:
        inst.stop()


def reload_messages(inst: Instance) -> str:
    """RELOADING=1 with a current MONOTONIC_USEC, then READY=1 with a STATUS= line (what
    `systemctl status` shows), which is returned."""
    state = dict(line.split("=", 1) for line in inst.notify.next().split("\n"))
    now = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert state.keys() == {"RELOADING", "MONOTONIC_USEC"} and state["RELOADING"] == "1"
    assert now - 20_000_000 < int(state["MONOTONIC_USEC"]) <= now
    ready, status = inst.notify.next().split("\n")
    assert ready == "READY=1" and status.startswith("STATUS=")
    return status.removeprefix("STATUS=")


def checkpoint_cap(inst: Instance) -> float:
    with Client(default_socket_path(str(inst.mnt))) as client:
        status = client.request({"cmd": "status"})
    [level] = [lv for lv in status["levels"]
               if lv["level"] == "class" and lv["name"] == "checkpoints"]
    return float(level["limits"]["write_bandwidth"])


def test_instance_name_is_systemd_path_escaping(instance: Instance) -> None:
    escape = subprocess.run(["systemd-escape", "--path", str(instance.mnt)],
                            capture_output=True, text=True)
    if escape.returncode == 0:
        assert instance.name == escape.stdout.strip()
    assert instance.spec["f"] == str(instance.mnt)
    assert instance.argv("ExecStart") == [
        *QOSFS, "mount", "--foreground", str(instance.mnt),
        "--policy", str(instance.policy), "--keeper", "systemd",
        "--metrics", "127.0.0.1:0"]


def test_ready_only_once_mount_control_socket_and_metrics_answer(instance: Instance) -> None:
    (instance.mnt / "hello").write_text("world")  # in place: already there underneath
    proc = instance.start()
    instance.await_ready(proc)
    assert (instance.mnt / "hello").read_text() == "world"
    lines = [line for line in instance.log().splitlines() if line]
    assert lines and all(re.match(r"<[0-7]>\S", line) for line in lines), lines
    serving = f"<6>{serve.log.name}: qosfs serving"  # the logger is the module's name
    assert any(line.startswith(serving) for line in lines), lines


def test_reload_by_sighup_and_by_exec_reload_is_bracketed(instance: Instance) -> None:
    proc = instance.start()
    instance.await_ready(proc)
    assert checkpoint_cap(instance) == 400 * MiB

    proc.send_signal(signal.SIGHUP)
    assert reload_messages(instance) == f"serving; policy {instance.policy} generation 2"

    # Step 1 of ExecReload; step 2, the handover, is the next test's.
    instance.policy.write_text(SAMPLE.read_text().replace('"400MiB/s"', '"100MiB/s"'))
    done = subprocess.run(instance.argv("ExecReload", 0), cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    reload_messages(instance)
    assert checkpoint_cap(instance) == 100 * MiB

    instance.policy.write_text("[classes.checkpoints]\nwrite_bandwidth = 'fast'\n")
    done = subprocess.run(instance.argv("ExecReload", 0), cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 6  # `systemctl reload` fails and says why (no step 2)
    reason = (f"{instance.policy}:2: classes.checkpoints.write_bandwidth: expected a "
              'bandwidth like "400MiB/s", got "fast"')
    assert done.stderr == f"qosfs: {reason}\n"  # in the journal, under the unit
    status = reload_messages(instance)  # the daemon serves on, with the policy it had
    assert re.fullmatch(rf"policy reload refused at .* \(uid 0 \(pid \d+\)\), previous "
                        rf"policy kept: {re.escape(reason)}", status), status
    assert checkpoint_cap(instance) == 100 * MiB

    # kill -HUP has no caller to answer: systemctl status is where it shows.
    instance.policy.write_text("[classes.checkpoints]\nwrite_iops = 'x'\n")
    proc.send_signal(signal.SIGHUP)
    status = reload_messages(instance)
    assert re.fullmatch(rf"policy reload refused at .* \(SIGHUP\), previous policy kept: "
                        rf"{re.escape(str(instance.policy))}:2: classes.checkpoints.write_iops: "
                        r".*", status), status
    instance.notify.assert_empty()


def test_reload_step_2_hands_the_mount_over_and_names_the_new_main_pid(
        instance: Instance) -> None:
    """ExecReload's second line, ``qosfs upgrade``, as systemd runs it (the unit's
    environment, $NOTIFY_SOCKET): a successor takes the live mount over, the command
    names it the main process (MAINPID=, which NotifyAccess=exec lets it send) and the
    old daemon exits 0. tests/mount/test_systemd_box.py has a real systemd follow it."""
    (instance.mnt / "kept").write_text("data")
    proc = instance.start()
    instance.await_ready(proc)
    log = instance.mnt.parent / "upgrade.log"
    with open(instance.mnt / "kept", "rb") as job, open(log, "wb") as stream:
        done = subprocess.run(instance.argv("ExecReload", 1), cwd=ROOT, stdout=stream,
                              stderr=stream, env=instance.env(stream.fileno()), timeout=60)
        assert done.returncode == 0, log.read_text()
        message = instance.notify.next()
        found = re.fullmatch(r"MAINPID=(\d+)\nREADY=1", message)
        assert found, message
        successor = int(found[1])
        instance.successors.append(successor)
        assert proc.wait(30) == 0, instance.log()  # handed over: the old daemon is done
        with Client(default_socket_path(str(instance.mnt))) as client:
            assert client.request({"cmd": "status"})["pid"] == successor
        assert job.read() == b"data"

    # The successor is the main process now: reloads and stops go to it.
    done = subprocess.run(instance.argv("ExecReload", 0), cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert reload_messages(instance).startswith("serving; policy ")
    os.kill(successor, signal.SIGTERM)
    assert instance.notify.next() == "STOPPING=1"
    wait_for("the unmount", lambda: not is_mounted(instance.mnt), timeout=30, interval=0.05)
    instance.notify.assert_empty()


def test_sigterm_sends_stopping_then_exits_0(instance: Instance) -> None:
    proc = instance.start()
    instance.await_ready(proc)
    (instance.mnt / "kept").write_text("data")
    proc.send_signal(signal.SIGTERM)  # what `systemctl stop` sends (KillMode=mixed)
    assert instance.notify.next() == "STOPPING=1"
    assert proc.wait(30) == 0, instance.log()
    instance.notify.assert_empty()
    assert not is_mounted(instance.mnt)
    assert (instance.mnt / "kept").read_text() == "data"  # the directory underneath
    assert "Traceback" not in instance.log()


def test_restart_after_kill_9_cleans_the_stale_mount_and_keeps_fsynced_data(
        instance: Instance) -> None:
    proc = instance.start()
    instance.await_ready(proc)
    digests = {}
    (instance.mnt / "checkpoints").mkdir()
    for i in range(4):
        path = instance.mnt / "checkpoints" / f"shard{i}.pt"
        data = os.urandom(3 * MiB + i)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        digests[path] = xxhash.xxh3_128_hexdigest(data)

    proc.kill()  # a crash: Restart=on-failure runs ExecStart again
    proc.wait(10)
    with pytest.raises(OSError) as info:
        os.listdir(instance.mnt)  # (a stat may still be answered from the kernel's cache)
    assert info.value.errno == errno.ENOTCONN

    again = instance.start()
    instance.await_ready(again)
    stale = rf"^<4>{re.escape(preflight.log.name)}: .* is a stale mount"
    assert re.search(stale, instance.log(), re.MULTILINE), instance.log()
    for path, digest in digests.items():
        assert xxhash.xxh3_128_hexdigest(path.read_bytes()) == digest
    again.send_signal(signal.SIGTERM)
    assert instance.notify.next() == "STOPPING=1"
    assert again.wait(30) == 0, instance.log()
    assert not is_mounted(instance.mnt)  # the stale layer went too: nothing left stacked


def test_the_units_capabilities_suffice_for_a_faithful_pass_through(
        instance: Instance, tmp_tree: Path) -> None:
    """Run under the unit's CapabilityBoundingSet and NoNewPrivileges (as systemd would,
    through setpriv): POSIX behaviour still matches the bare directory, for root and for
    a user, and a job_env class still reads another user's /proc/PID/environ."""
    caps = [c for line in instance.unit["Service"]["CapabilityBoundingSet"]
            for c in line.split()]
    assert instance.unit["Service"]["NoNewPrivileges"] == ["yes"]
    bounding = ",".join(["-all", *(f"+{c.removeprefix('CAP_').lower()}" for c in caps)])
    instance.policy.write_text('[classes.job]\njob_env = "QOSFS_TEST_JOB"\njobs = ["42"]\n'
                               + SAMPLE.read_text())
    proc = instance.start(["setpriv", "--no-new-privs", "--bounding-set", bounding])
    instance.await_ready(proc)
    with open(f"/proc/{proc.pid}/status") as f:
        status = dict(line.split(":\t", 1) for line in f.read().splitlines())
    expected = sum(1 << _cap_number(c) for c in caps)
    assert int(status["CapEff"], 16) == expected and int(status["CapBnd"], 16) == expected

    for scenario in SCENARIOS:
        native = posix_scenarios.SCENARIOS[scenario](_fresh(tmp_tree / f"native-{scenario}"))
        through = posix_scenarios.SCENARIOS[scenario](_fresh(instance.mnt / scenario))
        assert through == native, scenario
    native, through = _fresh(tmp_tree / "native-user"), _fresh(instance.mnt / "user")
    for root in (native, through):
        posix_scenarios.prepare_user_tree(root, gid=TEST_GID + 1)
    assert _run_as_user(through, "user", tmp_tree) == _run_as_user(native, "user", tmp_tree)

    jobs = instance.mnt / "jobs"
    jobs.mkdir(mode=0o777)
    os.chmod(jobs, 0o777)
    subprocess.run(["/bin/sh", "-c", 'head -c 65536 /dev/zero > "$1"', "sh", str(jobs / "x")],
                   env={"QOSFS_TEST_JOB": "42", "PATH": "/usr/bin:/bin"}, cwd="/", check=True,
                   preexec_fn=as_user(TEST_UID, TEST_GID))
    assert (jobs / "x").stat().st_uid == TEST_UID
    with Client(default_socket_path(str(instance.mnt))) as client:
        levels = client.request({"cmd": "status"})["levels"]
    [job] = [lv for lv in levels if lv["level"] == "class" and lv["name"] == "job"]
    assert job["write_bytes"] == 65536
    assert "could not set" not in instance.log()  # the sysfs tuning needs no more either


def _fresh(path: Path) -> str:
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    return str(path)


# linux/capability.h numbers of the capabilities a unit may name.
CAPS = ["CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID",
        "SETUID", "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST",
        "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO",
        "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
        "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE",
        "AUDIT_CONTROL", "SETFCAP"]


def _cap_number(name: str) -> int:
    return CAPS.index(name.removeprefix("CAP_"))


def test_background_mount_hands_the_main_pid_to_systemd(tmp_tree: Path) -> None:
    """Without --foreground (not what the unit does): the forking parent reports the
    daemon's PID with READY=1, so Type=notify would still track the right process."""
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir()
    mnt.mkdir()
    notify = Notifications()
    env = {**os.environ, "NOTIFY_SOCKET": notify.address}
    daemon = None
    try:
        done = subprocess.run([*QOSFS, "mount", str(src), str(mnt)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        message = notify.next()
        found = re.fullmatch(r"MAINPID=(\d+)\nREADY=1", message)
        assert found, message
        daemon = int(found[1])
        with open(f"/proc/{daemon}/cmdline", "rb") as f:
            assert b"mount" in f.read()
        os.kill(daemon, signal.SIGTERM)
        assert notify.next() == "STOPPING=1"
        wait_for("the unmount", lambda: not is_mounted(mnt), timeout=20, interval=0.05)
    finally:
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        if daemon is not None:
            _kill_if_alive(daemon)
        notify.close()


def _kill_if_alive(pid: int, grace: float = 10) -> None:
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return  # exited; reaping is init's business
        except FileNotFoundError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
