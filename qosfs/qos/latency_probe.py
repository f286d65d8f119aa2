"""The canary behind ``latency_measure = "request"``: a tiny request through the mount.

A request of a protected class waits in the kernel's FUSE queue and for the daemon's
event loop before its handler runs, behind every other class's requests; a handler cannot
see that wait. So a canary sends one ``getxattr`` of :data:`PROBE_XATTR` on the mount's
root every :data:`INTERVAL` and times the round trip: it queues exactly like a data
request, and the filesystem (:mod:`qosfs.passthrough.operations`) answers it at once
(ENODATA) without charging it or touching the backing store when it comes from the
canary's pid. The round trips go to a
:class:`~qosfs.qos.accounting.FineHistogram` that :class:`qosfs.qos.latency_control.LatencyLoop`
differences per window.

The canary is a separate process (``python -m qosfs.qos.latency_probe MOUNTPOINT INTERVAL``)
that reports each round trip in nanoseconds on its stdout. A thread inside the daemon
would time its own wait for the daemon's GIL too: measured, a 6-8 ms p99 next to a 3.5 ms
p99 seen by fio, which made the controller throttle a storm to its floor for a target
fio showed was met. A process waits only for a CPU, like the jobs it stands for. A
thread of the daemon only reads the reports (its delays do not change the figures).

Cost: about 500 requests/s while it runs and a class below the protected one is moving
(:data:`INTERVAL`); while they are all quiet, only the baseline of a relative target is
being learned and 100 a second do (:data:`QUIET_INTERVAL`). Measured at 2 ms throughout,
the canary cost a saturated daemon about 12% of its 4 KiB read rate (4 jobs: 35.5k
against 40.7k IOPS without it). It runs only while a class measured as "request" has
files open, and :meth:`LatencyLoop.stop_probe
<qosfs.qos.latency_control.LatencyLoop.stop_probe>` stops it (SIGKILL, which also ends a
request in flight) before the daemon stops serving.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from qosfs.qos.accounting import FineHistogram

__all__ = ["INTERVAL", "PROBE_XATTR", "LatencyProbe"]

log = logging.getLogger(__name__)

PROBE_XATTR = b"user.qosfs.latency-probe"
INTERVAL = 0.002  # seconds between the end of one canary request and the next
QUIET_INTERVAL = 0.01  # ... while no class below a protected one is moving
REPORT_EVERY = 50_000_000  # ns between flushes of the canary's reports (a tenth of a window)


class LatencyProbe:
    """A canary process timing requests through ``path`` (the mountpoint).

    Args:
        path: The mount's root.
        tids: A set the fs shares: the canary's pid is in it while it runs, so the
            handler knows which ``getxattr`` calls are the canary's.
        interval: Pause between canary requests.
    """

    def __init__(self, path: str, tids: set[int], interval: float = INTERVAL) -> None:
        self.path = path
        self.tids = tids
        self.interval = interval
        self.histogram = FineHistogram()
        self.sent = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<LatencyProbe {self.path} running={self.running} sent={self.sent}>"

    @property
    def running(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def snapshot(self) -> tuple[int, ...]:
        return self.histogram.snapshot()

    def start(self) -> None:
        if self.running:
            return
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "qosfs.qos.latency_probe", self.path, repr(self.interval)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=env, close_fds=True)
        assert proc.stdin is not None
        os.set_blocking(proc.stdin.fileno(), False)  # a stuck canary never blocks us
        self.tids.add(proc.pid)  # before its first request can arrive
        self._proc = proc
        self._reader = threading.Thread(target=self._read_reports, args=(proc,),
                                        name="qosfs-latency-probe", daemon=True)
        self._reader.start()
        log.debug("latency probe %d started on %s", proc.pid, self.path)

    def set_interval(self, interval: float) -> None:
        """Pause *interval* s between canary requests from now on (sent on its stdin)."""
        if interval == self.interval:
            return
        self.interval = interval
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        try:
            os.write(proc.stdin.fileno(), f"{interval!r}\n".encode())
        except (BlockingIOError, BrokenPipeError):
            pass  # the canary is gone or not reading: it keeps its interval

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
                    self.histogram.observe(int(line))
                except ValueError:
                    continue
                self.sent += 1
        finally:
            proc.stdout.close()
            proc.wait()
            self.tids.discard(proc.pid)


def _canary(path: str, interval: float) -> int:
    """The canary process: one timed getxattr per interval, each reported on stdout.

    Reports are flushed every :data:`REPORT_EVERY` ns, not one by one: the daemon's
    reader thread takes the GIL at every wake-up, and 500 wake-ups a second cost the
    event loop about 10% of its small-request rate (4 KiB reads, 4 jobs: 38k against
    43k IOPS without a target); 20 a second cost it nothing measurable.
    """
    now = time.perf_counter_ns
    out = sys.stdout
    flushed = now()
    os.set_blocking(0, False)  # new intervals arrive on stdin (LatencyProbe.set_interval)
    while True:
        try:
            sent = os.read(0, 256)
        except BlockingIOError:
            sent = None
        if sent == b"":  # the daemon closed our stdin: it is going away
            return 0
        if sent:
            interval = float(sent.split()[-1])
        start = now()
        try:
            os.getxattr(path, PROBE_XATTR)
        except OSError as exc:
            if exc.errno != errno.ENODATA:  # the mount is going away
                return 0
        end = now()
        try:
            out.write(f"{end - start}\n")
            if end - flushed >= REPORT_EVERY:
                out.flush()
                flushed = end
        except BrokenPipeError:  # the daemon stopped listening
            return 0
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(_canary(sys.argv[1], float(sys.argv[2])))
