"""The FUSE requests the kernel sends to one mount, counted by opcode, from the kernel.

The ``fuse/fuse_request_send`` tracepoint fires once per request the kernel queues for a
daemon (FORGETs go by a queue of their own and are not in it), with the connection (the
mount's ``st_dev``) and the opcode, so the count is the same for any daemon (qosfs,
libfuse's passthrough_hp). Two ways to count, the first the kernel offers:

* ``hist``: a histogram trigger keyed by opcode, filtered on the connection, counts in
  the kernel: nothing is streamed, nothing can be lost (a kernel built with
  ``CONFIG_HIST_TRIGGERS``);
* ``buffer``: the event enabled with the same filter, its lines read from the instance's
  ring buffer and counted here after each pass (buffer sized for ~10^5 requests a pass);
  a pass whose events did not all fit is said (``lost``), never counted short.

Either is set in a tracing instance of our own, so the global buffer and other instances
(another run, another engineer's trace) are left alone, and removed on the way out.

The kernel-passthrough registrations (``FUSE_DEV_IOC_BACKING_OPEN``/``_CLOSE``) are not
requests but ioctls the daemon makes on /dev/fuse; when the syscall tracepoints exist, a
second histogram keyed by thread and ioctl command counts them, and only the daemon's
threads are summed (``BACKING_OPEN``, ``BACKING_CLOSE`` in the counts).

Where tracefs is missing (not mounted and cannot be), or the kernel has no FUSE
tracepoints, or we are not root, :attr:`FuseTrace.unavailable` says why in one line and
:meth:`FuseTrace.take` returns nothing: never a silent 0.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

TRACING = Path("/sys/kernel/tracing")
SEND = ("fuse", "fuse_request_send")
IOCTL = ("syscalls", "sys_enter_ioctl")
# _IOW(229, 1, struct fuse_backing_map (16 bytes)) and _IOW(229, 2, uint32_t)
BACKING_IOCTLS = {0x4010E501: "BACKING_OPEN", 0x4004E502: "BACKING_CLOSE"}

_SYMBOL = re.compile(r'\{(\d+), "(?:FUSE_)?(\w+)"\}')
_HIST_LINE = re.compile(r"^\{(?P<keys>[^}]*)\}\s*hitcount:\s*(?P<n>\d+)", re.MULTILINE)
_KEY = re.compile(r"(\w+):\s*(0x[0-9a-fA-F]+|\d+)\b")
_SENT = re.compile(r"opcode \d+ \((?:FUSE_)?(\w+)\)")
_IOCTL_LINE = re.compile(r"-(\d+)\s+\[\d+\].*?sys_ioctl\(.*?cmd: (0x[0-9a-f]+)")
_WRITTEN = re.compile(r"entries-in-buffer/entries-written: (\d+)/(\d+)")
_DROPPED = re.compile(r"^\s*Dropped:\s*(\d+)", re.MULTILINE)
BUFFER_KIB = 16384  # per CPU; a request's line is ~100 bytes


def parse_opcodes(format_text: str) -> dict[int, str]:
    """Opcode number -> name ("LOOKUP", ...) from the event's ``format`` file, whose
    print format lists them (``__print_symbolic``): the running kernel's own table."""
    return {int(n): name for n, name in _SYMBOL.findall(format_text)}


def parse_hist(text: str) -> list[tuple[dict[str, int], int]]:
    """The entries of a ``hist`` file: (key field -> value, hitcount). Values are decimal
    (``opcode: 14``) or hex (``cmd: 0x4010e501``); a key with a symbol after its value
    (``.sym``, ``.execname``) keeps the number."""
    out = []
    for m in _HIST_LINE.finditer(text):
        keys = {k: int(v, 0) for k, v in _KEY.findall(m.group("keys"))}
        out.append((keys, int(m.group("n"))))
    return out


def hist_dropped(text: str) -> int:
    """Entries a ``hist`` file says it dropped (its table was full)."""
    m = _DROPPED.search(text)
    return int(m.group(1)) if m else 0


def opcode_counts(text: str, names: dict[int, str]) -> dict[str, int]:
    """A ``keys=opcode`` histogram as {opcode name: count} (an unknown number as
    ``op<N>``)."""
    counts: collections.Counter[str] = collections.Counter()
    for keys, n in parse_hist(text):
        op = keys["opcode"]
        counts[names.get(op, f"op{op}")] += n
    return dict(counts)


def backing_counts(text: str, tids: Iterable[int]) -> dict[str, int]:
    """A ``keys=common_pid,cmd`` histogram of ioctls, summed over *tids* (the daemon's
    threads), for the backing registration commands."""
    ours = set(tids)
    counts: collections.Counter[str] = collections.Counter()
    for keys, n in parse_hist(text):
        name = BACKING_IOCTLS.get(keys.get("cmd", -1))
        if name is not None and keys.get("common_pid") in ours:
            counts[name] += n
    return dict(counts)


def buffer_counts(text: str, tids: Iterable[int]) -> tuple[dict[str, int], int]:
    """A tracing instance's ``trace`` file read as counts: FUSE requests by opcode name,
    the backing registrations made by *tids*; and how many events the buffer lost."""
    counts: collections.Counter[str] = collections.Counter()
    for m in _SENT.finditer(text):
        counts[m.group(1)] += 1
    ours = set(tids)
    for m in _IOCTL_LINE.finditer(text):
        name = BACKING_IOCTLS.get(int(m.group(2), 16))
        if name is not None and int(m.group(1)) in ours:
            counts[name] += 1
    w = _WRITTEN.search(text)
    return dict(counts), int(w.group(2)) - int(w.group(1)) if w else 0


