"""A bounded set of open ``O_PATH`` descriptors, so a million-inode tree costs no million fds.

The inode table (:mod:`qosfs.passthrough.inodes`) names each backing object by its *file handle*
(what NFS servers hand out) and keeps a descriptor open only for the objects used
recently. This module holds those descriptors:

* :class:`FdCache` -- about ``capacity`` descriptors, evicted by the CLOCK algorithm (a
  hit costs one attribute store; LRU's reordering would cost a dict operation on every
  metadata request). Adding never evicts: a request handler may hold several inode
  descriptors at once (a rename's two directories), and evicting one to make room for
  the next would close it under the handler's feet (and let its number be reused by the
  next open). Eviction happens in :meth:`FdCache.trim`, which the inode table calls when a
  request *starts*, before it has taken any descriptor; the cache may overshoot its
  capacity in between by what one request adds (a readdir batch).
* :class:`DeferredClose` -- where descriptors are handed to worker threads (network
  backing stores, ``--io-mode threads``), an evicted descriptor may still be in use by a
  syscall running in a thread; closing it then would let the number be reused by another
  open, and the syscall would act on the wrong object. Such descriptors are closed once
  every thread call that started before the eviction has returned (an epoch scheme, like
  RCU's grace periods), never while one could still be using them.
"""

from __future__ import annotations

import array
import os
import resource
from collections import deque
from collections.abc import Callable
from typing import Protocol

# Bounds of the automatic inode descriptor budget (default_fd_budget): beyond 64k cached
# descriptors the hit rate no longer pays for the kernel memory each one pins.
MIN_FD_BUDGET = 64
MAX_FD_BUDGET = 65536


def default_fd_budget() -> int:
    """How many inode descriptors to cache: a quarter of the descriptor limit, so that
    open files, directory listings and sockets keep the other three quarters."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_FD_BUDGET
    return max(MIN_FD_BUDGET, min(MAX_FD_BUDGET, soft // 4))


class CachedFd(Protocol):
    """What the cache needs of an inode: its descriptor slot and CLOCK bit."""

    cached_fd: int  # -1 when not cached
    referenced: bool  # CLOCK: used since the hand last passed
    slot: int  # index in the ring, -1 when not cached


class DeferredClose:
    """Closes descriptors only when no worker-thread call could still be using them.

    ``enter()``/``leave()`` bracket every syscall that runs in a thread with descriptors
    taken from the cache; ``retire(fd)`` closes now if none is running, else once every
    call that was running at that moment has left. Calls that enter later cannot have
    taken the retired descriptor: it left the cache before.
    """

    __slots__ = ("_active", "_epoch", "_retired")

    def __init__(self) -> None:
        self._epoch = 0
        self._active: dict[int, int] = {}  # epoch -> thread calls that entered in it
        self._retired: deque[tuple[int, int]] = deque()  # (epoch, fd), epochs ascending

    @property
    def pending(self) -> int:
        """Descriptors retired but not yet closed."""
        return len(self._retired)

    def enter(self) -> int:
        epoch = self._epoch
        self._active[epoch] = self._active.get(epoch, 0) + 1
        return epoch

    def leave(self, epoch: int) -> None:
        left = self._active[epoch] - 1
        if left:
            self._active[epoch] = left
            return
        del self._active[epoch]
        self._reclaim()

    def retire(self, fd: int) -> None:
        if not self._active:
            os.close(fd)
            return
        self._retired.append((self._epoch, fd))
        self._epoch += 1  # calls entering from now on cannot hold fd

    def _reclaim(self) -> None:
        oldest = min(self._active, default=self._epoch + 1)
        retired = self._retired
        while retired and retired[0][0] < oldest:
            os.close(retired.popleft()[1])

    def close_all(self) -> None:
        while self._retired:
            os.close(self._retired.popleft()[1])


class FdCache:
    """About ``capacity`` open descriptors, one per inode, evicted by CLOCK in :meth:`trim`.

    Args:
        capacity: Upper bound of descriptors held (>= 8).
        close: How an evicted descriptor is closed (``os.close``, or
            :meth:`DeferredClose.retire` when threads may be using it).
        evicting: Called with an entry and its descriptor just before the descriptor
            is evicted (it must not raise).
    """

    __slots__ = ("_close", "_evicting", "_free", "_hand", "_ring", "capacity", "evictions")

    def __init__(self, capacity: int, close: Callable[[int], None] = os.close,
                 evicting: Callable[[CachedFd, int], None] | None = None) -> None:
        self.capacity = max(8, capacity)
        self._close = close
        # Told of an entry and its descriptor just before the descriptor is evicted (not
        # when dropped): the inode table takes a file's handle only then (inodes.py).
        self._evicting = evicting
        self._ring: list[CachedFd | None] = []
        # Ring slots emptied by drop(), as raw integers: a list would keep an int object
        # per slot alive, scattered over the allocator's pools, which then cannot be
        # given back when the kernel forgets (a walk's inodes come and go by thousands).
        self._free = array.array("i")
        self._hand = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._ring) - len(self._free)

    @property
    def over(self) -> bool:
        """More descriptors are held than the capacity: :meth:`trim` has work to do."""
        return len(self._ring) - len(self._free) > self.capacity

    def put(self, entry: CachedFd, fd: int) -> None:
        """Hold *fd* as *entry*'s descriptor (*entry* must hold none). Never evicts."""
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._ring)
            self._ring.append(None)
        self._ring[slot] = entry
        entry.slot = slot
        entry.cached_fd = fd
        entry.referenced = True

    def drop(self, entry: CachedFd) -> None:
        """Forget *entry* (the inode is gone or stale) and close its descriptor."""
        slot = entry.slot
        if slot < 0:
            return
        self._ring[slot] = None
        self._free.append(slot)
        entry.slot = -1
        fd, entry.cached_fd = entry.cached_fd, -1
        self._close(fd)

    def trim(self) -> int:
        """Evict down to the capacity; call only where no descriptor from the cache is in
        use by the caller (see the module docstring). Returns how many were closed."""
        return self.shrink(self.capacity)

    def shrink(self, keep: int) -> int:
        """Evict until at most *keep* descriptors remain (also when short of fds)."""
        dropped = 0
        while len(self) > keep:
            slot = self._evict_one()
            self._ring[slot] = None
            self._free.append(slot)
            dropped += 1
        return dropped

    def _evict_one(self) -> int:
        """Close the descriptor of the first entry not referenced since the hand passed it;
        returns its (now empty) slot."""
        ring = self._ring
        size = len(ring)
        hand = self._hand
        while True:
            entry = ring[hand]
            if entry is not None:
                if entry.referenced:
                    entry.referenced = False
                else:
                    break
            hand = (hand + 1) % size
        self._hand = (hand + 1) % size
        entry.slot = -1
        fd, entry.cached_fd = entry.cached_fd, -1
        if self._evicting is not None:
            self._evicting(entry, fd)
        self._close(fd)
        self.evictions += 1
        return hand

    def close_all(self) -> None:
        for entry in self._ring:
            if entry is not None:
                self._close(entry.cached_fd)
                entry.cached_fd = -1
                entry.slot = -1
        self._ring.clear()
        del self._free[:]
        self._hand = 0
