"""systemd/qosfs@.service under a real systemd 252 (tests/systemd_box.py): start, reload,
kill -9 and Restart=, stop. tests/mount/test_systemd.py runs the unit's commands itself;
this is what only systemd can show: which process it tracks, that it restarts a crashed
daemon in time, and that it stops the right one after a handover."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosfs.control.address import default_socket_path
from qosfs.core.mountinfo import mount_type
from qosfs.daemon.takeover.offer import handover_socket_path
from tests.mounting import ROOT, is_mounted
from tests.systemd_box import SystemdBox, unavailable, wait_until_serving
from tests.systemd_units import UNIT, escape_path
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root, pytest.mark.systemd]

LAUNCHER = "/usr/local/bin/qosfs"
SAMPLE = ROOT / "systemd" / "mnt-mlfs.toml"
SERVING_AGAIN = 3.0  # seconds after a crash (issue 31's bound under systemd)


class BoxedInstance:
    """qosfs@<escaped share/mlfs>.service in *box*: the shipped unit with the worktree's
    ``python -m qosfs`` for the launcher and /etc/qosfs moved under the box."""

    def __init__(self, box: SystemdBox) -> None:
        self.box = box
        self.mnt = box.share / "mlfs"
        self.mnt.mkdir(mode=0o755)
        self.unit = f"qosfs@{escape_path(str(self.mnt))}.service"
        etc = box.root / "etc" / "qosfs"
        etc.mkdir(parents=True)
        name = escape_path(str(self.mnt))
        self.policy = etc / f"{name}.toml"
        self.policy.write_text(SAMPLE.read_text())
        (etc / f"{name}.env").write_text("QOSFS_METRICS=127.0.0.1:0\n")
        self.launcher = box.root / "qosfs"  # stands in for what make install writes
        self.install()
        text = UNIT.read_text()
        assert text.count(LAUNCHER) >= 2 and text.count("%E/qosfs") >= 2
        text = text.replace(LAUNCHER, str(self.launcher))
        (box.units / "qosfs@.service").write_text(text.replace("%E/qosfs", str(etc)))
        dropins = box.units / "qosfs@.service.d"
        dropins.mkdir()
        (dropins / "worktree.conf").write_text(
            f"[Service]\nEnvironment=PYTHONPATH={ROOT}\nWorkingDirectory={ROOT}\n")
        box.systemctl("daemon-reload")

    def install(self, failing_upgrade: bool = False) -> None:
        """The launcher, ``python -m qosfs``; with *failing_upgrade*, ``upgrade`` is a new
        version that cannot take over (it refuses once it has the session)."""
        lines = ["#!/bin/sh"]
        if failing_upgrade:
            handover = handover_socket_path(default_socket_path(str(self.mnt)))
            lines.append(f'[ "$1" = upgrade ] && {{ {sys.executable} -m tests.mount.upgrade_peer '
                         f'{handover} refuse; exit 1; }}')
        lines.append(f'exec {sys.executable} -m qosfs "$@"')
        self.launcher.write_text("\n".join(lines) + "\n")
        self.launcher.chmod(0o755)

    def state(self) -> dict[str, str]:
        return self.box.show(self.unit, "ActiveState", "SubState", "MainPID", "NRestarts",
                             "NFileDescriptorStore")

    def ctl_status(self) -> str:
        """``qosfs ctl status`` in the box (the control socket is in its /run)."""
        return self.box.run(sys.executable, "-m", "qosfs", "ctl", "--socket", str(self.mnt),
                            "status").stdout

    def main_cmdline(self) -> str:
        host = self.box.host_pid(int(self.state()["MainPID"]))
        with open(f"/proc/{host}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()


@pytest.fixture
def box(tmp_tree: Path) -> Iterator[SystemdBox]:
    reason = unavailable()
    if reason:
        pytest.skip(f"no systemd box here: {reason}")
    with SystemdBox(tmp_tree / "box") as started:
        yield started
    assert not is_mounted(started.share)


def test_reload_hands_over_and_systemd_follows_the_new_daemon_through_a_crash(
        box: SystemdBox) -> None:
    """systemctl reload: the policy file, then the installed code takes the live mount
    over and becomes the main process; kill -9 of it is restarted in time; stop stops it."""
    inst = BoxedInstance(box)
    # Something in the descriptor store, to see it outlive the handovers: a memfd, stored
    # by ExecStartPost (NotifyAccess=exec lets the unit's commands do that too).
    store = ("import os; from qosfs.daemon.notify import store_fd; "
             "store_fd(os.memfd_create('s'), 's')")
    (box.units / "qosfs@.service.d" / "store.conf").write_text(
        f'[Service]\nExecStartPost={sys.executable} -c "{store}"\n')
    box.systemctl("daemon-reload")
    (inst.mnt / "kept").write_text("data")  # in place: there underneath
    box.systemctl("start", inst.unit)
    first = inst.state()
    assert first["ActiveState"] == "active" and first["SubState"] == "running", box.log()
    assert first["NFileDescriptorStore"] == "3"  # the memfd, qosfs-fuse and qosfs-root
    assert mount_type(str(inst.mnt)) == "fuse.qosfs"  # the box's mount, seen here
    assert " mount --foreground " in inst.main_cmdline()

    with open(inst.mnt / "kept", "r+b") as job:  # a job's descriptor, open throughout
        mains = [first["MainPID"]]
        for appended, cap in enumerate(("400MiB/s", "100MiB/s")):
            inst.policy.write_text(SAMPLE.read_text().replace('"400MiB/s"', f'"{cap}"'))
            box.systemctl("reload", inst.unit)
            now = inst.state()
            assert now["MainPID"] not in mains, box.log()
            assert now["ActiveState"] == "active" and now["NRestarts"] == "0", now
            assert now["NFileDescriptorStore"] == "3"  # the store is the unit's
            assert " upgrade " in inst.main_cmdline()
            assert f"checkpoints  w:{cap}" in inst.ctl_status()  # step 1, carried over
            mains.append(now["MainPID"])
            job.seek(0)
            assert job.read() == b"data" + b"+" * appended
            job.write(b"+")
            os.fsync(job.fileno())

        # A bad file fails the reload at step 1: no handover, and the reason in Status,
        # from the successor (systemd takes the new main process's notifications).
        inst.policy.write_text("[classes.checkpoints]\nwrite_bandwidth = 'fast'\n")
        assert box.systemctl("reload", inst.unit, check=False).returncode != 0
        assert inst.state()["MainPID"] == mains[-1]
        status = box.show(inst.unit, "StatusText")["StatusText"]
        assert status.startswith("policy reload refused at "), status
        inst.policy.write_text(SAMPLE.read_text())

        # kill -9: the connection waits in the store, the restarted daemon takes it over
        # (qosfs.daemon.takeover.recover), and the job's descriptor goes on as if nothing happened.
        box.systemctl("kill", "--signal=SIGKILL", "--kill-who=main", inst.unit)
        took = wait_until_serving(inst.mnt, timeout=30)
        # (ExecStartPost may still run: a stop now would kill it and fail the unit.)
        again = wait_for("the restarted unit to run", inst.state,
                         until=lambda s: s["SubState"] == "running", timeout=30)
        assert again["NRestarts"] == "1" and again["MainPID"] not in mains, box.log()
        print(f"serving again {took:.2f} s after kill -9 (RestartSec + taking over)")
        assert took < SERVING_AGAIN, f"serving again after {took:.2f} s"
        assert "recovering after the death of pid" in box.log()
        job.seek(0)
        assert job.read() == b"data++"  # the same descriptor, across the crash
        job.write(b"+")
        os.fsync(job.fileno())
    assert (inst.mnt / "kept").read_text() == "data+++"

    box.systemctl("stop", inst.unit)
    assert inst.state()["ActiveState"] == "inactive"
    assert not is_mounted(inst.mnt)
    assert (inst.mnt / "kept").read_text() == "data+++"


def test_a_refused_upgrade_fails_the_reload_and_the_old_daemon_serves_on(
        box: SystemdBox) -> None:
    inst = BoxedInstance(box)
    (inst.mnt / "kept").write_text("data")
    box.systemctl("start", inst.unit)
    first = inst.state()
    inst.install(failing_upgrade=True)
    with open(inst.mnt / "kept", "rb") as job:
        assert box.systemctl("reload", inst.unit, check=False).returncode != 0
        now = inst.state()
        assert now["MainPID"] == first["MainPID"] and now["ActiveState"] == "active", now
        status = box.show(inst.unit, "StatusText")["StatusText"]
        assert status.endswith(" generation 2"), status  # step 1 was applied
        assert "refused, serving on" in box.log()
        assert job.read() == b"data"
    box.systemctl("stop", inst.unit)
    assert not is_mounted(inst.mnt)


# A service that keeps a memfd ("state") and a FUSE connection (mounted, never
# initialised, in the box's own /run where nothing on the host can stumble into it) in
# the store on its first start, and reports what each start got back.
FDSTORE_SERVICE = """
import ctypes, json, os, signal, sys, time
from qosfs.daemon.notify import FUSE_FD_NAME, fd_store_possible, inherited_fds, notify
from qosfs.daemon.notify import remove_fd, store_fd
report_path, mnt = sys.argv[1], sys.argv[2]
kept = inherited_fds()
report = {"possible": fd_store_possible(), "kept": sorted(kept),
          "env": sorted(k for k in os.environ if k.startswith("LISTEN_"))}
