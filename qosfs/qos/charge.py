"""The QoS bookkeeping of one open file: which flow it is charged to, and when that changes.

The filesystem resolves an open's flow once, at open, and reads it on every request
(:attr:`OpenCharge.flow`). What happens to an open's charge after that is kept here, so
the filesystem only reports what it did (a write of *n* bytes at *off*, a rename, a
release) and the engine decides what it means (:class:`~qosfs.qos.interface.FilesystemQos`:
the streaming threshold and class, whether a rename re-charges):

* **Split tails.** Under ``direct_io`` the kernel sends a write straight from the caller's
  pages, at most :data:`MAX_WRITE` bytes a request: a 1 MiB write from a buffer that starts
  48 bytes into a page (a Python bytes object's data does) arrives as 1 MiB - 48 and then
  48 bytes. Two write ops for one write doubled what a ``write_iops`` cap charged (1,024
  ops for 512 MiB of 1 MiB writes), so the continuation gives its op back unless the
  caller's write needs it (``ceil(bytes / MAX_WRITE)``).
* **Streaming writers.** A writable open of an uncapped class that writes
  ``stream_threshold`` bytes in sequence (with at most a quarter as much elsewhere) moves
  to the policy's streaming class for the rest of its life; a writer that scatters as
  much is left alone for good.
* **Bytes written under a name that said nothing.** While an open is watched, its bytes
  are noted on the inode (:class:`InodeCharge`): an atomic save (safetensors writes
  ``.tmpXXXXXX``, then renames) is charged to the final name's class at the rename
  (:func:`charge_renamed`), and the inode's opens still writing move there too.
* **Open files.** A flow counts the opens charged to it (the engine forgets flows at 0):
  counted here only, where an open joins, moves and leaves.

Nothing here is on a request's path unless :meth:`OpenCharge.write_done`'s filter lets it
through: :attr:`OpenCharge.watching` or a request size in (:data:`CUT_MIN`,
:data:`MAX_WRITE`) (one attribute test and one chained comparison per write).

An open that created its file is charged as a write whatever its access mode
(:func:`open_charge`): it made the file.
"""

from __future__ import annotations

import mmap
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from qosfs.qos.accounting import record_latency
from qosfs.qos.interface import Classified, FilesystemQos, Flow, PathSource

if TYPE_CHECKING:
    import pyfuse3

# The largest write request: libfuse 3.14 caps max_write at its buffer of 256 pages, and
# the kernel pins at most 256 pages per direct_io request. A request a page offset
# shorter than that (longer than CUT_MIN) was cut at a page boundary.
MAX_WRITE = 256 * mmap.PAGESIZE
CUT_MIN = MAX_WRITE - mmap.PAGESIZE


class InodeCharge:
    """What the QoS layer keeps on one inode, in its one opaque slot
    (:attr:`~qosfs.qos.interface.Classified.qos_memo`, dropped with the inode).

    ``memo_*`` is the engine's last classification of a request on it
    (:meth:`qosfs.qos.memo.Classification.flow`); ``unnamed_*`` the bytes written to it
    through watched opens and the flow they were charged to, until a rename settles them.
    """

    __slots__ = ("memo_flow", "memo_key", "memo_until", "unnamed_bytes", "unnamed_flow")

    def __init__(self) -> None:
        self.memo_key: tuple[Any, ...] | None = None
        self.memo_until = 0.0
        self.memo_flow: Any = None
        self.unnamed_bytes = 0
        self.unnamed_flow: Flow | None = None

    @property
    def settled(self) -> bool:
        """Nothing but the memo is kept: the inode may drop it (a cold inode does)."""
        return self.unnamed_flow is None and not self.unnamed_bytes


def inode_charge(node: Classified) -> InodeCharge:
    """*node*'s :class:`InodeCharge`, made at first use."""
    state: InodeCharge | None = node.qos_memo
    if state is None:
        state = node.qos_memo = InodeCharge()
    return state


