"""Live change: how fast a ``ctl set`` or ``reload`` is in force (DESIGN §4.4: < 100 ms,
including for requests already parked).

One writer process loops ``pwrite`` calls into a capped class of a qosfs mount and stamps
the completion of each with ``CLOCK_MONOTONIC`` (shared by every process, so the suite's
own instants line up with the writer's). Measurements:

**Parked writer** (1 MiB writes). Each repetition lowers the cap to 1 MiB/s (burst 1 MiB),
waits until a write completes and the next one is parked (queue depth >= 1; each write
then waits ~1 s, so none is due for ~0.9 s), raises the cap to 4 GiB/s and notes the
instant the request left for the socket:

* ``delay``: from sending the change until the parked write completes -- the change's
  processing, the wake-up of the parked request, its backing write and the FUSE reply;
* ``ctl round trip``: from sending until the daemon's reply is back;
* ``rate after``: the writer's rate over the 16 writes following the release.

Methods: ``set`` through the socket (the client in-process), ``reload`` of a whole policy
text, and ``qosfs ctl set`` as a subprocess: its delay counts from the instant the command
is started, as an operator's shell starts it, so it includes starting Python and
importing the client (issue 38: at most 100 ms in all).

**ctl status** (issue 38: at most 60 ms): ten whole ``qosfs ctl status`` processes against
the live mount, timed from start to exit, interleaved with ten ``python -c pass`` (the
interpreter alone, the floor of any Python command, measured in the same run).

Both commands run as make install's launcher runs them (``python -P -m qosfs``), with
their bytecode compiled once beforehand, as ``pip install`` leaves an installed tree
(an environment with ``PYTHONDONTWRITEBYTECODE`` set would otherwise compile every module
at every start).

**Step** (256 KiB writes, burst 1 MiB). The cap steps 40 -> 120 -> 40 MiB/s by ``set`` at
known instants; the writer's rate in 100 ms bins shows the step, and ``settle`` is the
time from sending a change until the rate over the next 0.5 s is within 10% of the new
cap, the start of the new rate holding.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.core.context import Run
from bench.core.system import REPO, BenchError, wait_quiet
from bench.suites.live_change.live_report import LiveChangeResult
from qosfs.control.ctl import Client, checked
from qosfs.core.units import parse_bandwidth

MiB = 1 << 20
LOW, HIGH = "1MiB/s", "4GiB/s"
POLICY = """
[classes.capped]
paths = ["capped/**"]
write_bandwidth = "{cap}"
burst = "{burst}"
"""
WRITER = r"""
import os, sys, time, json
path, stop, block = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
buf = b"w" * block
done = []
i = 0
while not os.path.exists(stop):
    os.pwrite(fd, buf, (i % 32) * block)
    done.append(time.monotonic())
    i += 1
os.close(fd)
print(json.dumps(done))
"""
PARKED_PHASE = 3.5  # seconds under the low cap before raising it
STATUS_RUNS = 10
STEP_CAPS = ("40MiB/s", "120MiB/s", "40MiB/s")  # a busy 2-CPU machine still exceeds 120
STEP_BLOCK = 256 << 10
STEP_BIN = 0.1
SETTLE_WINDOW, SETTLE_TOLERANCE = 0.5, 0.10


def qosfs_command(*args: str) -> list[str]:
    """``qosfs ARGS`` as make install's launcher (bin/qosfs) runs it."""
    return [sys.executable, "-P", "-m", "qosfs", *args]


