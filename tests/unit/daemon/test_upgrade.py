"""The pure parts of ``qosfs upgrade`` (qosfs.daemon.takeover.offer,
qosfs.daemon.takeover.upgrade): where the handover socket is, the mount's configuration
and an open's charge as they travel, and a successor speaking another protocol refused
before anything is sent: the build before's (protocol 1 only: a rollback) with the reason,
while this build's successor says what that build's daemon accepts."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from qosfs.daemon.config import MountConfig
from qosfs.daemon.takeover import fuse_session
from qosfs.daemon.takeover.offer import (
    PROTOCOL,
    PROTOCOLS,
    VERSION_ENV,
    HandoverOffer,
    adopt_hello,
    chosen_protocol,
    config_payload,
    daemon_version,
    handover_socket_path,
)
from qosfs.daemon.takeover.upgrade import config_from_payload
from qosfs.passthrough.operations import FsOptions
from qosfs.policy.loading import parse_policy
from qosfs.qos.charge import MAX_WRITE, OpenCharge
from qosfs.qos.engine import PolicyQos
from tests.unit.qos.test_engine import open_charge

MiB = 1 << 20


def test_the_handover_socket_is_beside_the_control_socket() -> None:
    assert handover_socket_path("/run/qosfs/mnt-x.sock") == "/run/qosfs/mnt-x.handover"
    assert handover_socket_path("/tmp/ctl") == "/tmp/ctl.handover"


def test_the_version_can_be_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VERSION_ENV, "9.9-test")
    assert daemon_version() == "9.9-test"
    monkeypatch.delenv(VERSION_ENV)
    import qosfs

    assert daemon_version() == qosfs.__version__


def test_the_mounts_configuration_travels_as_json_and_back() -> None:
    cfg = MountConfig("/srv", "/mnt", fuse_options=("ro", "allow_other"), io_mode="threads",
                      fs_options=FsOptions(entry_timeout=2.0, cache="never", fd_budget=99),
                      policy_path="/etc/p.toml", metrics="9100", kernel_passthrough=False)
    raw = json.loads(json.dumps(config_payload(cfg)))
    assert config_from_payload(raw, foreground=True) == MountConfig(
        **{**vars_of(cfg), "foreground": True})
    with pytest.raises(fuse_session.HandoverError, match="not this version's"):
        config_from_payload({**raw, "added_later": 1}, foreground=False)


def vars_of(cfg: MountConfig) -> dict[str, Any]:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def test_an_opens_charge_continues_where_it_stood() -> None:
    qos = PolicyQos(parse_policy("""
