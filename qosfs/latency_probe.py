"""The canary behind ``latency_measure = "request"``: a tiny request through the mount.

A request of a protected class waits in the kernel's FUSE queue and for the daemon's
event loop before its handler runs, behind every other class's requests; a handler cannot
see that wait. So a thread of the daemon sends one ``getxattr`` of :data:`PROBE_XATTR`
on the mount's root every :data:`INTERVAL` and times the round trip: it queues exactly
like a data request, and ``fs.py`` answers it at once (ENODATA) without charging it or
touching the backing store when it comes from this thread. The round trips go to a
:class:`~qosfs.accounting.FineHistogram` that :class:`qosfs.latency_control.LatencyControl`
differences per window.

Cost: about 500 requests/s while it runs (a few percent of one CPU). It runs only while
a class measured as "request" has files open, and :meth:`LatencyControl.stop_probe
<qosfs.latency_control.LatencyControl.stop_probe>` stops it before the daemon stops
serving. While a request of the canary is in flight the mount is busy for ``umount``
(without ``-z``) -- as it is anyway while the protected class has its files open.

The thread is a daemon thread: it never holds the process up at exit, and one blocked on
a mount that is going away returns with ENOTCONN.

The GIL: when its ``getxattr`` returns, the canary needs the GIL back from the event loop
thread before it can read the clock. CPython hands it over only when the holder blocks or
after the switch interval (5 ms), and a busy loop re-takes it after each short syscall
before the canary is even scheduled (the convoy effect), so a round trip would read up to
5 ms high -- measured: a 6-8 ms canary p99 next to a 3.5 ms fio p99. While the canary
runs, the switch interval is :data:`SWITCH_INTERVAL` (0.2 ms); it only matters when a
thread waits for the GIL, which outside the canary is rare in this daemon (blocking
syscalls of remote backends run in threads that mostly sit in the syscall).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
import time

from qosfs.accounting import FineHistogram

__all__ = ["INTERVAL", "PROBE_XATTR", "LatencyProbe"]

log = logging.getLogger(__name__)

PROBE_XATTR = b"user.qosfs.latency-probe"
INTERVAL = 0.002  # seconds between the end of one canary and the start of the next
SWITCH_INTERVAL = 0.0002  # sys.setswitchinterval() while the canary runs


class LatencyProbe:
    """A thread timing canary requests through ``path`` (the mountpoint).

    Args:
        path: The mount's root.
        tids: A set the fs shares: the canary thread's id is in it while it runs, so the
            handler knows which ``getxattr`` calls are ours.
        interval: Pause between canaries.
    """

    def __init__(self, path: str, tids: set[int], interval: float = INTERVAL) -> None:
        self.path = path
        self.tids = tids
        self.interval = interval
        self.histogram = FineHistogram()
        self.sent = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._saved_interval: float | None = None

    def __repr__(self) -> str:
        return f"<LatencyProbe {self.path} running={self.running} sent={self.sent}>"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def snapshot(self) -> tuple[int, ...]:
        return self.histogram.snapshot()

    def start(self) -> None:
        if self.running:
            return
        self._stop = threading.Event()
        if self._saved_interval is None:
            self._saved_interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL)
        self._thread = threading.Thread(target=self._run, args=(self._stop,),
                                        name="qosfs-latency-probe", daemon=True)
        self._thread.start()
        log.debug("latency probe started on %s", self.path)

    def stop(self) -> None:
        """Ask the thread to end after its current canary (does not wait)."""
        if self._thread is not None:
            self._stop.set()
            log.debug("latency probe stopping (%d sent)", self.sent)
        if self._saved_interval is not None:
            sys.setswitchinterval(self._saved_interval)
            self._saved_interval = None

    def _run(self, stop: threading.Event) -> None:
        tid = threading.get_native_id()
        self.tids.add(tid)
        now = time.perf_counter_ns
        try:
            while not stop.is_set():
                start = now()
                try:
                    os.getxattr(self.path, PROBE_XATTR)
                except OSError as exc:
                    if exc.errno != errno.ENODATA:  # the mount is going away
                        log.debug("latency probe stops: %s", exc)
                        return
                self.histogram.observe(now() - start)
                self.sent += 1
                stop.wait(self.interval)
        finally:
            self.tids.discard(tid)