def compile_bytecode(sock: str) -> None:
    """Run ``qosfs ctl status`` once allowed to write its modules' bytecode (pip does as
    much when it installs qosfs): later runs load it rather than compile the sources."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run(qosfs_command("ctl", "--socket", sock, "status"), cwd=REPO, env=env,
                   check=True, capture_output=True)


def _elapsed_ms(cmd: list[str]) -> float:
    start = time.monotonic()
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return (time.monotonic() - start) * 1e3


def measure_ctl_status(run: Run, sock: str) -> dict[str, Any]:
    """Whole ``qosfs ctl status`` processes against the mount at *sock*, and the bare
    interpreter, interleaved (a busy moment of the machine hits both)."""
    status, bare = qosfs_command("ctl", "--socket", sock, "status"), \
        [sys.executable, "-P", "-c", "pass"]
    runs: dict[str, list[float]] = {"status": [], "python": []}
    _, busy = wait_quiet(run.quiet_wait)
    for _ in range(STATUS_RUNS):
        runs["python"].append(_elapsed_ms(bare))
        runs["status"].append(_elapsed_ms(status))
    figures = {"n": STATUS_RUNS, "median_ms": statistics.median(runs["status"]),
               "max_ms": max(runs["status"]),
               "python_median_ms": statistics.median(runs["python"]),
               "busy_before_pct": busy, "runs_ms": runs["status"]}
    run.log(f"  ctl status median {figures['median_ms']:.1f} ms (python alone "
            f"{figures['python_median_ms']:.1f} ms)")
    return figures


def _request(sock: str, body: dict[str, Any]) -> None:
    with Client(sock) as client:
        checked(client.request(body))


def _set_body(cap: str, burst: str) -> dict[str, Any]:
    return {"cmd": "set", "target": "class", "name": "capped",
            "changes": {"write_bandwidth": cap, "burst": burst}}


def _parked(sock: str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with Client(sock) as client:
            status = checked(client.request({"cmd": "status"}))
        level = next(lv for lv in status["levels"] if lv["name"] == "capped")
        if level["queue_depth"] >= 1:
            return True
        time.sleep(0.05)
    return False


def _writes_done(sock: str) -> int:
    with Client(sock) as client:
        stats = checked(client.request({"cmd": "stats"}))
    return sum(a["write_ops"] for a in stats["accounts"] if a["class"] == "capped")


def _freshly_parked(sock: str, timeout: float = 5.0) -> bool:
    """Wait for a write of the capped class to complete, then for the next one to park.

    Under the low cap that write waits ~1 s for its tokens, so a change sent now meets a
    write parked moments ago and not due for ~0.9 s: the first completion after it is the
    release, even for a method as slow as a whole ``qosfs ctl set`` (sent at any moment,
    one run in ~20 met the cap's own next completion instead and showed ~2 ms)."""
    deadline = time.monotonic() + timeout
    before = _writes_done(sock)
    while _writes_done(sock) == before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    time.sleep(0.05)  # the next write reaches the daemon and parks
    return _parked(sock, max(0.0, deadline - time.monotonic()))


def _raise(method: str, sock: str, policy: Path) -> tuple[float, float]:
    """Raise the cap by ``method``; returns (sent, replied) monotonic instants."""
    if method == "cli-set":
        cmd = qosfs_command("ctl", "--socket", sock, "set", "capped",
                            f"write_bandwidth={HIGH}", "burst=64MiB")
        sent = time.monotonic()
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
        return sent, time.monotonic()
    if method == "set":
        body = _set_body(HIGH, "64MiB")
    else:
        body = {"cmd": "reload", "text": POLICY.format(cap=HIGH, burst="64MiB"),
                "source": str(policy)}
    with Client(sock) as client:
        sent = time.monotonic()
        checked(client.request(body))
        return sent, time.monotonic()


def analyse_parked(done: list[float], lowered: float, sent: float,
                   replied: float) -> dict[str, float]:
    after = [t for t in done if t > sent]
    if len(after) < 17:
        raise BenchError("the writer did not keep writing after the change")
    release = after[0]
    rate = 16 / (after[16] - release)  # MiB/s over the 16 writes after the release
    # Under the low cap, once the carried-over burst is spent (first 0.5 s).
    before = [t for t in done if lowered + 0.5 < t <= sent]
    rate_before = (len(before) - 1) / (before[-1] - before[0]) if len(before) > 1 else 0.0
    return {"delay_ms": (release - sent) * 1e3, "round_trip_ms": (replied - sent) * 1e3,
            "rate_after_mib_s": rate, "rate_before_mib_s": rate_before}


def binned_rates(done: list[float], block: int, t0: float, t1: float,
                 width: float) -> list[tuple[float, float]]:
    """The writer's rate (bytes/s) in bins of *width* s from *t0* to *t1*, as (bin start
    relative to *t0*, rate)."""
    n = int((t1 - t0) / width)
    counts = [0] * n
    for t in done:
        i = int((t - t0) / width)
        if 0 <= i < n and t >= t0:
            counts[i] += 1
    return [(round(i * width, 3), c * block / width) for i, c in enumerate(counts)]


def settle_delay(done: list[float], block: int, sent: float, until: float, cap: float,
                 window: float = SETTLE_WINDOW, tolerance: float = SETTLE_TOLERANCE
                 ) -> float | None:
    """Seconds from *sent* until the first completion after which the next *window* s
    move ``cap * window`` bytes within *tolerance*; None if that never happens before
    *until* (the next change)."""
    after = sorted(t for t in done if sent < t <= until)
    for i, start in enumerate(after):
        end = start + window
        if end > until:
            break
        count = bisect.bisect_right(after, end) - (i + 1)
        if abs(count * block / window - cap) <= tolerance * cap:
            return start - sent
    return None


@contextmanager
def _writer(path: Path, stop: Path, block: int) -> Iterator[list[float]]:
    """The writer process while in the block; the list fills with its completion
    instants once it has stopped."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(stop), str(block)],
                            stdout=subprocess.PIPE, text=True)
    done: list[float] = []
    try:
        yield done
    finally:
        stop.touch()
        output, _ = proc.communicate(timeout=60)
        stop.unlink()
    done.extend(json.loads(output))


def measure_parked(run: Run, counts: dict[str, int]
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The parked writer released by each method, and ``ctl status`` against the same
    mount (before the writer starts)."""
    src = run.scratch("live-change")
    (src / "capped").mkdir()
    stop = run.work / "live-change.stop"
    reps = []
    with run.mount(src, POLICY.format(cap=LOW, burst="1MiB")) as m:
        assert m.policy_file is not None
        compile_bytecode(m.socket)
        status = measure_ctl_status(run, m.socket)
        marks: list[tuple[str, float, float, float, bool]] = []
        with _writer(m.path / "capped" / "f", stop, MiB) as done:
            for method, count in counts.items():
                for _ in range(count):
                    _request(m.socket, _set_body(LOW, "1MiB"))
                    lowered = time.monotonic()
                    time.sleep(PARKED_PHASE)  # a few writes at 1 MiB/s, then one parks
                    if method == "cli-set":  # a process start: other tenants' bursts show
                        wait_quiet(run.quiet_wait)
                    parked = _freshly_parked(m.socket)
                    sent, replied = _raise(method, m.socket, m.policy_file)
                    marks.append((method, lowered, sent, replied, parked))
                    time.sleep(0.5)  # the writer runs free for a while
        for method, lowered, sent, replied, parked in marks:
            reps.append({"method": method, "parked_before": parked,
                         **analyse_parked(done, lowered, sent, replied)})
            run.log(f"  parked {method:8s} delay {reps[-1]['delay_ms']:.1f} ms")
    return reps, status


def measure_step(run: Run) -> dict[str, Any]:
    src = run.scratch("live-step")
    (src / "capped").mkdir()
    phase = run.pick(3.0, 2.0)
    stop = run.work / "live-step.stop"
    sends: list[float] = []
    with run.mount(src, POLICY.format(cap=STEP_CAPS[0], burst="1MiB")) as m, \
            _writer(m.path / "capped" / "f", stop, STEP_BLOCK) as done:
        start = time.monotonic()
        for cap in STEP_CAPS[1:]:
            time.sleep(max(0.0, start + phase * (len(sends) + 1) - time.monotonic()))
            body = _set_body(cap, "1MiB")
            with Client(m.socket) as client:
                sends.append(time.monotonic())
                checked(client.request(body))
        time.sleep(phase)
        end = time.monotonic()
    origin = sends[0]
    changes = []
    for i, (sent, cap) in enumerate(zip(sends, STEP_CAPS[1:], strict=False)):
        until = sends[i + 1] if i + 1 < len(sends) else end
        delay = settle_delay(done, STEP_BLOCK, sent, until, parse_bandwidth(cap))
        changes.append({"at_s": round(sent - origin, 3), "from": STEP_CAPS[i], "to": cap,
                        "settle_ms": None if delay is None else delay * 1e3})
        run.log(f"  step {STEP_CAPS[i]} -> {cap}: settle "
                f"{'never' if delay is None else f'{delay * 1e3:.0f} ms'}")
    return {"caps": list(STEP_CAPS), "block": STEP_BLOCK, "bin_s": STEP_BIN,
            "changes": changes,
            "series": [(round(t + start - origin, 3), r) for t, r in
                       binned_rates(done, STEP_BLOCK, start, end, STEP_BIN)]}


def run(run: Run) -> LiveChangeResult:
    counts = ({"set": 2, "reload": 1, "cli-set": 2} if run.quick
              else {"set": 5, "reload": 3, "cli-set": 5})
    reps, status = measure_parked(run, counts)
    summary = {}
    for method in counts:
        delays = [r["delay_ms"] for r in reps if r["method"] == method]
        summary[method] = {"median_delay_ms": statistics.median(delays),
                           "max_delay_ms": max(delays), "n": len(delays)}
    return LiveChangeResult.from_json({
        "low": LOW, "high": HIGH, "repetitions": reps, "summary": summary,
        "all_parked": all(r["parked_before"] for r in reps), "step": measure_step(run),
        "ctl_status": status})
