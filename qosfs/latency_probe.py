"""The canary behind ``latency_measure = "request"``: a tiny request through the mount.

A request of a protected class waits in the kernel's FUSE queue and for the daemon's
event loop before its handler runs, behind every other class's requests; a handler cannot
see that wait. So a canary sends one ``getxattr`` of :data:`PROBE_XATTR` on the mount's
root every :data:`INTERVAL` and times the round trip: it queues exactly like a data
request, and ``fs.py`` answers it at once (ENODATA) without charging it or touching the
backing store when it comes from the canary's pid. The round trips go to a
:class:`~qosfs.accounting.FineHistogram` that :class:`qosfs.latency_control.LatencyControl`
differences per window.

The canary is a separate process (``python -m qosfs.latency_probe MOUNTPOINT INTERVAL``)
that reports each round trip in nanoseconds on its stdout. A thread inside the daemon
would time its own wait for the daemon's GIL too: measured, a 6-8 ms p99 next to a 3.5 ms
p99 seen by fio, which made the controller throttle a storm to its floor for a target
fio showed was met. A process waits only for a CPU, like the jobs it stands for. A
thread of the daemon only reads the reports (its delays do not change the figures).

Cost: about 500 requests/s while it runs (a few percent of one CPU). It runs only while
a class measured as "request" has files open, and :meth:`LatencyControl.stop_probe
<qosfs.latency_control.LatencyControl.stop_probe>` stops it (SIGKILL, which also ends a
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

from qosfs.accounting import FineHistogram

__all__ = ["INTERVAL", "PROBE_XATTR", "LatencyProbe"]

log = logging.getLogger(__name__)

PROBE_XATTR = b"user.qosfs.latency-probe"
INTERVAL = 0.002  # seconds between the end of one canary request and the next


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
            [sys.executable, "-m", "qosfs.latency_probe", self.path, repr(self.interval)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=env, close_fds=True)
        self.tids.add(proc.pid)  # before its first request can arrive
        self._proc = proc
        self._reader = threading.Thread(target=self._read_reports, args=(proc,),
                                        name="qosfs-latency-probe", daemon=True)
        self._reader.start()
        log.debug("latency probe %d started on %s", proc.pid, self.path)

    def stop(self) -> None:
        """End the canary now (does not wait for the reader thread)."""
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)  # also ends a request it has in flight
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
    """The canary process: one timed getxattr per interval, each reported on stdout."""
    now = time.perf_counter_ns
    out = sys.stdout
    while True:
        start = now()
        try:
            os.getxattr(path, PROBE_XATTR)
        except OSError as exc:
            if exc.errno != errno.ENODATA:  # the mount is going away
                return 0
        try:
            out.write(f"{now() - start}\n")
            out.flush()
        except BrokenPipeError:  # the daemon stopped listening
            return 0
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(_canary(sys.argv[1], float(sys.argv[2])))