[classes.ckpt]
paths = ["ckpt/**"]
write_bandwidth = "1GiB/s"
[classes.streaming]
paths = ["stream/**"]
write_bandwidth = "100MiB/s"
detect_streaming_writes = "64MiB"
"""))
    charge = open_charge(qos, "bulk/f")  # the default class: uncapped, watched
    charge.wrote(0, MAX_WRITE)  # 1 MiB of the 64 in sequence
    state = json.loads(json.dumps(charge.export_state()))
    flow = qos.flow_from_key(json.loads(json.dumps(qos.flow_key(charge.flow))))
    assert flow is charge.flow
    before = flow.open_files
    again = OpenCharge.restore(qos, flow, SimpleNamespace(qos_memo=None), state)
    assert flow.open_files == before + 1
    assert again.export_state() == charge.export_state() and again.watching
    for off in range(MAX_WRITE, 64 * MiB, MAX_WRITE):
        again.wrote(off, MAX_WRITE)
    assert again.flow.class_name == "streaming"  # moved once 64 MiB came in sequence
    assert qos.flow_from_key(["gone", None, 0]).class_name == "default"


class _Daemon:
    """What the offer reads of the daemon before a successor is ready."""

    mountpoint = "/mnt"
    root_fd = -1
    engine = SimpleNamespace(policy=None)
    fs = None
    latency = None
    handovers = 0
    listeners = None
    fuse_options: frozenset[str] = frozenset()
    config = MountConfig("/srv", "/mnt")

    def __init__(self) -> None:
        self.handover_failures = {"refused": 0, "taken_back": 0}


@pytest.fixture
def offer(tmp_path: Path) -> Iterator[HandoverOffer]:
    with ExitStack() as stack:
        made = HandoverOffer.open(_Daemon(), str(tmp_path / "q.sock"), stack)  # type: ignore[arg-type]
        if made is None:
            pytest.skip("handover unavailable in this build")
        assert made.path == str(tmp_path / "q.handover")
        assert os.stat(made.path).st_mode & 0o777 == 0o600
        yield made
    assert not os.path.exists(tmp_path / "q.handover")  # removed with the stack


def test_a_successor_of_another_protocol_is_refused_and_nothing_is_sent(
        offer: HandoverOffer, caplog: pytest.LogCaptureFixture) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        fuse_session.send_message(theirs, "adopt", {"protocol": PROTOCOL + 1})
        assert not offer._prepare(ours, *offer._prepare_payload())
        reply = fuse_session.receive_message(theirs)
    (record,) = [r for r in caplog.records if "refused, serving on" in r.getMessage()]
    record.expected = True  # type: ignore[attr-defined]
    assert reply.kind == "refused" and reply.fds == []
    assert "protocol" in reply.payload["reason"]
    assert offer.daemon.handover_failures == {"refused": 1, "taken_back": 0}


def test_the_protocol_is_negotiated_from_the_successors_hello() -> None:
    hello = adopt_hello()
    # What the build before's daemon checks (equality with its 1), and what this one reads.
    assert hello["protocol"] == 1 and hello["protocols"] == [1, 2] == list(PROTOCOLS)
    assert hello["pid"] == os.getpid() and hello["version"] == daemon_version()
    assert PROTOCOL == 2
    assert chosen_protocol(json.loads(json.dumps(hello))) == PROTOCOL
    assert chosen_protocol({"protocol": 1, "protocols": [2, 3]}) == PROTOCOL  # a later build
    assert chosen_protocol({"protocol": 2}) == PROTOCOL  # names no list: speaks the one
    for hello in ({"protocol": 3}, {"protocol": 1, "protocols": [1, 3]}, {}):
        with pytest.raises(fuse_session.HandoverError, match="is not this daemon's"):
            chosen_protocol(hello)


def test_the_build_before_is_refused_at_the_hello_with_the_reason(
        offer: HandoverOffer, caplog: pytest.LogCaptureFixture) -> None:
    """A rollback: that build's successor says protocol 1 alone, and cannot read this
    build's payload. It is told so before anything is sent; this daemon serves on."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        fuse_session.send_message(theirs, "adopt", {"protocol": 1, "version": "0.9",
                                                    "pid": os.getpid()})
        assert not offer._prepare(ours, *offer._prepare_payload())
        reply = fuse_session.receive_message(theirs)
    (record,) = [r for r in caplog.records if "refused, serving on" in r.getMessage()]
    record.expected = True  # type: ignore[attr-defined]
    assert reply.kind == "refused" and reply.fds == []
    assert reply.payload["reason"] == (
        "the successor (qosfs 0.9) speaks handover protocol 1 only: a build from before "
        "protocol 2, which this daemon hands over in, cannot take the mount over live "
        "(unmount, then mount with that build)")
    assert reply.payload["reason"] in record.getMessage()
    assert offer.daemon.handover_failures == {"refused": 1, "taken_back": 0}


def test_descriptors_inherited_under_the_mount_are_closed(tmp_path: Path) -> None:
    from qosfs.daemon.takeover.upgrade import close_inherited

    (tmp_path / "mnt").mkdir()
    (tmp_path / "mnt" / "f").write_text("x")
    (tmp_path / "other").write_text("y")
    under = os.open(tmp_path / "mnt" / "f", os.O_RDONLY)
    beside = os.open(tmp_path / "other", os.O_RDONLY)
    try:
        close_inherited(str(tmp_path / "mnt"))
        with pytest.raises(OSError):
            os.fstat(under)
        os.fstat(beside)  # not under the mount: kept
    finally:
        os.close(beside)


def test_bucket_balances_carry_debt_over_to_another_engine_and_event_loop() -> None:
    """What commit sends and the successor's loop puts in force: a class in debt stays in
    debt (trio's clock differs per run: the times travel on time.monotonic())."""
    import time

    import trio

    from qosfs.qos.levels import Kind

    policy = parse_policy('[classes.ckpt]\npaths = ["ckpt/**"]\n'
                          'write_bandwidth = "1MiB/s"\nburst = "1MiB"\n')
    old = PolicyQos(policy)

    async def spend() -> list[list[Any]]:
        old.classes["ckpt"].level.charge(Kind.WRITE, 3 * MiB, trio.current_time())
        return old.export_balances(time.monotonic() - trio.current_time())

    balances = json.loads(json.dumps(trio.run(spend)))
    new = PolicyQos(policy)

    async def take() -> tuple[int, float, float]:
        now = trio.current_time()
        fresh = new.classes["ckpt"].level.delay(Kind.WRITE, MiB, now)
        taken = new.import_balances(balances, now - time.monotonic())
        return taken, fresh, new.classes["ckpt"].level.delay(Kind.WRITE, MiB, now)

    taken, fresh, delay = trio.run(take)
    assert taken == 1
    assert fresh == 0.0  # a full burst: what the successor had without the balances
    assert 2.5 < delay <= 3.0  # 2 MiB of debt, then the 1 MiB asked, at 1 MiB/s