def _minus(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


def _tids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def tracing_unavailable() -> str | None:
    """Why FUSE requests cannot be counted here (mounting tracefs if it is missing), or
    None."""
    if os.geteuid() != 0:
        return "not available here: counting FUSE requests needs root (tracefs)"
    if not (TRACING / "instances").is_dir():
        proc = subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACING)],
                              capture_output=True, text=True)
        if not (TRACING / "instances").is_dir():
            why = proc.stderr.strip().splitlines()
            return (f"not available here: tracefs is not mounted at {TRACING} and could not "
                    f"be ({why[-1] if why else proc.returncode})")
    if not (TRACING / "events" / SEND[0] / SEND[1]).is_dir():
        return "not available here: this kernel has no fuse/fuse_request_send tracepoint"
    return None


class FuseTrace:
    """Counts the requests the kernel sends to the FUSE mount at *mountpoint*, by opcode,
    and (given the daemon's *pid*) the daemon's backing registrations::

        with FuseTrace(mnt, pid) as trace:
            ...                     # a pass
            counts = trace.take()   # {"LOOKUP": 2400, "OPEN": 2400, ...} since the last take

    ``method`` is "hist" or "buffer" (see the module docstring); ``unavailable`` is None,
    or the one line saying why nothing is counted (then :meth:`take` returns {})."""

    def __init__(self, mountpoint: Path, pid: int | None = None) -> None:
        self.dev = os.stat(mountpoint).st_dev
        self.pid = pid
        self.inst: Path | None = None
        self.method: str | None = None
        self.names: dict[int, str] = {}
        self.backing = False
        self._last: dict[str, int] = {}
        self._undo: list[tuple[Path, str]] = []  # what to write where on the way out
        self.unavailable = tracing_unavailable()

    def _event(self, event: tuple[str, str]) -> Path:
        assert self.inst is not None
        return self.inst / "events" / event[0] / event[1]

    def _set(self, path: Path, text: str, undo: str) -> None:
        path.write_text(text + "\n")
        self._undo.append((path, undo))

    def _hist(self, event: tuple[str, str], spec: str) -> None:
        # removed by its own words, filter included
        self._set(self._event(event) / "trigger", spec, f"!{spec}")

    def _enable(self, event: tuple[str, str], condition: str) -> None:
        self._set(self._event(event) / "filter", condition, "0")
        self._set(self._event(event) / "enable", "1", "0")

    def __enter__(self) -> FuseTrace:
        if self.unavailable is not None:
            return self
        inst = TRACING / "instances" / f"bench-fuse-{os.getpid()}-{self.dev}"
        connection = f"connection == {self.dev}"
        backing = " || ".join(f"cmd == {c}" for c in BACKING_IOCTLS)
        try:
            inst.mkdir()
            self.inst = inst
            send = self._event(SEND)
            self.names = parse_opcodes((send / "format").read_text())
            has_ioctl = self.pid is not None and self._event(IOCTL).is_dir()
            if "hist" in (send / "trigger").read_text().split("\n", 2)[1].split():
                self.method = "hist"
                self._hist(SEND, f"hist:keys=opcode:size=256 if {connection}")
                if has_ioctl:
                    self._hist(IOCTL, f"hist:keys=common_pid,cmd:size=256 if {backing}")
            else:
                self.method = "buffer"
                (inst / "buffer_size_kb").write_text(f"{BUFFER_KIB}\n")
                self._enable(SEND, connection)
                if has_ioctl:
                    self._enable(IOCTL, backing)
            self.backing = has_ioctl
        except OSError as exc:
            self.unavailable = f"not available here: tracing {SEND[1]} in an instance: {exc}"
            self._remove()
        return self

    def _read(self) -> dict[str, int]:
        tids = _tids(self.pid) if self.pid is not None else []
        if self.method == "buffer":
            assert self.inst is not None
            text = (self.inst / "trace").read_text()
            (self.inst / "trace").write_text("")
            counts, lost = buffer_counts(text, tids)
            if lost:
                self.unavailable = (f"{lost} events lost from the trace buffer "
                                    f"({BUFFER_KIB} KiB per CPU): the counts are short")
            return counts
        text = (self._event(SEND) / "hist").read_text()
        if hist_dropped(text):
            self.unavailable = f"the histogram dropped {hist_dropped(text)} events"
        counts = opcode_counts(text, self.names)
        if self.backing:
            counts.update(backing_counts((self._event(IOCTL) / "hist").read_text(), tids))
        return counts

    def take(self) -> dict[str, int]:
        """The requests (by opcode name) since the last call, or since the start."""
        if self.inst is None:
            return {}
        if self.method == "buffer":
            return self._read()  # the buffer is cleared at each read
        now = self._read()
        got, self._last = _minus(now, self._last), now
        return got

    def _remove(self) -> None:
        for path, text in reversed(self._undo):
            try:
                path.write_text(text + "\n")
            except OSError:
                pass
        self._undo.clear()
        if self.inst is not None:
            try:
                self.inst.rmdir()
            except OSError:
                pass
            self.inst = None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._remove()
