"""The control socket, ``qosfs ctl``/``top`` and ``/metrics`` through real mounts."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

import qosfs
from qosfs.control.address import default_socket_path
from qosfs.control.ctl import Client
from qosfs.control.protocol import MAX_REQUEST_BYTES
from qosfs.daemon import cli
from qosfs.policy.build import build_policy
from qosfs.policy.loading import load_policy, with_changes
from tests.mounting import ROOT, QosfsMount, as_user, is_mounted
from tests.waiting import wait_for

pytestmark = pytest.mark.mount

MiB = 1 << 20
POLICY = """
[tenants.team]
uids = [4242]
[classes.capped]
paths = ["capped/**"]
write_bandwidth = "2MiB/s"
burst = "1MiB"
passthrough = "off"   # its reads reach the daemon, whose counts the metrics show
[classes.default]
"""


class Mounted:
    def __init__(self, mount: QosfsMount, sock: Path, policy: Path) -> None:
        self.mount, self.sock, self.policy = mount, sock, policy
        self.mnt, self.src = mount.mountpoint, mount.source

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        with Client(str(self.sock)) as client:
            return client.request(body)

    def metrics_url(self) -> str:
        found = wait_for("the metrics address in the log",
                         lambda: re.search(r"serving metrics on (http://\S+)", self.mount.log()),
                         timeout=5, interval=0.05)
        return found[1]


@pytest.fixture
def ctl_mount(tmp_tree: Path) -> Iterator[Mounted]:
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    for d in (src, mnt, src / "capped"):
        d.mkdir()
        os.chmod(d, 0o777)
    policy = tmp_tree / "policy.toml"
    policy.write_text(POLICY)
    sock = tmp_tree / "ctl.sock"
    m = QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock), "--metrics", "0")
    m.start()
    try:
        yield Mounted(m, sock, policy)
    finally:
        code = m.stop()
        assert code == 0, m.log()
        assert "Traceback" not in m.log(), m.log()
        assert not sock.exists()  # removed on the way out


def ctl(capsys: pytest.CaptureFixture[str], sock: Path, *args: str) -> tuple[int, str, str]:
    code = cli.main(["ctl", "--socket", str(sock), *args])
    out, err = capsys.readouterr()
    return code, out, err


def policy_view(status: dict[str, Any]) -> tuple[Any, ...]:
    """What a change could alter: the generation and every level's limits and settings."""
    return (status["generation"], status["policy_source"],
            [(lv["level"], lv["name"], lv["uid"], lv["limits"], lv.get("priority"),
              lv.get("per_user"), lv.get("cache")) for lv in status["levels"]])


def test_status_set_and_stats(ctl_mount: Mounted, capsys: pytest.CaptureFixture[str]) -> None:
    sock = ctl_mount.sock
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    code, out, _ = ctl(capsys, sock, "status")
    assert code == 0
    assert re.search(r"^class\s+capped\s+w:2MiB/s\s", out, re.MULTILINE), out
    assert "generation 1" in out

    code, out, _ = ctl(capsys, sock, "set", "capped", "write_bandwidth=400MiB/s",
                       "write_iops=2000")
    assert (code, out) == (0, f"generation 2 in force (policy {ctl_mount.policy})\n")
    assert ctl(capsys, sock, "set", "tenant:team", "write_bandwidth=1GiB/s")[0] == 0
    assert ctl(capsys, sock, "set", "backend", "read_bandwidth=4GiB/s")[0] == 0
    status = ctl_mount.request({"cmd": "status"})
    limits = {(lv["level"], lv["name"]): lv["limits"] for lv in status["levels"]}
    assert limits[("class", "capped")] == {"write_bandwidth": 400 * MiB, "write_iops": 2000}
    assert limits[("tenant", "team")] == {"write_bandwidth": 1 << 30}
    assert limits[("backend", "backend")] == {"read_bandwidth": 4 << 30}
    assert status["generation"] == 4

    (ctl_mount.mnt / "capped" / "f").write_bytes(b"x" * 3 * MiB)
    assert (ctl_mount.mnt / "capped" / "f").read_bytes() == b"x" * 3 * MiB
    code, out, _ = ctl(capsys, sock, "stats", "--json")
    stats = json.loads(out)
    capped = next(a for a in stats["accounts"] if a["class"] == "capped")
    assert capped["write_bytes"] == 3 * MiB and capped["write_ops"] >= 3
    # Histograms count requests; write_ops counts the caller's writes: one 3 MiB write
    # from an unaligned buffer arrives as 4 requests, charged 3 ops
    # (qosfs.qos.charge: split tails).
    requests = capped["latency"]["write_backend"]["count"]
    assert capped["write_ops"] <= requests <= capped["write_ops"] + 1
    code, out, _ = ctl(capsys, sock, "stats")
    assert code == 0 and re.search(r"^capped\s+-\s+-\s+\S+\s+3MiB", out, re.MULTILINE), out
    code, out, _ = ctl(capsys, sock, "status")
    assert re.search(r"^backend\s+backend\s+r:4GiB/s", out, re.MULTILINE), out


