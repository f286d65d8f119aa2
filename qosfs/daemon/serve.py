"""A mount served: the trio loop, signals, the drain, a handover's commit or take-back,
and the clean unmount.

:func:`serve_mount` serves a :class:`~qosfs.daemon.assembly.Daemon` built on any path of
the mount (:mod:`qosfs.daemon.start`: after the fork, the checks, the source opened), in
this order:

1. the control socket, the metrics listener and the handover socket are bound
   (:func:`qosfs.daemon.assembly.bind_services`; an adopted session's came with it, or are
   bound after it), and a first process starts its crash journal empty;
2. the session starts: ``pyfuse3.init`` mounts (the source was opened before, so
   mounting in place over it works), or a predecessor's session is adopted;
3. the trio loop starts the services (listening, so they answer from here on), then
   stats the mount from a thread: the kernel's INIT answered, the keeper takes its
   copy of the connection (:mod:`qosfs.daemon.takeover.crash_guard`), the connection is
   tuned, and the mount is ready: ``READY=1`` to systemd (``Type=notify``,
   :mod:`qosfs.daemon.notify`), or the waiting parent released
   (:mod:`qosfs.daemon.daemonize`). SIGHUP reloads the policy (``RELOADING=1`` ...
   ``READY=1`` around it);
4. SIGTERM/SIGINT: ``STOPPING=1``, the latency canary stopped, the drain (every limit
   lifted, parked requests served), then ``pyfuse3.terminate()``, which lets in-flight
   requests finish before ``main()`` returns;
5. a loop that ended for a successor commits the handover (the process then exits with
   the mount in place) or takes the session back and serves again; otherwise the mount
   is removed, the journal ended, and what the process holds is closed.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack

import pyfuse3
import trio

from qosfs.core.failures import Failures
from qosfs.core.mountinfo import mount_type
from qosfs.daemon import tuning
from qosfs.daemon.assembly import Daemon, bind_services, bind_services_after_adoption
from qosfs.daemon.config import MountConfig
from qosfs.daemon.notify import notify
from qosfs.daemon.supervise import Service, supervised
from qosfs.daemon.topology import QOSFS_FSTYPE
from qosfs.qos.interface import QosEngine
from qosfs.qos.latency.loop import LatencyLoop

log = logging.getLogger(__name__)


# pyfuse3 gives every request its own task, up to max_tasks, and stops reading
# /dev/fuse when they are all busy. A request parked by QoS holds a task, so the limit
# must exceed what may be parked at once (qosfs.qos.bounds bounds it at 3,072 in all) by a
# reserve for requests that need no tokens; trio tasks are cheap, so be generous.
MAX_TASKS = 4096
MIN_TASKS = 4

# SIGTERM: limits are lifted, parked requests are served (waiting at most DRAIN_DEADLINE,
# well below the unit's TimeoutStopSec=60), then requests are served DRAIN_GRACE more so
# that a write split in two requests, and the close after it, finish; then the mount goes.
DRAIN_GRACE = 0.25
DRAIN_DEADLINE = 10.0


def main_arguments(cfg: MountConfig) -> dict[str, int]:
    """``pyfuse3.main``'s arguments: busy polling where this pyfuse3 has it (built by
    ``make deps``, deploy/libfuse/pyfuse3-busy-poll.patch; PyPI's has not). A round trip
    of a caller that waits on one request at a time (a data loader's open, its ioctl and
    stat) cost two wake-ups and a pass through the event loop: polling for up to
    ``--busy-poll-us`` after each request took a TCGETS round trip from 36-51 us to 15-20
    and a one-thread loader of 112 KiB files from 6,880 to 10,259 files/s (tmpfs); it
    stops after 4 polls in vain, so requests that come far apart cost no more CPU."""
    arguments = {"min_tasks": MIN_TASKS, "max_tasks": MAX_TASKS}
    if getattr(pyfuse3, "BUSY_POLL_SUPPORTED", False):
        arguments["busy_poll_us"] = cfg.busy_poll_us
    return arguments


def serve_mount(daemon: Daemon, start: Callable[[], None],
                on_ready: Callable[[], None] | None = None, adopting: bool = False) -> int:
    """Serve *daemon*'s mount: bind the services, *start* the session (``pyfuse3.init``),
    serve until unmounted, signalled or handed over to a successor
    (:mod:`qosfs.daemon.takeover.upgrade`), then close what the process holds. A
    successor that fails after this process stopped reading gives the session back here
    (`offer.HandoverOffer.take_back`), and serving goes on.

    *adopting*: *start* takes the session over from a predecessor. Its control socket
    and metrics listener came with the session (``daemon.listeners``), or, from a
    predecessor that did not pass them, are bound after it: a failure to bind them is
    then logged, not fatal (nobody else serves the mount by then).
    """
    cfg, mountpoint, fs = daemon.cfg, daemon.mountpoint, daemon.fs
    handed_over = False
    # Whether the control socket's path is this process's to remove at the end: not
    # while a successor that failed to start hands it back to its predecessor.
    owns_path = not adopting
    try:
        with ExitStack() as stack:
            guard = daemon.guard
            if adopting:
                start()  # a failure here leaves the mount alone: the predecessor takes it back
                owns_path = True
                services, offer = bind_services_after_adoption(daemon, stack)
            else:
                services, offer = bind_services(daemon, stack)
                if guard is not None:
                    guard.attach(daemon)  # before the first request: the journal starts empty
                start()

            def after_init() -> None:
                fs.kernel_opens.log()
                if guard is not None:
                    guard.keep(daemon)  # the keeper's copy: a crash from here on loses nothing

            unmounted_by_us = False
            try:
                while True:
                    # SIGHUP reloads while the control service listens; ignored, not
                    # fatal, in the pause before that service is restarted after a failure.
                    signal.signal(signal.SIGHUP, signal.SIG_IGN)
                    trio.run(_serve, cfg, mountpoint, daemon.engine, on_ready, services,
                             daemon.latency, daemon.failures, after_init,
                             offer.stopping if offer is not None else None,
                             daemon.adopted_at, daemon.restore_carried)
                    daemon.adopted_at = None
                    if offer is None or offer.successor is None:
                        unmounted_by_us = True
                        break
                    stack.close()  # the handover socket: the successor binds its own
                    if offer.commit():
                        handed_over = True
                        break
                    offer.take_back()  # serving again, with the same tables and listeners
                    if guard is not None and guard.state is not None:
                        guard.attach(daemon, guard.state)  # the successor replaced the journal
                    daemon.adopted_at = offer.stopped_at
                    daemon.balances = daemon.engine.export_balances(offer.to_monotonic)
                    if daemon.latency is not None:  # its times were on the last run's clock
                        daemon.latency_state = daemon.latency.export_state(offer.to_monotonic)
                    services, offer = bind_services_after_adoption(daemon, stack)
                    on_ready = _notify_ready
            finally:
                still_mounted = not handed_over and mount_type(mountpoint) == QOSFS_FSTYPE
                pyfuse3.close(unmount=still_mounted)
                if guard is not None:
                    guard.end(unmounted=not handed_over)
                fs.close_all()
                if handed_over:
                    log.info("%s handed over; this process exits", mountpoint)
                else:
                    log.info("unmounted %s (%s)", mountpoint,
                             "clean" if unmounted_by_us else "after an error")
    finally:
        if daemon.listeners is not None:  # a successor serves them, or nobody will
            if owns_path and not handed_over:
                daemon.listeners.close()
            else:
                daemon.listeners.release()
    return 0


async def _serve(cfg: MountConfig, mountpoint: str, engine: QosEngine,
                 on_ready: Callable[[], None] | None,
                 services: Sequence[tuple[str, Service]] = (),
                 latency: LatencyLoop | None = None, failures: Failures | None = None,
                 after_init: Callable[[], None] | None = None,
                 handing_over: Callable[[], bool] | None = None,
                 adopted_at: float | None = None,
                 before_reading: Callable[[], None] | None = None) -> None:
    """Serve requests and the services until the session ends. *adopted_at*: the session
    was taken over from a process that stopped reading at that ``time.monotonic()``;
    requests wait in the kernel until this one reads, so it reads before the services
    start, and says how long nobody read. *before_reading* runs first, in the loop."""
    failures = failures if failures is not None else Failures()
    async with trio.open_nursery() as nursery:

        async def serve_requests() -> None:
            if adopted_at is not None:
                log.info("adopted %s: %.1f ms without a reader of /dev/fuse", mountpoint,
                         (time.monotonic() - adopted_at) * 1000)
            await pyfuse3.main(**main_arguments(cfg))
            if handing_over is None or not handing_over():
                _notify_stopping()  # the kernel ended the session (fusermount3 -u)
            nursery.cancel_scope.cancel()

        if before_reading is not None:
            before_reading()
        if adopted_at is not None:
            nursery.start_soon(serve_requests)
        nursery.start_soon(_watch_signals, engine, latency, failures)
        for name, service in services:  # already bound: "started" means "answering"
            await nursery.start(supervised, name, service, failures)
        nursery.start_soon(_become_ready, cfg, mountpoint, on_ready, failures, after_init)
        if adopted_at is None:
            await serve_requests()


async def _become_ready(cfg: MountConfig, mountpoint: str,
                        on_ready: Callable[[], None] | None, failures: Failures,
                        after_init: Callable[[], None] | None = None) -> None:
    # stat() through our own mount needs the main loop running, so ask from a thread.
    st = await trio.to_thread.run_sync(os.stat, mountpoint)
    if after_init is not None:  # the kernel answered INIT: what it negotiated is known
        # In a thread: it may start the crash keeper (a process, ~0.1-1 s under load),
        # and the mount serves meanwhile; READY=1 waits for it.
        await trio.to_thread.run_sync(after_init)
    try:
        tuning.tune_connection(st.st_dev, cfg.max_background, cfg.read_ahead_kb)
    except Exception as exc:  # the mount works untuned: not worth taking it down
        failures.record("tuning", exc, "serving with the kernel's defaults")
    log.info("qosfs serving %s on %s", cfg.source, mountpoint)
    # The services were started (listening) before this task: all three now answer.
    (on_ready or _notify_ready)()


def _notify_ready() -> None:
    """Tell systemd (Type=notify) the mount, the control socket and /metrics answer."""
    notify("READY=1")


@functools.cache  # once per process, whichever comes first: a signal or the kernel
def _notify_stopping() -> bool:
    return notify("STOPPING=1")


async def _watch_signals(engine: QosEngine, latency: LatencyLoop | None = None,
                         failures: Failures | None = None) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: finishing in-flight requests, then unmounting",
                     signal.Signals(signum).name)
            _notify_stopping()
            try:
                if latency is not None:  # its canary must not be left waiting on the mount
                    await latency.stop_probe()
                emptied = await _drain(engine)
                log.info("%s; unmounting", "parked requests served" if emptied else
                         f"requests still parked after {DRAIN_DEADLINE:g} s")
            except Exception as exc:  # asked to stop: a bug in draining must not stop that
                (failures or Failures()).record("stopping", exc, "unmounting without draining")
            # No new request is read after terminate(); those already read are served.
            pyfuse3.terminate()
            return


async def _drain(engine: QosEngine) -> bool:
    """Lift every limit, wait until nothing is parked (at most DRAIN_DEADLINE), then serve
    DRAIN_GRACE more; True if the lot emptied in time.

    Parked requests then finish at once, and so does what directly follows them: an
    unaligned 1 MiB O_DIRECT write reaches us as two requests, the second sent only once
    the first is answered, and its caller's close() comes next; unmounting in between
    left callers with a short write and ENOTCONN. New requests during the grace are
    served too; those that arrive after it find the mount gone.
    """
    engine.drain()
    deadline = trio.current_time() + DRAIN_DEADLINE
    emptied = True
    while engine.counters().parked_requests:
        if trio.current_time() >= deadline:
            emptied = False
            break
        await trio.sleep(0.01)
    await trio.sleep(DRAIN_GRACE)
    return emptied
