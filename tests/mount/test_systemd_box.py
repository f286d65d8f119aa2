"""systemd/qosfs@.service under a real systemd 252 (tests/systemd_box.py): start, reload,
kill -9 and Restart=, stop. tests/mount/test_systemd.py runs the unit's commands itself;
this is what only systemd can show: which process it tracks, that it restarts a crashed
daemon in time, and that it stops the right one after a handover."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosfs.daemon.mount import mount_type
from tests.mounting import ROOT, is_mounted
from tests.systemd_box import SystemdBox, unavailable, wait_until_serving
from tests.systemd_units import UNIT, escape_path

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
        (etc / f"{name}.toml").write_text(SAMPLE.read_text())
        (etc / f"{name}.env").write_text("QOSFS_METRICS=127.0.0.1:0\n")
        text = UNIT.read_text()
        assert text.count(LAUNCHER) >= 2 and text.count("%E/qosfs") >= 2
        text = text.replace(LAUNCHER, f"{sys.executable} -m qosfs")
        (box.units / "qosfs@.service").write_text(text.replace("%E/qosfs", str(etc)))
        dropins = box.units / "qosfs@.service.d"
        dropins.mkdir()
        (dropins / "worktree.conf").write_text(
            f"[Service]\nEnvironment=PYTHONPATH={ROOT}\nWorkingDirectory={ROOT}\n")
        box.systemctl("daemon-reload")

    def state(self) -> dict[str, str]:
        return self.box.show(self.unit, "ActiveState", "SubState", "MainPID", "NRestarts",
                             "NFileDescriptorStore")

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


def test_systemd_restarts_a_killed_daemon_and_stops_it(box: SystemdBox) -> None:
    inst = BoxedInstance(box)
    (inst.mnt / "kept").write_text("data")  # in place: there underneath
    inst.box.systemctl("start", inst.unit)
    first = inst.state()
    assert first["ActiveState"] == "active" and first["SubState"] == "running", box.log()
    assert mount_type(str(inst.mnt)) == "fuse.qosfs"  # the box's mount, seen here
    assert " mount --foreground " in inst.main_cmdline()
    assert (inst.mnt / "kept").read_text() == "data"

    box.systemctl("kill", "--signal=SIGKILL", "--kill-who=main", inst.unit)
    took = wait_until_serving(inst.mnt, timeout=30)
    again = inst.state()
    assert again["NRestarts"] == "1" and again["MainPID"] != first["MainPID"], box.log()
    assert took < SERVING_AGAIN, f"serving again after {took:.2f} s"
    assert (inst.mnt / "kept").read_text() == "data"

    box.systemctl("stop", inst.unit)
    assert inst.state()["ActiveState"] == "inactive"
    assert not is_mounted(inst.mnt)
    assert (inst.mnt / "kept").read_text() == "data"
