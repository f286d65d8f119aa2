"""sd_notify without libsystemd, and the reload hook that uses it."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from qosfs.control.protocol import ReloadRequest
from qosfs.control.service import ControlService
from qosfs.daemon.notify import notify, reloading
from qosfs.policy.loading import parse_policy
from qosfs.qos.engine import PolicyQos


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(5)
    yield sock
    sock.close()


def test_no_socket_is_a_quiet_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert notify("READY=1") is False


def test_sends_one_datagram_to_a_path(monkeypatch: pytest.MonkeyPatch,
                                      receiver: socket.socket) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", receiver.getsockname())
    assert notify("READY=1\nSTATUS=serving") is True
    assert receiver.recv(4096) == b"READY=1\nSTATUS=serving"


def test_abstract_namespace_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"qosfs-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("STOPPING=1") is True
        assert sock.recv(4096) == b"STOPPING=1"


@pytest.mark.parametrize("address", ["vsock:2:1234", "/nonexistent/notify", "@qosfs-nobody"])
def test_unusable_socket_returns_false_without_raising(monkeypatch: pytest.MonkeyPatch,
                                                      address: str) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    assert notify("READY=1") is False


def test_reloading_carries_the_monotonic_timestamp() -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    lines = reloading().split("\n")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert lines[0] == "RELOADING=1"
    key, _, value = lines[1].partition("=")
    assert key == "MONOTONIC_USEC" and before <= int(value) <= after


def test_every_reload_is_bracketed_by_the_hook(tmp_path: Path) -> None:
    """Accepted or rejected, a reload enters and leaves the hook exactly once."""
    text = '[classes.ckpt]\npaths = ["ckpt/**"]\nwrite_bandwidth = "1MiB/s"\n'
    engine = PolicyQos(parse_policy(text, "test.toml"))
    ctl = ControlService(engine)
    events: list[str] = []

    class Hook:
        def __enter__(self) -> None:
            events.append(f"enter gen={engine.generation}")

        def __exit__(self, *exc: object) -> None:
            events.append(f"exit gen={engine.generation}")

    ctl.reloading = Hook

    async def main() -> None:
        ok = await ctl.reload(ReloadRequest(text=text.replace("1MiB", "2MiB")), "test")
        bad = await ctl.reload(ReloadRequest(text="[classes.x]\nbogus = 1\n"), "test")
        assert ok["ok"] and not bad["ok"]

    trio.run(main)
    assert events == ["enter gen=1", "exit gen=2", "enter gen=2", "exit gen=2"]
