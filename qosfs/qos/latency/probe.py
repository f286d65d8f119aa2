"""The canary behind ``latency_measure = "request"``: a tiny request through the mount.

A request of a protected class waits in the kernel's FUSE queue and for the daemon's event
loop before its handler runs, behind every other class's requests; a handler cannot see
that wait. So a canary sends one ``getxattr`` of :data:`PROBE_XATTR` on the mount's root
every :data:`INTERVAL` and times the round trip: it queues exactly like a data request,
and the filesystem (:mod:`qosfs.passthrough.operations`) answers it at once (ENODATA)
without charging it or touching the backing store when it comes from the canary's pid. The
round trips go to a :class:`~qosfs.qos.accounting.FineHistogram` that
:class:`qosfs.qos.latency.loop.LatencyLoop` differences per window.

**Reads the daemon does not see.** A class whose reads the kernel sends straight to the
backing file (FUSE passthrough) waits in no queue of ours for them: what its reads take is
what the backing store takes now. For such a class the canary also times one 4 KiB
``pread`` of a file the class has open (a random offset) after each round trip, and
reports it under the class's name (:meth:`LatencyProbe.watch_backing`). The read bypasses
the page cache (``O_DIRECT``, where the filesystem has it): a data loader reads a
dataset larger than memory (MLPerf Storage sizes it at 5x RAM), so its reads come from
the storage, while the file it opened last -- the one the canary is given -- is the one
it has just read into the cache; timed through the cache, the canary saw microseconds
while a storm made a small-file loader's cold reads wait on the disk. Judged on the round
trip instead, a passthrough reader looked slow whenever checkpoint writes filled the
daemon's queue -- which its reads never enter -- and the storm was cut to its floor for
nothing (``python -m bench demo``: checkpoints kept 15-18% of their capped rate with the
reader at 98-103% of its solo rate). The file is named by ``/proc/<daemon>/fd/<fd>``:
opening that link reaches the backing file itself, also when the mount sits on top of its
source, and the canary checks the device and inode it was told so a descriptor number the
daemon reused in between is never measured.

The canary is a separate process (``python -m qosfs.qos.latency.probe MOUNTPOINT INTERVAL``)
that reports each round trip in nanoseconds on its stdout. A thread inside the daemon
would time its own wait for the daemon's GIL too: measured, a 6-8 ms p99 next to a 3.5 ms
p99 seen by fio, which made the controller throttle a storm to its floor for a target
fio showed was met. A process waits only for a CPU, like the jobs it stands for. A
thread of the daemon only reads the reports (its delays do not change the figures).

Cost: about 500 requests/s while it runs and a class below the protected one is moving
(:data:`INTERVAL`); while they are all quiet, only the baseline of a relative target is
being learned and 100 a second do (:data:`QUIET_INTERVAL`). Measured at 2 ms throughout,
the canary cost a saturated daemon about 12% of its 4 KiB read rate (4 jobs: 35.5k against
40.7k IOPS without it). The timed backing reads cost the daemon nothing (the canary reads
the file itself) and the storage 4 KiB per round trip. It runs only while a class measured
as "request" has files open, and :meth:`LatencyLoop.stop_probe
<qosfs.qos.latency.loop.LatencyLoop.stop_probe>` stops it (SIGKILL, which also ends a
request in flight) before the daemon stops serving."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import random
import signal
import subprocess
import sys
import threading
import time

from qosfs.qos.accounting import FineHistogram

__all__ = ["BACKING_READ", "INTERVAL", "PROBE_XATTR", "LatencyProbe"]

log = logging.getLogger(__name__)

PROBE_XATTR = b"user.qosfs.latency-probe"
INTERVAL = 0.002  # seconds between the end of one canary request and the next
QUIET_INTERVAL = 0.01  # ... while no class below a protected one is moving
REPORT_EVERY = 50_000_000  # ns between flushes of the canary's reports (a tenth of a window)
BACKING_READ = 4096  # bytes per timed read of a class's backing file (a data loader's small read)
# A canary that ends within QUICK_END s of its start (it cannot run: its module missing
# after an install, the mountpoint gone) is started again only after a pause that doubles
# from FIRST_PAUSE to LAST_PAUSE: the latency loop asks for it every 50 ms, and a Python
# process started 20 times a second would take a core from the daemon it measures.
QUICK_END = 1.0
FIRST_PAUSE = 0.5
LAST_PAUSE = 30.0


class LatencyProbe:
    """A canary process timing requests through ``path`` (the mountpoint).

    Args:
        path: The mount's root.
        tids: The engine's ``probe_tids``: the canary's pid is in it while it runs, so
            the engine knows which ``getxattr`` calls are the canary's
            (``QosEngine.getxattr_admission``).
        interval: Pause between canary requests.
    """

    def __init__(self, path: str, tids: set[int], interval: float = INTERVAL) -> None:
        self.path = path
        self.tids = tids
        self.interval = interval
        self.histogram = FineHistogram()
        # Per class whose reads bypass the daemon: its backing reads as the canary timed
        # them, and the file it reads (what was last sent to the canary).
        self.backing: dict[str, FineHistogram] = {}
        self._watched: dict[str, tuple[int, int, int]] = {}
        self.sent = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self.starts = 0  # canary processes started
        self._started_at = 0.0
        self._pause = 0.0  # after a canary that ended at once (QUICK_END)
        self._next_start = 0.0

    def __repr__(self) -> str:
        return f"<LatencyProbe {self.path} running={self.running} sent={self.sent}>"

    @property
    def running(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def snapshot(self) -> tuple[int, ...]:
        return self.histogram.snapshot()

    def backing_snapshot(self, class_name: str) -> tuple[int, ...] | None:
        """The timed backing reads of *class_name* so far (None: never watched)."""
        histogram = self.backing.get(class_name)
        return histogram.snapshot() if histogram is not None else None

    def watch_backing(self, class_name: str, fd: int | None) -> None:
        """Time reads of the daemon's backing descriptor *fd* for *class_name* from now on
        (None: stop). Cheap when nothing changed: called at every check of the loop."""
        if fd is None:
            if self._watched.pop(class_name, None) is not None:
                self._send(f"x\t{class_name}")
            return
        try:
            st = os.fstat(fd)
        except OSError:
            return  # closed meanwhile: the next check finds another
        ident = (fd, st.st_dev, st.st_ino)
        if self._watched.get(class_name) == ident:
            return
        self._watched[class_name] = ident
        self.backing.setdefault(class_name, FineHistogram())
        self._send(f"f\t{class_name}\t/proc/{os.getpid()}/fd/{fd}\t{st.st_dev}\t{st.st_ino}")

    def start(self) -> None:
        """Start the canary, unless it runs, or ended at once and its pause is not over."""
        if self.running or time.monotonic() < self._next_start:
            return
        ended = self._proc
        if ended is not None and ended.stdin is not None:
            ended.stdin.close()  # a canary that ended on its own: its pipe is still ours
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "qosfs.qos.latency.probe", self.path, repr(self.interval)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=env, close_fds=True)
        assert proc.stdin is not None
        os.set_blocking(proc.stdin.fileno(), False)  # a stuck canary never blocks us
        self.tids.add(proc.pid)  # before its first request can arrive
        self._proc = proc
        self.starts += 1
        self._started_at = time.monotonic()
        self._watched.clear()  # a new canary reads nothing until told again
        self._reader = threading.Thread(target=self._read_reports, args=(proc,),
                                        name="qosfs-latency-probe", daemon=True)
        self._reader.start()
        log.debug("latency probe %d started on %s", proc.pid, self.path)

    def set_interval(self, interval: float) -> None:
        """Pause *interval* s between canary requests from now on (sent on its stdin)."""
        if interval == self.interval:
            return
        self.interval = interval
        self._send(f"i\t{interval!r}")

    def _send(self, line: str) -> None:
        """One command to the canary on its stdin (see :func:`_canary`)."""
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        try:
            os.write(proc.stdin.fileno(), f"{line}\n".encode())
        except (BlockingIOError, BrokenPipeError):
            pass  # the canary is gone or not reading: it keeps what it had

    def stop(self) -> None:
        """End the canary now (does not wait for the reader thread)."""
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)  # also ends a request it has in flight
        if proc.stdin is not None:
            proc.stdin.close()
        log.debug("latency probe %d stopped (%d sent)", proc.pid, self.sent)

    def _read_reports(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                try:
                    if line.startswith(b"b\t"):  # b<TAB>class<TAB>ns: a backing read
                        _, name, ns = line.split(b"\t")
                        histogram = self.backing.get(name.decode())
                        if histogram is not None:
                            histogram.observe(int(ns))
                        continue
                    self.histogram.observe(int(line))
                except ValueError:
                    continue
                self.sent += 1
        finally:
            proc.stdout.close()
            code = proc.wait()
            self.tids.discard(proc.pid)
            self._ended(proc, code)

    def _ended(self, proc: subprocess.Popen[bytes], code: int) -> None:
        """After the canary *proc* ended: one that ended on its own within QUICK_END of
        its start pauses the next start (see QUICK_END); any other clears the pause."""
        lived = time.monotonic() - self._started_at
        if self._proc is not proc or lived >= QUICK_END:  # stopped by us, or it ran
            self._pause = 0.0
            return
        self._pause = min(LAST_PAUSE, max(FIRST_PAUSE, 2 * self._pause))
        self._next_start = time.monotonic() + self._pause
        log.warning("latency probe %d ended after %.2f s (exit %s): started again in %.1f s",
                    proc.pid, lived, code, self._pause)


class _Backing:
    """A backing file the canary times reads of, for one class."""

    __slots__ = ("blocks", "fd")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.blocks = max(1, size // BACKING_READ)  # offsets to pick from


def _open_backing(link: str, dev: int, ino: int) -> _Backing | None:
    """Open the daemon's descriptor *link* if it still is file (dev, ino), bypassing the
    page cache where its filesystem allows it (see "Reads the daemon does not see")."""
    try:
        try:
            fd = os.open(link, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            fd = os.open(link, os.O_RDONLY | os.O_CLOEXEC)  # no O_DIRECT there
    except OSError:
        return None  # closed meanwhile
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (dev, ino):  # the number was reused for another file
        os.close(fd)
        return None
    return _Backing(fd, st.st_size)


def _commands(buffer: bytearray, interval: float,
              backing: dict[str, _Backing]) -> float | None:
    """Carry out the complete lines in *buffer* (the daemon's commands): ``i<TAB>seconds``
    (the interval), ``f<TAB>class<TAB>link<TAB>dev<TAB>ino`` (time reads of that file
    for the class), ``x<TAB>class`` (stop). Returns the interval, or None on a line
    that makes no sense (the daemon and the canary disagree: end)."""
    while (end := buffer.find(b"\n")) >= 0:
        fields = bytes(buffer[:end]).decode().split("\t")
        del buffer[:end + 1]
        try:
            if fields[0] == "i":
                interval = float(fields[1])
            elif fields[0] in ("f", "x"):
                old = backing.pop(fields[1], None)
                if old is not None:
                    os.close(old.fd)
                if fields[0] == "f":
                    opened = _open_backing(fields[2], int(fields[3]), int(fields[4]))
                    if opened is not None:
                        backing[fields[1]] = opened
            else:
                return None
        except (IndexError, ValueError):
            return None
    return interval


def _canary(path: str, interval: float) -> int:
    """The canary process: one timed getxattr per interval, each reported on stdout, and
    after it one timed read of each backing file it was given (``b<TAB>class<TAB>ns``).

    Reports are flushed every :data:`REPORT_EVERY` ns, not one by one: the daemon's
    reader thread takes the GIL at every wake-up, and 500 wake-ups a second cost the
    event loop about 10% of its small-request rate (4 KiB reads, 4 jobs: 38k against
    43k IOPS without a target); 20 a second cost it nothing measurable.
    """
    now = time.perf_counter_ns
    out = sys.stdout
    flushed = now()
    os.set_blocking(0, False)  # commands arrive on stdin (LatencyProbe._send)
    buffer = bytearray()
    backing: dict[str, _Backing] = {}
    pick = random.randrange
    block = [mmap.mmap(-1, BACKING_READ)]  # page-aligned, as O_DIRECT wants it
    while True:
        try:
            sent = os.read(0, 4096)
        except BlockingIOError:
            sent = None
        if sent == b"":  # the daemon closed our stdin: it is going away
            return 0
        if sent:
            buffer += sent
            changed = _commands(buffer, interval, backing)
            if changed is None:
                return 2
            interval = changed
        start = now()
        try:
            os.getxattr(path, PROBE_XATTR)
        except OSError as exc:
            if exc.errno != errno.ENODATA:  # the mount is going away
                return 0
        end = now()
        try:
            out.write(f"{end - start}\n")
            for name, file in backing.items():
                offset = pick(file.blocks) * BACKING_READ
                start = now()
                try:
                    os.preadv(file.fd, block, offset)
                except OSError:
                    continue  # e.g. EIO from the storage: its latency is not a read's
                out.write(f"b\t{name}\t{now() - start}\n")
            if end - flushed >= REPORT_EVERY:
                out.flush()
                flushed = end
        except BrokenPipeError:  # the daemon stopped listening
            return 0
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(_canary(sys.argv[1], float(sys.argv[2])))
