"""qosfs.daemon.takeover.fuse_session without a mount: why a handover is unavailable, the state's
checks, and messages with descriptors over a real socket pair."""

from __future__ import annotations

import errno
import os
import socket
import threading
import types
from typing import Any

import pytest

from qosfs.daemon.takeover import fuse_session

STATE = dict.fromkeys(fuse_session.STATE_KEYS, 1) | {"proto_major": 7, "proto_minor": 45}


def test_unpatched_pyfuse3_says_why() -> None:
    reason = fuse_session.unavailable_reason(types.SimpleNamespace())
    assert reason is not None and "adopt patch" in reason
    with pytest.raises(fuse_session.HandoverError, match="handover unavailable: pyfuse3 lacks"):
        fuse_session.export_session(types.SimpleNamespace())


def test_pyfuse3_on_the_systems_libfuse_says_why() -> None:
    binding = types.SimpleNamespace(init_adopted=lambda *a: None, ADOPT_SUPPORTED=False)
    reason = fuse_session.unavailable_reason(binding)
    assert reason is not None and "without fuse_session_adopt" in reason


class FakeBinding:
    """pyfuse3's adopt API as the patch adds it."""

    ADOPT_SUPPORTED = True

    def __init__(self, fail: int | None = None) -> None:
        self.fail = fail
        self.adopted: list[tuple[Any, ...]] = []

    def session_state(self) -> dict[str, int]:
        if self.fail:
            raise OSError(self.fail, os.strerror(self.fail))
        return dict(STATE)

    def get_session_fd(self) -> int:
        return 9

    def init_adopted(self, *args: Any) -> None:
        self.adopted.append(args)

    def notify_resend(self) -> None:
        if self.fail:
            raise OSError(self.fail, os.strerror(self.fail))


def test_export_before_init_is_a_clear_error() -> None:
    assert fuse_session.export_session(FakeBinding()) == fuse_session.Session(9, STATE)
    with pytest.raises(fuse_session.HandoverError, match="Transport endpoint"):
        fuse_session.export_session(FakeBinding(fail=errno.ENOTCONN))


def test_resend_on_an_old_kernel_is_a_clear_error() -> None:
    with pytest.raises(fuse_session.HandoverError, match="FUSE_NOTIFY_RESEND refused"):
        fuse_session.resend(FakeBinding(fail=errno.ENOSYS))


@pytest.mark.parametrize("change", [{"want_ext": None}, {"max_write": -1},
                                    {"proto_minor": "45"}, {"no_interrupt": True}])
def test_a_state_that_is_not_counts_is_refused(change: dict[str, Any]) -> None:
    state: dict[str, Any] = dict(STATE)
    for key, value in change.items():
        if value is None:
            del state[key]
        else:
            state[key] = value
    with pytest.raises(fuse_session.HandoverError, match="session state"):
        fuse_session.check_state(state)
    assert fuse_session.check_state(STATE) == STATE


def test_adopt_refuses_a_descriptor_that_is_not_dev_fuse() -> None:
    binding = FakeBinding()
    r, w = os.pipe()
    try:
        with pytest.raises(fuse_session.HandoverError, match="is not /dev/fuse"):
            fuse_session.adopt(object(), fuse_session.Session(r, STATE),  # type: ignore[arg-type]
                               None, (), binding)
    finally:
        os.close(r)
        os.close(w)
    assert binding.adopted == []


def test_messages_carry_payload_and_descriptors() -> None:
    a, b = socket.socketpair()
    r, w = os.pipe()
    with a, b:
        big = {"inodes": list(range(50_000))}  # more than the socket buffers: a sender thread
        sender = threading.Thread(target=fuse_session.send_message, args=(a, "commit", big, [r, w]))
        sender.start()
        message = fuse_session.receive_message(b)
        sender.join()
        assert message.kind == "commit" and message.payload == big
        assert len(message.fds) == 2
        os.write(message.fds[1], b"x")
        assert os.read(r, 1) == b"x"  # the same pipe, through a descriptor of our own
        assert all(not os.get_inheritable(fd) for fd in message.fds)
        for fd in (r, w, *message.fds):
            os.close(fd)


def test_a_peer_that_closes_mid_message_is_a_clear_error() -> None:
    a, b = socket.socketpair()
    with b:
        a.sendall(fuse_session._HEADER.pack(100, 0) + b"{")
        a.close()
        with pytest.raises(fuse_session.HandoverError, match="mid-message"):
            fuse_session.receive_message(b)
