"""qosfs.passthrough.kernel without a mount: the per-inode backing ids and the reasons
passthrough is unavailable, against a stand-in for pyfuse3's passthrough API."""

from __future__ import annotations

import errno
import types

import pyfuse3
import pytest

from qosfs.passthrough import kernel
from qosfs.passthrough.kernel import KernelPassthrough


class FakeBinding:
    """pyfuse3's passthrough API as the patch adds it, with the kernel's answers chosen."""

    PASSTHROUGH_SUPPORTED = True

    def __init__(self, negotiated: bool = True, refuse: int | None = None) -> None:
        self.negotiated = negotiated
        self.refuse = refuse
        self.open_ids: set[int] = set()
        self.next_id = 1

    def passthrough_negotiated(self) -> bool:
        return self.negotiated

    def passthrough_open(self, fd: int) -> int:
        if self.refuse is not None:
            raise OSError(self.refuse, "refused")
        self.next_id += 1
        self.open_ids.add(self.next_id)
        return self.next_id

    def passthrough_close(self, backing_id: int) -> None:
        self.open_ids.remove(backing_id)


@pytest.fixture(autouse=True)
def _as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "has_cap_sys_admin", lambda: True)


def test_opens_of_one_inode_share_one_id_released_by_the_last() -> None:
    binding = FakeBinding()
    kp = KernelPassthrough(binding)
    first = kp.register(7, fd=10)
    assert first is not None
    assert kp.register(7, fd=11) == first
    other = kp.register(8, fd=12)
    assert other not in (None, first)
    kp.unregister(7)
    assert binding.open_ids == {first, other}
    kp.unregister(7)
    kp.unregister(8)
    assert binding.open_ids == set()
    assert kp.statistics() == kernel.PassthroughStats(live=0, registered=2, refused=0,
                                                      last_refusal=None)


def test_a_refusal_returns_none_and_is_counted() -> None:
    kp = KernelPassthrough(FakeBinding(refuse=errno.ELOOP))
    assert kp.register(7, fd=10) is None
    assert kp.register(7, fd=10) is None
    kp.unregister(7)  # a release of an open that got no id: nothing to do
    s = kp.statistics()
    assert (s.live, s.registered, s.refused, s.last_refusal) == (0, 0, 2, "ELOOP")


@pytest.mark.parametrize(("binding", "reason"), [
    (types.SimpleNamespace(), "lacks the passthrough patch"),
    (types.SimpleNamespace(PASSTHROUGH_SUPPORTED=False, passthrough_open=print),
     "older than 3.17"),
    (FakeBinding(negotiated=False), "did not accept passthrough"),
])
def test_unavailable_says_why_and_registers_nothing(binding: object, reason: str) -> None:
    kp = KernelPassthrough(binding)
    cap = kp.capability()
    assert not cap.available and reason in cap.reason
    assert kp.register(7, fd=10) is None
    assert kp.statistics().refused == 0


def test_without_cap_sys_admin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "has_cap_sys_admin", lambda: False)
    cap = KernelPassthrough(FakeBinding()).capability()
    assert not cap.available and "CAP_SYS_ADMIN" in cap.reason


def test_request_asks_at_init_without_the_writeback_cache() -> None:
    ops = pyfuse3.Operations()
    ops.enable_writeback_cache = True
    kernel.request(ops, stack_depth=1)
    assert vars(ops) == {"enable_writeback_cache": False, "enable_passthrough": True,
                         "max_backing_stack_depth": 1}
    with pytest.raises(ValueError, match="stack_depth must be 0 or 1, not 2"):
        kernel.request(ops, stack_depth=2)


def test_an_inode_is_passed_through_or_served_never_both() -> None:
    kp = KernelPassthrough(FakeBinding())
    assert kp.plain_open(7)
    assert kp.register(7, fd=10) is None  # the daemon serves inode 7: declined
    assert kp.statistics().declined == 1 and kp.statistics().refused == 0
    kp.plain_release(7)
    backing_id = kp.register(7, fd=11)
    assert backing_id is not None
    assert not kp.plain_open(7)  # passed through now: the caller shares or refuses
    assert kp.register(7, fd=12) == backing_id
    kp.unregister(7)
    kp.unregister(7)
    assert kp.plain_open(7)
    kp.plain_release(7)
    kp.plain_release(7)  # an extra release changes nothing
    assert kp.register(7, fd=13) is not None


@pytest.mark.parametrize(("fstype", "depth"), [
    ("ext4", 0), ("tmpfs", 0), (None, 0), ("nfs4", 0), ("overlay", 1), ("fuse", 1),
    ("fuse.sshfs", 1), ("fuseblk", 1), ("fuse.qosfs", 1), ("ecryptfs", 1)])
def test_stack_depth_is_one_for_a_stacking_filesystem(fstype: str | None, depth: int) -> None:
    assert kernel.stack_depth(fstype) == depth