def test_rejected_set_and_reload_leave_the_policy_unchanged(
        ctl_mount: Mounted, capsys: pytest.CaptureFixture[str], tmp_tree: Path) -> None:
    sock = ctl_mount.sock
    before = policy_view(ctl_mount.request({"cmd": "status"}))
    code, _, err = ctl(capsys, sock, "set", "capped", "write_bandwidth=400MiB/s",
                       "write_iops=-3")
    assert code == 6
    assert err.startswith("qosfs: ctl: classes.capped.write_iops: "), err
    code, _, err = ctl(capsys, sock, "set", "nosuch", "write_bandwidth=1MiB/s")
    assert code == 6 and 'no class named "nosuch"' in err
    bad = tmp_tree / "bad.toml"
    bad.write_text('[classes.x]\npaths = ["a/**"]\nwrite_bandwidth = "fast"\n')
    code, _, err = ctl(capsys, sock, "reload", str(bad))
    assert code == 6 and err.startswith(f"qosfs: {bad}:3: classes.x.write_bandwidth: "), err
    code, _, err = ctl(capsys, sock, "reload", str(tmp_tree / "missing.toml"))
    assert code == 6 and "cannot read policy" in err
    after = ctl_mount.request({"cmd": "status"})
    assert policy_view(after) == before
    # Refused reloads of other files were answered to their caller: no standing alert.
    assert after["last_reload_ok"] is True and after["last_reload_failure"] is None
    rejected = {(c["command"], c["result"]): c["count"] for c in after["changes"]}
    assert rejected == {("set", "rejected"): 2, ("reload", "rejected"): 1}