if "state" in kept:
    report["state"] = os.pread(kept["state"], 64, 0).decode()
else:
    state = os.memfd_create("state")
    os.write(state, b"generation 1")
    store_fd(state, "state")
    store_fd(os.dup(state), "state")  # the same open file again
if FUSE_FD_NAME in kept:
    report["fuse"] = os.readlink(f"/proc/self/fd/{kept[FUSE_FD_NAME]}")
elif not kept:
    fuse = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    os.makedirs(mnt, exist_ok=True)
    options = f"fd={fuse},rootmode=40000,user_id=0,group_id=0".encode()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"qosfs-test", mnt.encode(), b"fuse.qosfs-test", 0, options):
        raise OSError(ctypes.get_errno(), f"mount {mnt}")
    store_fd(fuse, FUSE_FD_NAME)
with open(report_path, "a") as f:
    f.write(json.dumps(report) + "\\n")
signal.signal(signal.SIGUSR1, lambda *_: remove_fd("state"))
notify("READY=1")
while True:
    time.sleep(3600)
"""


def test_the_descriptor_store_outlives_a_crash_and_a_restart(box: SystemdBox) -> None:
    script, reports = box.root / "fdstore_service.py", box.root / "reports.jsonl"
    script.write_text(FDSTORE_SERVICE)
    raw = "/run/qosfs-test-raw"  # in the box's /run
    (box.units / "fdstore.service").write_text(
        f"[Service]\nType=notify\nExecStart={sys.executable} {script} {reports} {raw}\n"
        f"Environment=PYTHONPATH={ROOT}\nFileDescriptorStoreMax=4\n"
        "Restart=on-failure\nRestartSec=100ms\n")
    box.systemctl("daemon-reload")

    def started(n: int) -> dict[str, object]:
        wait_for(f"start {n}", lambda: reports.exists() and
                 len(reports.read_text().splitlines()) >= n, timeout=30)
        report: dict[str, object] = json.loads(reports.read_text().splitlines()[n - 1])
        assert report["possible"] is True and report["env"] == []
        return report

    def stored() -> int:
        return int(box.show("fdstore.service", "NFileDescriptorStore")["NFileDescriptorStore"])

    box.systemctl("start", "fdstore.service")
    assert started(1)["kept"] == []
    assert stored() == 2  # the state once, though sent twice, and the FUSE descriptor

    box.systemctl("kill", "--signal=SIGKILL", "--kill-who=main", "fdstore.service")
    after_crash = started(2)
    assert after_crash == {**after_crash, "kept": ["qosfs-fuse", "state"],
                           "state": "generation 1", "fuse": "/dev/fuse"}

    box.systemctl("restart", "fdstore.service")  # 252 keeps the store through this too
    assert started(3)["kept"] == ["qosfs-fuse", "state"]

    # An unmounted connection reports POLLERR: systemd closes its copy by itself.
    box.run("umount", "-l", raw)
    wait_for("systemd to drop the dead FUSE descriptor", stored, until=lambda n: n == 1)
    box.systemctl("kill", "--signal=SIGUSR1", "--kill-who=main", "fdstore.service")
    wait_for("FDSTOREREMOVE to empty the store", stored, until=lambda n: n == 0)
    box.systemctl("kill", "--signal=SIGKILL", "--kill-who=main", "fdstore.service")
    assert started(4)["kept"] == []  # (and it stores both anew, mounting again)
    box.systemctl("stop", "fdstore.service")
    assert stored() == 0  # stop empties the store
