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


def test_opens_of_one_inode_share_one_id_kept_idle_after_the_last() -> None:
    binding = FakeBinding()
    kp = KernelPassthrough(binding)
    closed: list[int] = []
    kp.on_close = closed.append
    first = kp.register(7, fd=10)
    assert first is not None
    assert kp.register(7, fd=11) == first
    other = kp.register(8, fd=12)
    assert other not in (None, first)
    kp.unregister(7, now=0.0)
    assert binding.open_ids == {first, other}
    kp.unregister(7, now=1.0)
    kp.unregister(8, now=2.0)
    assert binding.open_ids == {first, other}  # both idle, still registered
    assert kp.backing_id(7) is None  # an idle id is not shared with a served open
    assert kp.statistics() == kernel.PassthroughStats(live=0, registered=2, refused=0,
                                                      last_refusal=None, idle=2)
    assert kp.register(7, fd=13) == first  # reused: nothing registered
    assert binding.open_ids == {first, other} and kp.statistics().reused == 1
    kp.unregister(7, now=3.0)
    assert kp.expire(now=1.9 + kernel.IDLE_SECONDS) == []  # none is due yet
    assert kp.expire(now=2.5 + kernel.IDLE_SECONDS) == [8]  # idle since 2.0: due
    assert binding.open_ids == {first} and closed == [8]
    assert kp.drop_idle(7) and not kp.drop_idle(7)  # the kernel forgot it, say
    assert binding.open_ids == set() and closed == [8, 7]
    assert kp.statistics().idle == 0


def test_idle_ids_beyond_the_limit_are_closed_oldest_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "IDLE_LIMIT", 3)
    binding = FakeBinding()
    kp = KernelPassthrough(binding)
    ids = {inode: kp.register(inode, fd=inode) for inode in range(10, 15)}
    for t, inode in enumerate((12, 10, 14, 11, 13)):
        kp.unregister(inode, now=float(t))
    assert kp.register(14, fd=99) == ids[14]  # taken back: no longer idle
    kp.unregister(14, now=5.0)  # idle again, now the newest
    assert kp.expire(now=6.0) == [12, 10]
    assert binding.open_ids == {ids[11], ids[13], ids[14]}


def test_expiry_closes_at_most_as_many_as_asked_oldest_first_and_the_rest_later() -> None:
    """A pass over many files makes their ids due together: a caller closes them a
    batch at a time, oldest first, and a later call goes on where it stopped."""
    binding = FakeBinding()
    kp = KernelPassthrough(binding)
    for inode in range(20, 30):
        kp.register(inode, fd=inode)
        kp.unregister(inode, now=float(inode))
    due = 100.0 + kernel.IDLE_SECONDS
    assert kp.expire(due, at_most=4) == [20, 21, 22, 23]
    assert kp.expire(due, at_most=4) == [24, 25, 26, 27]
    assert kp.expire(due, at_most=4) == [28, 29]
    assert kp.expire(due, at_most=4) == [] and binding.open_ids == set()


def test_idle_ids_go_to_a_successor_with_their_age() -> None:
    binding = FakeBinding()
    kp = KernelPassthrough(binding)
    live, idle = kp.register(7, fd=10), kp.register(8, fd=11)
    kp.unregister(8, now=kernel._monotonic() - 10)
    assert kp.join(7) == live and kp.join(8) is None  # an idle id is joined by no one
    state = kp.export_state()
    successor = KernelPassthrough(binding)
    successor.import_state(state)
    assert successor.statistics() == kp.statistics()
    assert successor.expire(kernel._monotonic() + kernel.IDLE_SECONDS - 11) == []
    assert successor.register(8, fd=12) == idle
    old = dict(state, ids=[[7, live, 2]])  # a build before: no idle ids
    for key in ("idle", "reused"):
        old.pop(key)
    successor = KernelPassthrough(binding)
    successor.import_state(old)
    assert successor.register(7, fd=14) == live
    assert successor.statistics().idle == 0


def test_a_refusal_returns_none_and_is_counted() -> None:
    kp = KernelPassthrough(FakeBinding(refuse=errno.ELOOP))
    assert kp.register(7, fd=10) is None
    assert kp.register(7, fd=10) is None
    kp.unregister(7, now=0.0)  # a release of an open that got no id: nothing to do
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
    kp.unregister(7, now=0.0)
    kp.unregister(7, now=0.0)
    assert kp.plain_open(7)  # idle: no open carries the id, a served open may come
    kp.plain_release(7)
    kp.plain_release(7)  # an extra release changes nothing
    assert kp.register(7, fd=13) == backing_id  # the idle one, taken back


@pytest.mark.parametrize(("fstype", "depth"), [
    ("ext4", 0), ("tmpfs", 0), (None, 0), ("nfs4", 0), ("overlay", 1), ("fuse", 1),
    ("fuse.sshfs", 1), ("fuseblk", 1), ("fuse.qosfs", 1), ("ecryptfs", 1)])
def test_stack_depth_is_one_for_a_stacking_filesystem(fstype: str | None, depth: int) -> None:
    assert kernel.stack_depth(fstype) == depth