def test_set_of_a_key_only_a_reload_changes_says_so(
        ctl_mount: Mounted, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = ctl(capsys, ctl_mount.sock, "set", "capped", "paths=other/**")
    assert code == 6 and out == ""
    assert err.startswith("qosfs: ctl: classes.capped.paths: not settable live: change it "
                          "in the policy file, then `qosfs ctl reload` (settable live on a "
                          "class: read_bandwidth, write_bandwidth,"), err
    assert "unknown key" not in err and err.count("\n") == 1
    code, _, err = ctl(capsys, ctl_mount.sock, "set", "capped", "write_bandwidth")
    assert code == 2 and err.startswith("qosfs: ctl set: bad setting 'write_bandwidth' "
                                        "(expected KEY=VALUE"), err
    changes = ctl_mount.request({"cmd": "status"})["changes"]
    # The usage error never reached the daemon; the refused key did.
    assert changes == [{"command": "set", "result": "rejected", "count": 1}]


def test_reload_a_file_then_the_mounts_own(ctl_mount: Mounted,
                                          capsys: pytest.CaptureFixture[str],
                                          tmp_tree: Path) -> None:
    new = tmp_tree / "new.toml"
    new.write_text(POLICY.replace("2MiB/s", "8MiB/s"))
    assert ctl(capsys, ctl_mount.sock, "reload", str(new))[0] == 0
    status = ctl_mount.request({"cmd": "status"})
    assert status["policy_source"] == str(new) and status["generation"] == 2
    capped = next(lv for lv in status["levels"] if lv["name"] == "capped")
    assert capped["limits"] == {"write_bandwidth": 8 * MiB}
    assert ctl(capsys, ctl_mount.sock, "reload")[0] == 0  # back to the --policy file
    status = ctl_mount.request({"cmd": "status"})
    assert status["policy_source"] == str(ctl_mount.policy) and status["generation"] == 3


def _wait_generation(m: Mounted, generation: int) -> dict[str, Any]:
    return wait_for(f"policy generation {generation}", lambda: m.request({"cmd": "status"}),
                    until=lambda status: status["generation"] >= generation, interval=0.05)


def _wait_logged(m: Mounted, text: str) -> None:
    wait_for(f"{text!r} in the mount's log", m.mount.log, until=lambda log: text in log,
             interval=0.05)


def test_sighup_reloads_the_policy_file(ctl_mount: Mounted) -> None:
    assert ctl_mount.mount.proc is not None
    pid = ctl_mount.mount.proc.pid
    ctl_mount.policy.write_text(POLICY.replace("2MiB/s", "16MiB/s"))
    os.kill(pid, signal.SIGHUP)
    status = _wait_generation(ctl_mount, 2)
    capped = next(lv for lv in status["levels"] if lv["name"] == "capped")
    assert status["generation"] == 2 and capped["limits"] == {"write_bandwidth": 16 * MiB}
    ctl_mount.policy.write_text("[classes.default]\nwrite_bandwidth = 1\n")  # invalid
    os.kill(pid, signal.SIGHUP)
    _wait_logged(ctl_mount, "SIGHUP reload rejected")
    status = ctl_mount.request({"cmd": "status"})
    assert status["generation"] == 2 and status["last_reload_ok"] is False
    assert ctl_mount.mount.proc.poll() is None  # still serving


def test_a_failed_sighup_reload_says_why_in_status(
        ctl_mount: Mounted, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl_mount.mount.proc is not None
    ctl_mount.policy.write_text(POLICY.replace('"2MiB/s"', '"2MiB"'))  # line 6: no "/s"
    os.kill(ctl_mount.mount.proc.pid, signal.SIGHUP)
    wait_for("the reload to fail", lambda: ctl_mount.request({"cmd": "status"}),
             until=lambda status: not status["last_reload_ok"], interval=0.05)
    code, out, _ = ctl(capsys, ctl_mount.sock, "status", "--json")
    failure = json.loads(out)["last_reload_failure"]
    assert code == 0 and failure["by"] == "SIGHUP"
    assert (failure["source"], failure["line"], failure["key"]) == (
        str(ctl_mount.policy), 6, "classes.capped.write_bandwidth")
    assert failure["reason"] == 'expected a bandwidth like "400MiB/s", got "2MiB"'
    assert abs(failure["time"] - time.time()) < 60
    code, out, _ = ctl(capsys, ctl_mount.sock, "status")
    [line] = [line for line in out.splitlines() if line.startswith("LAST RELOAD FAILED")]
    assert line.endswith(f" (SIGHUP), previous policy kept: {ctl_mount.policy}:6: "
                         'classes.capped.write_bandwidth: expected a bandwidth like '
                         '"400MiB/s", got "2MiB"'), out
    # Fixed and reloaded: the failure is gone.
    ctl_mount.policy.write_text(POLICY)
    assert ctl(capsys, ctl_mount.sock, "reload")[0] == 0
    status = ctl_mount.request({"cmd": "status"})
    assert status["last_reload_ok"] is True and status["last_reload_failure"] is None


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_sighup_reload_of_a_fifo_or_endless_file_is_refused_and_serving_goes_on(
        ctl_mount: Mounted, kind: str) -> None:
    assert ctl_mount.mount.proc is not None
    ctl_mount.policy.unlink()
    if kind == "fifo":
        os.mkfifo(ctl_mount.policy)  # nobody writes: reading it would block the daemon
    else:
        ctl_mount.policy.symlink_to("/dev/zero")  # reading it would eat all memory
    os.kill(ctl_mount.mount.proc.pid, signal.SIGHUP)
    _wait_logged(ctl_mount, "SIGHUP reload rejected")
    assert "not a regular file" in ctl_mount.mount.log()
    status = ctl_mount.request({"cmd": "status"})
    assert status["generation"] == 1 and status["last_reload_ok"] is False
    (ctl_mount.mnt / "capped" / "after").write_bytes(b"still serving")
    assert (ctl_mount.src / "capped" / "after").read_bytes() == b"still serving"


UNPRIVILEGED_CLIENT = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rwb")
out = []
for line in sys.argv[2:]:
    f.write(line.encode() + b"\n")
    f.flush()
    out.append(json.loads(f.readline()))
print(json.dumps(out))
"""


@pytest.mark.root
def test_unprivileged_peer_reads_status_but_may_not_change(ctl_mount: Mounted) -> None:
    os.chmod(ctl_mount.sock, 0o666)  # let everyone connect; changes are checked per request

    requests = [{"cmd": "status"},
                {"cmd": "set", "target": "class", "name": "capped",
                 "changes": {"write_bandwidth": "1GiB/s"}},
                {"cmd": "reload"}]
    out = subprocess.run(["/usr/bin/python3", "-c", UNPRIVILEGED_CLIENT, str(ctl_mount.sock),
                          *(json.dumps(r) for r in requests)],
                         capture_output=True, text=True, preexec_fn=as_user(4242), cwd="/",
                         timeout=30)
    assert out.returncode == 0, out.stderr
    status, set_reply, reload_reply = json.loads(out.stdout)
    assert status["ok"] is True and status["generation"] == 1
    for reply in (set_reply, reload_reply):
        assert reply["ok"] is False and reply["code"] == "denied"
        assert "uid 4242 may not change the policy" in reply["error"]
    assert ctl_mount.request({"cmd": "status"})["generation"] == 1


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    return s


def _line(s: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(65536)
        assert chunk, "connection closed"
        data += chunk
    return json.loads(data)


def test_misbehaving_clients_block_neither_others_nor_the_filesystem(
        ctl_mount: Mounted) -> None:
    sock = ctl_mount.sock
    silent = _connect(sock)
    partial = _connect(sock)
    partial.sendall(b'{"cmd": "sta')
    garbage = _connect(sock)
    garbage.sendall(b"\x00\xff garbage }{\n")
    assert _line(garbage) == {"ok": False, "code": "protocol",
                              "error": "request is not UTF-8"}
    garbage.sendall(b'{"cmd": "status"}\n')  # the connection survives a bad line
    assert _line(garbage)["ok"] is True
    oversized = _connect(sock)
    try:
        oversized.sendall(b"x" * (MAX_REQUEST_BYTES + 4096))
    except BrokenPipeError:  # pragma: no cover - the server may close before we finish
        pass
    reply = _line(oversized)
    assert reply["code"] == "protocol" and "longer than" in reply["error"]
    assert oversized.recv(1) == b""  # and closed
    flooder = _connect(sock)  # asks and asks, never reads a reply
    flooder.setblocking(False)
    try:
        for _ in range(5000):
            flooder.send(b'{"cmd":"stats"}\n')
    except BlockingIOError:
        pass

    t0 = time.monotonic()
    assert ctl_mount.request({"cmd": "status"})["ok"] is True
    (ctl_mount.mnt / "free").write_bytes(b"y" * MiB)
    assert (ctl_mount.mnt / "free").read_bytes() == b"y" * MiB
    # Held out by the partial request, this would take its 10 s request timeout.
    assert time.monotonic() - t0 < 5.0
    for s in (silent, partial, garbage, oversized, flooder):
        s.close()


def _queue_depth(m: Mounted, name: str) -> int:
    levels = m.request({"cmd": "status"})["levels"]
    return int(next(lv for lv in levels if lv["name"] == name)["queue_depth"])


def test_raised_cap_takes_effect_for_a_parked_writer(ctl_mount: Mounted) -> None:
    done: list[float] = []

    def writer() -> None:
        with open(ctl_mount.mnt / "capped" / "big", "wb", buffering=0) as f:
            for _ in range(16):  # 15 s at 2 MiB/s
                f.write(b"z" * MiB)
        done.append(time.monotonic())

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        # Wait for the state the test needs (a write parked at the cap), not for a time.
        wait_for("the writer to park", lambda: _queue_depth(ctl_mount, "capped"),
                 until=lambda depth: depth >= 1, interval=0.01)
        assert not done
        reply = ctl_mount.request({"cmd": "set", "target": "class", "name": "capped",
                                   "changes": {"write_bandwidth": "1GiB/s"}})
        changed = time.monotonic()
        assert reply["ok"] is True
        thread.join(30)
    finally:
        # Whatever failed, never leave the fixture a mount kept busy at 2 MiB/s.
        ctl_mount.request({"cmd": "set", "target": "class", "name": "capped",
                           "changes": {"write_bandwidth": "1GiB/s"}})
        thread.join(30)
    assert done and done[0] - changed < 1.0, done[0] - changed
    assert (ctl_mount.src / "capped" / "big").stat().st_size == 16 * MiB


def test_metrics_after_traffic(ctl_mount: Mounted) -> None:
    (ctl_mount.mnt / "capped" / "m").write_bytes(b"m" * 3 * MiB)  # 1 s under the cap
    for _ in range(3):
        assert len((ctl_mount.mnt / "capped" / "m").read_bytes()) == 3 * MiB
    with urllib.request.urlopen(ctl_mount.metrics_url(), timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    mount = str(ctl_mount.mnt)
    # Every series names its mount (a node with several mounts reads them apart).
    assert {s.labels.get("mount") for s in samples} == {mount}

    def value(name: str, **labels: str) -> float:
        hits = [s.value for s in samples if s.name == name
                and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(hits) == 1, (name, labels, hits)
        return hits[0]

    capped = {"class": "capped", "tenant": "", "uid": ""}
    assert value("qosfs_write_bytes_total", **capped) == 3 * MiB
    # What the daemon holds against its limits (qosfs.passthrough.inodes, qosfs.qos.bounds).
    assert 1 <= value("qosfs_inode_descriptors") <= value("qosfs_inode_descriptors_budget") + 2
    assert value("qosfs_parked_requests") == 0 and value("qosfs_parking_refused_total") == 0
    assert value("qosfs_read_bytes_total", **capped) >= 3 * MiB
    assert value("qosfs_ops_total", op="write", **capped) >= 3
    assert 0.8 <= value("qosfs_throttled_seconds_total", **capped) < 5  # 2 MiB over the burst
    assert value("qosfs_request_duration_seconds_count", op="write", **capped) >= 3
    assert value("qosfs_request_duration_seconds_sum", op="write", **capped) >= 0.8
    assert value("qosfs_backend_duration_seconds_sum", op="write", **capped) < 1.0
    # A level carries the traffic's labels: a rate and its cap match on class alone.
    assert value("qosfs_queue_depth", level="class", **capped) == 0
    assert value("qosfs_limit_bytes_per_second", direction="write", level="class",
                 **capped) == 2 * MiB
    assert value("qosfs_policy_generation") == 1
    assert value("qosfs_policy_changes_total", command="reload", result="applied") == 0
    # What runs where: the build, the mount and the policy by content hash; the process.
    assert value("qosfs_build_info", version=qosfs.__version__) == 1
    assert value("qosfs_mount_info", mountpoint=mount, source=str(ctl_mount.src)) == 1
    policy = next(s for s in samples if s.name == "qosfs_policy_info")
    assert re.fullmatch(r"[0-9a-f]{16}", policy.labels["hash"])
    assert 5 <= value("process_open_fds") < value("process_max_fds")
    assert value("process_resident_memory_bytes") > 10 * MiB
    for family in ("qosfs_level_throttled_seconds_total", "qosfs_policy_last_reload_success",
                   "qosfs_backend_duration_seconds_bucket"):
        assert family in text


def test_policy_hash_follows_content_not_spelling(ctl_mount: Mounted, tmp_path: Path) -> None:
    """Two nodes with the same policy show the same hash, whatever its comments or key
    order; a change of a cap changes it (the policy-drift alert compares hashes)."""
    def policy_hash() -> str:
        with urllib.request.urlopen(ctl_mount.metrics_url(), timeout=10) as response:
            found = re.search(r'^qosfs_policy_info\{.*hash="([0-9a-f]+)".*\} 1\.0$',
                              response.read().decode(), re.MULTILINE)
        assert found
        return found[1]

    first = policy_hash()
    respelled = tmp_path / "respelled.toml"
    respelled.write_text("# the same policy, written differently\n" + POLICY.replace(
        'write_bandwidth = "2MiB/s"\nburst = "1MiB"', 'burst = "1024KiB"  # one MiB\n'
        'write_bandwidth = "2 MiB/s"'))
    assert ctl_mount.request({"cmd": "reload", "text": respelled.read_text(),
                              "source": str(respelled)})["ok"]
    assert policy_hash() == first
    changed = tmp_path / "changed.toml"
    changed.write_text(POLICY.replace("2MiB/s", "3MiB/s"))
    assert ctl_mount.request({"cmd": "reload", "text": changed.read_text(),
                              "source": str(changed)})["ok"]
    assert policy_hash() != first


def test_top_once(ctl_mount: Mounted, capsys: pytest.CaptureFixture[str]) -> None:
    (ctl_mount.mnt / "capped" / "once").write_bytes(b"o" * 4096)
    assert cli.main(["top", "--socket", str(ctl_mount.sock), "--once"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert re.search(r"^CLASS\s+TENANT\s+UID\s+LIMITS\s+IO/s\s+READ/s\s+WRITE/s", out,
                     re.MULTILINE), out
    assert re.search(r"^capped\s+w:2MiB/s\s", out, re.MULTILINE), out


def test_no_qos_mount_has_status_but_nothing_to_change(
        tmp_tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir()
    mnt.mkdir()
    sock = tmp_tree / "ctl.sock"
    with QosfsMount(src, mnt, "--no-qos", "--socket", str(sock)):
        (mnt / "f").write_bytes(b"n" * 4096)
        code, out, _ = ctl(capsys, sock, "status")
        assert code == 0 and "no policy: mounted with --no-qos" in out
        code, _, err = ctl(capsys, sock, "set", "default", "write_bandwidth=1MiB/s")
        assert code == 7 and "no policy (mounted with --no-qos)" in err
        code, out, _ = ctl(capsys, sock, "stats", "--json")
        assert json.loads(out)["accounts"][0]["write_bytes"] == 4096


def test_default_socket_is_derived_from_the_mountpoint(
        tmp_tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir()
    mnt.mkdir()
    expected = Path(default_socket_path(str(mnt)))
    with QosfsMount(src, mnt):
        assert expected.exists()
        code, out, _ = ctl(capsys, mnt, "status")  # --socket MOUNTPOINT
        assert code == 0 and str(mnt) in out
    assert not expected.exists()


def test_a_socket_in_use_is_refused_before_mounting(ctl_mount: Mounted,
                                                    tmp_tree: Path) -> None:
    src, mnt = tmp_tree / "src2", tmp_tree / "mnt2"
    src.mkdir()
    mnt.mkdir()
    try:
        out = subprocess.run([sys.executable, "-m", "qosfs", "mount", str(src), str(mnt),
                              "--socket", str(ctl_mount.sock)],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        if is_mounted(mnt):  # pragma: no cover - only if the refusal is broken
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
    assert out.returncode == 7
    assert out.stderr == (f"qosfs: control socket {ctl_mount.sock} is in use by a running "
                          "qosfs daemon; pass another --socket\n")
    assert not is_mounted(mnt)
    assert ctl_mount.request({"cmd": "status"})["ok"] is True


def test_many_clients_and_chunked_garbage_leave_the_daemon_serving_and_the_policy_as_it_was(
        ctl_mount: Mounted) -> None:
    import random

    from tests.unit.control.test_protocol import _INSERTS, _VALID_LINES

    before = policy_view(ctl_mount.request({"cmd": "status"}))
    rnd = random.Random(7)
    # More simultaneous connections than the daemon admits: the rest are told "busy".
    crowd: list[socket.socket] = []
    try:
        while len(crowd) < 300:
            crowd.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            crowd[-1].connect(str(ctl_mount.sock))  # blocking: the listen backlog is 64
            crowd[-1].settimeout(10)
        for s in crowd:
            s.sendall(b'{"cmd":"status"}\n')
        codes = []
        for s in crowd:
            reply = _line(s)
            codes.append("ok" if reply["ok"] else reply["code"])
    finally:
        for s in crowd:
            s.close()
    assert codes.count("ok") >= 200 and set(codes) <= {"ok", "busy"}, set(codes)
    # Hostile lines, a few rejected changes among them, split at random points.
    sent = 0
    for _ in range(20):
        s = _connect(ctl_mount.sock)
        lines = []
        for _ in range(10):
            line = bytearray(rnd.choice(_VALID_LINES))
            for _ in range(rnd.randrange(0, 4)):
                at = rnd.randrange(len(line) + 1)
                line[at:at + rnd.randrange(8)] = rnd.choice([*_INSERTS, rnd.randbytes(5)])
            line = line.replace(b"\n", b" ").replace(b'"reload"', b'"status"')
            if b'"set"' in line:  # a change that can only be refused
                line = line.replace(b'"1MiB/s"', b'"-1MiB/s"').replace(b"2000", b"-2")
            lines.append(bytes(line) + b"\n")
        data = b"".join(lines)
        while data:
            cut = rnd.randrange(1, 64)
            s.sendall(data[:cut])
            data = data[cut:]
        expected = sum(1 for x in lines if x.strip().rstrip(b"\r").strip())
        buf = b""
        while buf.count(b"\n") < expected:
            chunk = s.recv(65536)
            assert chunk, "connection closed"
            buf += chunk
        replies = [json.loads(x) for x in buf.splitlines()]
        for reply in replies:
            assert reply["ok"] or reply["code"] in ("protocol", "policy"), reply
        sent += len(replies)
        s.close()
    assert sent >= 190
    assert policy_view(ctl_mount.request({"cmd": "status"})) == before
    (ctl_mount.mnt / "after").write_bytes(b"a" * MiB)
    assert (ctl_mount.mnt / "after").read_bytes() == b"a" * MiB
    assert ctl_mount.mount.proc is not None and ctl_mount.mount.proc.poll() is None
    assert not re.search(r" (ERROR|WARNING) ", ctl_mount.mount.log()), ctl_mount.mount.log()


def _scrape(url: str, **headers: str) -> tuple[bytes, Any]:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read(), response.headers


def test_metrics_speak_openmetrics_and_gzip_when_asked(ctl_mount: Mounted) -> None:
    """What Prometheus asks for (OpenMetrics, gzip) is what it gets, and each form holds
    the same series; a plain client still gets the classic text."""
    (ctl_mount.mnt / "capped" / "om").write_bytes(b"o" * MiB)
    url = ctl_mount.metrics_url()
    plain, headers = _scrape(url)
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert headers["Content-Encoding"] is None
    prometheus_accept = ("application/openmetrics-text;version=1.0.0,application/"
                         "openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;"
                         "q=0.5,*/*;q=0.1")
    body, headers = _scrape(url, Accept=prometheus_accept, **{"Accept-Encoding": "gzip"})
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert headers["Content-Encoding"] == "gzip"
    text = gzip.decompress(body).decode()
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in openmetrics_families(text)}
    written = [s.value for s in families["qosfs_write_bytes"].samples
               if s.name == "qosfs_write_bytes_total" and s.labels["class"] == "capped"]
    assert written == [MiB]
    assert families["qosfs_build"].type == "info"
    def series(fams: Any) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
        return {(s.name, tuple(sorted(s.labels.items()))) for f in fams for s in f.samples
                if not s.name.startswith("process_")}  # CPU and memory move between scrapes

    assert series(families.values()) == series(text_string_to_metric_families(plain.decode()))
    print(f"exposition {len(plain)} bytes, gzipped {len(body)}")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (prometheus) missing")
def test_promtool_finds_the_exposition_clean(ctl_mount: Mounted) -> None:
    """``promtool check metrics`` (naming, units, help) on a live mount's exposition with
    every family present: traffic, a capped level, a tenant, the identity families."""
    (ctl_mount.mnt / "capped" / "lint").write_bytes(b"l" * MiB)
    os.chmod(ctl_mount.src / "capped", 0o777)
    subprocess.run(["sh", "-c", "echo t > tenant"],
                   cwd=ctl_mount.mnt / "capped", preexec_fn=as_user(4242), check=True)
    plain, _ = _scrape(ctl_mount.metrics_url())
    checked = subprocess.run(["promtool", "check", "metrics"], input=plain,
                             capture_output=True)
    assert checked.returncode == 0 and not checked.stdout.strip() \
        and not checked.stderr.strip(), (checked.stdout, checked.stderr)


def test_metrics_listen_on_loopback_only_by_default(ctl_mount: Mounted) -> None:
    url = ctl_mount.metrics_url()  # the fixture passes --metrics 0: no host given
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert url.startswith("http://127.0.0.1:")
    with open("/proc/net/tcp") as f:
        listening = [line.split()[1] for line in f.readlines()[1:]
                     if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == port]
    assert listening == [f"0100007F:{port:04X}"]


ADMIN_CLIENT = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print(json.dumps({"connect": exc.errno}))
    raise SystemExit
f = s.makefile("rwb")
f.write(sys.argv[2].encode() + b"\n")
f.flush()
print(f.readline().decode())
"""


@pytest.mark.root
def test_socket_admits_root_and_the_admin_group_only(tmp_tree: Path) -> None:
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir()
    mnt.mkdir()
    policy = tmp_tree / "policy.toml"
    policy.write_text("[control]\nadmin_group = 4300\n[classes.default]\n")
    sock = tmp_tree / "ctl.sock"
    change = json.dumps({"cmd": "set", "target": "class", "name": "default",
                         "changes": {"write_bandwidth": "1GiB/s"}})

    def client(uid: int, groups: list[int]) -> dict[str, Any]:
        out = subprocess.run(["/usr/bin/python3", "-c", ADMIN_CLIENT, str(sock), change],
                             capture_output=True, text=True,
                             preexec_fn=as_user(uid, groups=groups), cwd="/",
                             timeout=30, check=True)
        return json.loads(out.stdout)

    with QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock)):
        st = os.stat(sock)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, 4300)
        assert client(4244, []) == {"connect": 13}  # EACCES: not in the group
        member = client(4242, [4300])
        assert member["ok"] is True, member  # a member may change limits
        with Client(str(sock)) as root:
            reply = root.request({"cmd": "reload", "text": "[classes.default]\n"})
            assert reply["ok"] is True
            assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600  # group removed: root only
            assert client(4242, [4300]) == {"connect": 13}
            assert root.request({"cmd": "status"})["generation"] == 3


