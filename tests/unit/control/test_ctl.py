"""The ctl/top client side without a daemon: socket discovery, requests, formatting."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from qosfs.control import ctl, top
from qosfs.control.address import socket_name
from qosfs.control.kernel_status import format_read_counting
from qosfs.core.errors import EXIT_CONTROL, EXIT_POLICY, EXIT_USAGE, QosfsError

MiB = 1 << 20
REPLY = {
    "ok": True, "qos": True, "generation": 4, "policy_source": "/etc/qosfs/p.toml",
    "source": "/srv", "mountpoint": "/mnt", "pid": 7, "uptime_seconds": 65.0,
    "changes": [{"command": "set", "result": "applied", "count": 3}],
    "last_reload_ok": True, "window_seconds": 1.0,
    "levels": [
        {"level": "class", "name": "ckpt", "uid": None,
         "limits": {"write_bandwidth": 400 * MiB, "write_iops": 2000},
         "queue_depth": 12, "throttled_seconds": 34.25,
         "rates": {"read_bytes": 0.0, "write_bytes": 398 * MiB, "read_ops": 0.0,
                   "write_ops": 398.0, "meta_ops": 0.0, "throttled_seconds": 11.0}},
        {"level": "user", "name": "ckpt", "uid": 1000, "limits": {}, "queue_depth": 0,
         "throttled_seconds": 0.0,
         "rates": {"read_bytes": 5 * MiB, "write_bytes": 0.0, "read_ops": 5.0,
                   "write_ops": 0.0, "meta_ops": 0.0, "throttled_seconds": 0.0}},
    ],
    "accounts": [],
}


def test_human_units() -> None:
    assert ctl.human_bytes(400 * MiB, "/s") == "400MiB/s"
    assert ctl.human_bytes(1.5 * MiB) == "1.5MiB"
    assert ctl.human_bytes(0) == "0B"
    assert ctl.human_count(2000) == "2k" and ctl.human_count(1.5e6) == "1.5M"
    assert ctl.human_seconds(0.0042) == "4.2ms" and ctl.human_seconds(0) == "0s"
    assert ctl.human_seconds(None) == "-"


def test_status_table() -> None:
    text = ctl.format_status(REPLY)
    lines = text.splitlines()
    assert lines[0] == "qosfs /srv on /mnt (pid 7, up 65.0s)"
    assert lines[1] == "policy /etc/qosfs/p.toml generation 4 (3 changes applied, 0 rejected)"
    assert lines[-2].split() == ["class", "ckpt", "w:400MiB/s", "w:2kop/s", "0B/s",
                                 "398MiB/s", "398", "12", "34.2s"]
    assert lines[-1].split() == ["user", "ckpt/uid=1000", "-", "5MiB/s", "0B/s", "5", "0",
                                 "0s"]


def test_status_says_when_the_daemon_survived_a_bug() -> None:
    assert "INTERNAL" not in ctl.format_status({**REPLY, "internal_errors": {}})
    text = ctl.format_status({**REPLY, "internal_errors": {"read": {"ValueError": 3},
                                                           "control": {"KeyError": 1}}})
    assert text.splitlines()[2] == (
        "INTERNAL ERRORS (answered EIO or restarted; the first of each kind is in the "
        "daemon's log): read ValueError x3, control KeyError x1")


def test_status_says_why_the_last_reload_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        failure = {"time": 1_700_000_000.0, "by": "SIGHUP", "source": "/etc/qosfs/p.toml",
                   "line": 3, "key": "classes.ckpt.write_iops", "reason": "expected ...",
                   "error": "/etc/qosfs/p.toml:3: classes.ckpt.write_iops: expected ..."}
        lines = ctl.format_status({**REPLY, "last_reload_ok": False,
                                   "last_reload_failure": failure}).splitlines()
    finally:
        monkeypatch.undo()
        time.tzset()
    assert lines[1] == "policy /etc/qosfs/p.toml generation 4 (3 changes applied, 0 rejected)"
    assert lines[2] == ("LAST RELOAD FAILED at 2023-11-14 22:13:20 UTC (SIGHUP), previous "
                        "policy kept: /etc/qosfs/p.toml:3: classes.ckpt.write_iops: expected ...")
    older = ctl.format_status({**REPLY, "last_reload_ok": False}).splitlines()
    assert older[2] == ("LAST RELOAD FAILED (the reason is in the daemon's log); previous "
                        "policy kept")
    assert "RELOAD" not in ctl.format_status({**REPLY, "last_reload_failure": None})


def test_top_frame_has_no_escape_codes_and_fits() -> None:
    frame = top.render_frame(REPLY, width=40)
    assert "\x1b" not in frame
    assert all(len(line) <= 40 for line in frame.splitlines())


def test_errors_map_to_exit_codes() -> None:
    with pytest.raises(QosfsError) as policy:
        ctl.checked({"ok": False, "code": "policy", "error": "bad"})
    assert policy.value.exit_code == EXIT_POLICY and str(policy.value) == "bad"
    with pytest.raises(QosfsError) as denied:
        ctl.checked({"ok": False, "code": "denied", "error": "no"})
    assert denied.value.exit_code == EXIT_CONTROL


def test_unreachable_socket_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(QosfsError, match="is the mount running") as err:
        ctl.Client(str(tmp_path / "none.sock"))
    assert err.value.exit_code == EXIT_CONTROL


def test_requests_from_arguments(tmp_path: Path) -> None:
    ns = argparse.Namespace
    assert ctl.build_request(ns(ctl_command="set", target="tenant:a",
                                settings=["write_bandwidth=1GiB/s"])) == {
        "cmd": "set", "target": "tenant", "name": "a",
        "changes": {"write_bandwidth": "1GiB/s"}}
    assert ctl.build_request(ns(ctl_command="set", target="backend",
                                settings=["read_iops=2k"]))["target"] == "backend"
    policy = tmp_path / "p.toml"
    policy.write_text("[classes.default]\n")
    assert ctl.build_request(ns(ctl_command="reload", file=str(policy))) == {
        "cmd": "reload", "text": "[classes.default]\n", "source": str(policy)}
    with pytest.raises(QosfsError, match="expected KEY=VALUE"):
        ctl.build_request(ns(ctl_command="set", target="x", settings=["oops"]))


@pytest.mark.parametrize(("text", "expected"), [
    ("checkpoints", ("class", "checkpoints")),
    ("class:backend", ("class", "backend")),
    ("tenant:team-a", ("tenant", "team-a")),
    ("backend", ("backend", None)),
])
def test_targets(text: str, expected: tuple[str, str | None]) -> None:
    assert ctl.parse_target(text) == expected


@pytest.mark.parametrize("text", ["pool:x", "tenant:", ":x"])
def test_bad_targets_are_usage_errors(text: str) -> None:
    with pytest.raises(QosfsError, match=r"^ctl set: bad target") as err:
        ctl.parse_target(text)
    assert err.value.exit_code == EXIT_USAGE


def test_assignments() -> None:
    assert ctl.parse_assignments(["write_bandwidth=400MiB/s", "write_iops = 2k"]) == {
        "write_bandwidth": "400MiB/s", "write_iops": "2k"}
    for items, message in ((["write_bandwidth"], "expected KEY=VALUE"),
                           (["write_iops=1", "write_iops=2"], "write_iops is given twice"),
                           ([], "nothing to set")):
        with pytest.raises(QosfsError, match=message) as err:
            ctl.parse_assignments(items)
        assert err.value.exit_code == EXIT_USAGE


def test_socket_discovery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine, system = tmp_path / "mine", tmp_path / "system"
    mine.mkdir()
    system.mkdir()
    monkeypatch.setattr(ctl, "socket_dirs", lambda: [str(mine), str(system)])
    with pytest.raises(QosfsError, match="no qosfs control socket"):
        ctl.resolve_socket(None)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (system / socket_name(str(mnt))).touch()
    assert ctl.resolve_socket(None) == str(system / socket_name(str(mnt)))
    assert ctl.resolve_socket(str(mnt)) == str(system / socket_name(str(mnt)))
    assert ctl.resolve_socket("/some/where.sock") == "/some/where.sock"
    (mine / "other.sock").touch()
    with pytest.raises(QosfsError, match="several qosfs mounts"):
        ctl.resolve_socket(None)


def test_a_mount_and_its_pointer_are_one_mount_to_discovery(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mount made with --socket PATH leaves a pointer to PATH at its derived path
    (qosfs.daemon.pointer): with PATH in the same directory, discovery finds one mount."""
    system = tmp_path / "system"
    system.mkdir()
    monkeypatch.setattr(ctl, "socket_dirs", lambda: [str(system)])
    (system / "custom.sock").touch()
    (system / socket_name(str(tmp_path / "mnt"))).symlink_to(system / "custom.sock")
    assert ctl.resolve_socket(None) == str(system / "custom.sock")
    (system / "gone.sock").symlink_to(tmp_path / "removed" / "mlfs.sock")  # stale
    assert ctl.resolve_socket(None) == str(system / "custom.sock")
    (system / "other.sock").touch()
    with pytest.raises(QosfsError, match="several qosfs mounts"):
        ctl.resolve_socket(None)


def test_status_says_which_version_serves_and_how_many_handovers_it_had() -> None:
    lines = ctl.format_status({**REPLY, "version": "0.2.0", "handovers": 3}).splitlines()
    assert lines[0] == "qosfs /srv on /mnt (pid 7, qosfs 0.2.0, 3 handovers, up 65.0s)"
    first = ctl.format_status({**REPLY, "version": "0.1.0", "handovers": 1}).splitlines()
    assert first[0] == "qosfs /srv on /mnt (pid 7, qosfs 0.1.0, 1 handover, up 65.0s)"


def test_status_says_when_the_counting_programs_are_detached() -> None:
    entry = {"state": "on", "reason": "BPF (tp_btf)", "watched": 0, "attached": False,
             "read_bytes": {}, "reads": {}, "uncounted_opens": {}, "lost_bytes": 0}
    (idle,) = format_read_counting(entry)
    assert "0 files watched now (programs detached until one is)" in idle
    (busy,) = format_read_counting({**entry, "watched": 3, "attached": True})
    assert "3 files watched now; BPF (tp_btf)" in busy