class OpenCharge:
    """The QoS state of one open file; the filesystem's handle holds one.

    ``flow`` is read by every request (admission, threads, counters). ``watching`` says
    whether :meth:`wrote` must see every write of the open, not only those whose size
    says they may be cut short.
    """

    __slots__ = ("_engine", "_inode", "_scattered", "_split_bytes", "_split_end",
                 "_split_ops", "_stream_left", "_stream_limit", "_stream_off", "flow",
                 "watching")

    def __init__(self, engine: FilesystemQos, paths: PathSource, node: Classified,
                 ctx: pyfuse3.RequestContext, writing: bool) -> None:
        self.flow = flow = engine.open_flow(paths, node, ctx, writing)
        flow.open_files += 1
        flow.stats.opens += 1  # activity the latency controller sees (reads may bypass us)
        self._engine = engine
        # Streaming detection: sequential bytes still to see before the move (0: not
        # watched or decided), the threshold (0: never moves, or moved already), where
        # the next sequential write would start, bytes written elsewhere.
        limit = engine.stream_threshold(flow) if writing else 0
        # Where a watched open notes its bytes for a rename (the inode's one InodeCharge,
        # kept for the inode's life: resolved once here, not per write).
        self._inode = inode_charge(node) if limit else None
        self._stream_left = self._stream_limit = limit
        self._stream_off = -1
        self._scattered = 0
        # A write cut short at a page boundary: where its continuation would start (-1:
        # none), and the bytes and ops of the caller's write so far.
        self._split_end = -1
        self._split_bytes = 0
        self._split_ops = 0
        self.watching = bool(limit)

    def write_done(self, off: int, n: int, waited: float, backend_ns: int) -> None:
        """After a write of *n* bytes at *off* that waited *waited* s and took *backend_ns*
        at the backing store: counted, and seen by :meth:`wrote` if it may matter. The
        filter is inline here: most writes need nothing more, and a call per write would
        cost more than its two tests (and FlowStats.record_write is inlined likewise)."""
        stats = self.flow.stats
        stats.write_bytes += n
        stats.write_ops += 1
        record_latency(stats.write_backend, stats.write_latency, backend_ns, waited)
        if waited:
            stats.throttled_seconds += waited
        if self.watching or CUT_MIN < n < MAX_WRITE:
            self.wrote(off, n)

    def wrote(self, off: int, n: int) -> None:
        """After the backing store took *n* bytes at *off*. :meth:`write_done` calls it when
        :attr:`watching` or ``CUT_MIN < n < MAX_WRITE``; every other write needs nothing."""
        if off == self._split_end or CUT_MIN < n < MAX_WRITE:
            self._split_tail(off, n)
        if self._stream_limit:  # an uncapped writer that may turn out to be a checkpoint
            state = self._inode
            assert state is not None  # made with a stream limit
            state.unnamed_bytes += n
            state.unnamed_flow = self.flow
            if self._stream_left:
                self._follow_stream(off, n)
        self.watching = self._stream_limit != 0 or self._split_end >= 0

    def release(self) -> None:
        """The open is closed: its flow counts one open less."""
        self.flow.open_files -= 1

    def _split_tail(self, off: int, n: int) -> None:
        """Charge a caller's write as the requests it would take from an aligned buffer
        (see the module docstring): a request that starts where a short one ended is part
        of the same write, and its op is given back unless the write needs it."""
        if off == self._split_end:
            total = self._split_bytes + n
            ops = -(-total // MAX_WRITE)
            if ops == self._split_ops:
                self.flow.refund_write_op()
            self._split_bytes, self._split_ops = total, ops
            # A full request means the write goes on: its tail may follow.
            self._split_end = off + n if n == MAX_WRITE else -1
        else:  # 1 MiB less a page offset: a write cut short at a page boundary
            self._split_end, self._split_bytes, self._split_ops = off + n, n, 1

    def _follow_stream(self, off: int, n: int) -> None:
        """Count a write of a watched open; once the threshold came in sequence (with at
        most a quarter as much elsewhere), continue in the flow the engine names for
        streaming writers. Called after the write: the move applies from the next one."""
        if off == self._stream_off or self._stream_off < 0:
            self._stream_left -= n
        else:
            self._scattered += n
        self._stream_off = off + n
        if self._stream_left <= 0:
            self._stream_left = 0  # decided either way: stop watching
            if self._scattered * 4 <= self._stream_limit:
                self.move_to(self._engine.moved_to_streaming(self.flow))
        elif self._scattered >= self._stream_limit:
            self._stream_left = 0  # a random writer, not a stream

    def move_to(self, flow: Flow) -> None:
        """Charge the rest of the open to *flow* (a streaming move, a rename), for good:
        nothing watches it any more."""
        if flow is self.flow:
            return
        self.flow.open_files -= 1
        flow.open_files += 1
        self.flow = flow
        self._stream_limit = self._stream_left = 0
        self.watching = self._split_end >= 0

    # -- handover (qosfs.passthrough.transfer) -------------------------------------------

    _STATE = ("_scattered", "_split_bytes", "_split_end", "_split_ops", "_stream_left",
              "_stream_limit", "_stream_off")

    def export_state(self) -> dict[str, int]:
        """Where the open's streaming detection and split-write tracking stand, as plain
        integers (its flow travels apart, by the engine's ``flow_key``)."""
        return {name.lstrip("_"): getattr(self, name) for name in self._STATE}

    def state_values(self) -> tuple[int, ...]:
        """The same figures as a tuple, in one C call: the crash journal writes them at
        every open (qosfs.passthrough.journal), where the dict above cost ~5 us."""
        values: tuple[int, ...] = _STATE_GETTER(self)
        return values

    @classmethod
    def state_from_values(cls, values: Sequence[int]) -> dict[str, int]:
        """`export_state`'s dict from `state_values`' tuple."""
        return {name.lstrip("_"): int(v) for name, v in zip(cls._STATE, values, strict=True)}

    @classmethod
    def values_from_state(cls, state: Mapping[str, Any]) -> tuple[int, ...]:
        """`state_values`' tuple from `export_state`'s dict (a handover of the build
        before sent the dict)."""
        return tuple(int(state[name.lstrip("_")]) for name in cls._STATE)

    @classmethod
    def restore(cls, engine: FilesystemQos, flow: Flow, node: Classified,
                state: dict[str, Any]) -> OpenCharge:
        """The charge of an open a predecessor process made, in *flow*, where its
        `export_state` left it: counted in the flow's ``open_files`` (not as a new open)."""
        charge = cls.__new__(cls)
        charge.flow = flow
        flow.open_files += 1
        charge._engine = engine
        for name in cls._STATE:
            setattr(charge, name, int(state[name.lstrip("_")]))
        charge._inode = inode_charge(node) if charge._stream_limit else None
        charge.watching = charge._stream_limit != 0 or charge._split_end >= 0
        return charge

    @property
    def moves_at_rename(self) -> bool:
        """Whether a rename of its file may still move this open (it is watched)."""
        return self._stream_limit != 0


def charge_renamed(engine: FilesystemQos, paths: PathSource, node: Classified,
                   ctx: pyfuse3.RequestContext, opens: Iterable[OpenCharge]) -> None:
    """*node* just got a new name (an atomic save's final one): the bytes written to it
    through watched opens are charged to the class the engine gives the new name, as debt
    its next writes pay, so a cap holds over successive saves even for writers whose
    temporary name says nothing. *opens* are the inode's open files (read only if the
    charge moved): those still watched continue in the new flow."""
    state: InodeCharge | None = node.qos_memo
    if state is None or not state.unnamed_bytes:
        return
    nbytes, charged = state.unnamed_bytes, state.unnamed_flow
    state.unnamed_bytes, state.unnamed_flow = 0, None
    assert charged is not None  # noted with the bytes
    flow = engine.charge_renamed(paths, node, ctx, charged, nbytes)
    if flow is None:
        return
    # Still open (written, renamed, written on): its remaining writes go where the final
    # name belongs.
    for charge in opens:
        if charge.moves_at_rename:
            charge.move_to(flow)


def open_charge(engine: FilesystemQos, paths: PathSource, node: Classified,
                ctx: pyfuse3.RequestContext, accmode: int, created: bool) -> OpenCharge:
    """The charge of a new open of *node* with access mode *accmode*, classified as a
    writing open if it may write or it *created* the file (whatever its access mode)."""
    return OpenCharge(engine, paths, node, ctx, created or accmode != os.O_RDONLY)


_STATE_GETTER = operator.attrgetter(*OpenCharge._STATE)