# Opens N connections to a Unix socket or a TCP port, sends each one byte, prints
# "held" and keeps them (a slowloris) until killed.
HOLDER = r"""
import socket, sys, time
target, n = sys.argv[1], int(sys.argv[2])
held = []
for _ in range(n):
    try:  # the daemon refuses (closes) connections past a user's share: keep going
        if target.isdigit():
            s = socket.create_connection(("127.0.0.1", int(target)))
        else:
            s = socket.socket(socket.AF_UNIX)
            s.connect(target)
        held.append(s)
        s.sendall(b"{" if not target.isdigit() else b"G")
    except OSError:
        pass
print("held", flush=True)
time.sleep(60)
"""


def _hold(target: str, n: int, uid: int) -> subprocess.Popen[str]:
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    proc = subprocess.Popen([python, "-c", HOLDER, target, str(n)], cwd="/", text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            preexec_fn=as_user(uid))
    return proc


@pytest.mark.root
def test_users_holding_slow_connections_never_lock_out_root_or_the_scraper(
        ctl_mount: Mounted, capsys: pytest.CaptureFixture[str]) -> None:
    os.chmod(ctl_mount.sock, 0o666)  # as docs/control-and-metrics.md suggests, for top
    port = ctl_mount.metrics_url().rsplit(":", 1)[1].split("/")[0]
    holders = [_hold(str(ctl_mount.sock), 16, 5100 + i) for i in range(40)]
    holders.append(_hold(port, 200, 5200))
    try:
        for h in holders:
            assert h.stdout is not None and h.stdout.readline().strip() == "held"
        start = time.monotonic()
        code, out, _ = ctl(capsys, ctl_mount.sock, "status")
        assert code == 0 and "capped" in out
        assert time.monotonic() - start < 5.0  # held out: the 10 s request timeout at least
        start = time.monotonic()
        with urllib.request.urlopen(ctl_mount.metrics_url(), timeout=10) as response:
            assert response.status == 200 and b"qosfs_" in response.read()
        assert time.monotonic() - start < 5.0  # held out: the 10 s request timeout
    finally:
        for h in holders:
            h.kill()
            h.wait()
            assert h.stdout is not None
            h.stdout.close()


def _class_total(url: str, metric: str, cls: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(m[1]) for m in re.finditer(
        rf'^{metric}\{{class="{cls}"[^}}]*\}} (\S+)$', text, re.MULTILINE))


def test_a_per_user_toggle_keeps_the_class_totals(ctl_mount: Mounted) -> None:
    """ctl set per_user=fair made a class's recorded writes vanish from stats and /metrics
    (and toggling back did it again)."""
    url = ctl_mount.metrics_url()
    (ctl_mount.mnt / "capped" / "t").write_bytes(b"t" * 2 * MiB)
    assert _class_total(url, "qosfs_write_bytes_total", "capped") == 2 * MiB
    for per_user, written in (("fair", 3), ("none", 4)):
        reply = ctl_mount.request({"cmd": "set", "target": "class", "name": "capped",
                                   "changes": {"per_user": per_user}})
        assert reply["ok"], reply
        assert _class_total(url, "qosfs_write_bytes_total", "capped") == (written - 1) * MiB
        with open(ctl_mount.mnt / "capped" / "t", "ab") as f:
            f.write(b"t" * MiB)
        assert _class_total(url, "qosfs_write_bytes_total", "capped") == written * MiB


EVERY_SETTING = """
[backend]
read_bandwidth = "8GiB/s"
write_bandwidth = "4GiB/s"
[metrics]
user_series = 50
user_series_idle = "2m"
[tenants.team]
uids = ["4242-4250"]
job_env = "POD_NAMESPACE"
jobs = ["team-*"]
write_bandwidth = "1GiB/s"
[classes.datasets]
paths = ["data/**"]
ops = ["read"]
priority = "high"
min_read_bandwidth = "1GiB/s"
cache = "keep"
target_read_latency = "5ms"
latency_percentile = 95
entry_timeout = "30s"
attr_timeout = "30s"
[classes.checkpoints]
paths = ["ckpt/**", "**/*.pt"]
priority = "low"
per_user = "fair"
write_bandwidth = "400MiB/s"
burst = "64MiB"
detect_streaming_writes = "256MiB"
[classes.default]
priority = 3
"""


def test_status_json_round_trips_every_setting(tmp_tree: Path) -> None:
    """``ctl status --json`` holds every setting in force, in the policy's own keys: built
    back into a policy it is the one in force, after a live change too; ``status`` shows
    the settings beyond caps as text."""
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir(), mnt.mkdir()
    policy_file = tmp_tree / "every.toml"
    policy_file.write_text(EVERY_SETTING)
    sock = tmp_tree / "ctl.sock"

    def status(*extra: str) -> str:
        done = subprocess.run([sys.executable, "-m", "qosfs", "ctl", "--socket", str(sock),
                               "status", *extra], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout

    m = QosfsMount(src, mnt, "--policy", str(policy_file), "--socket", str(sock))
    m.start()
    try:
        in_force = build_policy(json.loads(status("--json"))["policy"], str(policy_file))
        assert in_force.render() == load_policy(policy_file).render()
        code = cli.main(["ctl", "--socket", str(sock), "set", "checkpoints",
                         "write_bandwidth=300MiB/s"])
        assert code == 0
        reply = json.loads(status("--json"))
        changed = build_policy(reply["policy"], str(policy_file))
        assert changed.render() == with_changes(
            load_policy(policy_file), "class", "checkpoints",
            {"write_bandwidth": "300MiB/s"}).render()
        assert reply["policy"]["classes"]["checkpoints"]["write_bandwidth"] == "300MiB/s"
        text = status()
        datasets = next(line for line in text.splitlines() if line.startswith("datasets "))
        for shown in ("high", "keep", "min_read_bandwidth=1GiB/s", "target_read_latency=5ms",
                      "latency_percentile=95", "paths=data/**"):
            assert shown in datasets, (shown, text)
        checkpoints = next(line for line in text.splitlines()
                           if line.startswith("checkpoints "))
        assert "fair" in checkpoints and "detect_streaming_writes=256MiB" in checkpoints
        assert re.search(r"^team +uids=4242-4250 job_env=POD_NAMESPACE jobs=team-\*",
                         text, re.MULTILINE), text
    finally:
        assert m.stop() == 0, m.log()
