"""``python -m bench live-change``: how fast a raised cap reaches a writer already waiting.

DESIGN §4.4: a ``ctl set`` or ``reload`` is in force within 100 ms, including for requests
already parked. Setup: a qosfs mount of a scratch tmpfs whose class ``capped`` allows
1 MiB/s (burst 1 MiB); one writer process loops 1 MiB ``pwrite`` calls into it and
stamps the completion of each with ``CLOCK_MONOTONIC`` (shared by every process). Each
repetition lowers the cap to 1 MiB/s, waits until the writer is parked (queue depth >= 1;
each 1 MiB write then waits ~1 s), then raises the cap to 4 GiB/s and notes the instant
the request left for the socket.

Figures, per repetition:

* ``delay``: from sending the change until the parked write completes -- the change's
  processing, the wake-up of the parked request, its backing write and the FUSE reply;
* ``ctl round trip``: from sending until the daemon's reply is back;
* ``rate after``: the writer's rate over the 16 writes following the release, against the
  1 MiB/s before: the rate follows, not just one request.

Methods: ``set`` through the socket (the client in-process), ``reload`` of a whole policy
text, and ``qosfs ctl set`` as a subprocess (its delay includes starting Python, which is
not the daemon's doing, and is reported separately).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.system import REPO, BenchError, QosfsMount, machine_info, require_root, tmpfs_area
from qosfs.ctl import Client, checked

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
path, stop = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
block = b"w" * (1 << 20)
done = []
i = 0
while not os.path.exists(stop):
    os.pwrite(fd, block, (i % 32) << 20)
    done.append(time.monotonic())
    i += 1
os.close(fd)
print(json.dumps(done))
"""
METHODS = (("set", 5), ("reload", 3), ("cli-set", 2))
PARKED_PHASE = 3.5  # seconds under the low cap before raising it


def _set(sock: str, cap: str, burst: str) -> dict[str, Any]:
    with Client(sock) as client:
        return checked(client.request({"cmd": "set", "target": "class", "name": "capped",
                                       "changes": {"write_bandwidth": cap, "burst": burst}}))


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


def _raise(method: str, sock: str, policy: Path) -> tuple[float, float]:
    """Raise the cap by ``method``; returns (sent, replied) monotonic instants."""
    if method == "cli-set":
        cmd = [sys.executable, "-m", "qosfs", "ctl", "--socket", sock, "set", "capped",
               f"write_bandwidth={HIGH}", "burst=64MiB"]
        sent = time.monotonic()
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
        return sent, time.monotonic()
    with Client(sock) as client:
        if method == "set":
            body = {"cmd": "set", "target": "class", "name": "capped",
                    "changes": {"write_bandwidth": HIGH, "burst": "64MiB"}}
        else:
            body = {"cmd": "reload", "text": POLICY.format(cap=HIGH, burst="64MiB"),
                    "source": str(policy)}
        sent = time.monotonic()
        checked(client.request(body))
        return sent, time.monotonic()


def _analyse(done: list[float], lowered: float, sent: float,
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


def run(out: Path) -> int:
    try:
        require_root("bench live-change")
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    info = machine_info("n/a")
    reps: list[dict[str, Any]] = []
    with tmpfs_area("256m", ["src", "mnt", "work"]) as top:
        src, mnt, work = top / "src", top / "mnt", top / "work"
        (src / "capped").mkdir()
        policy, sock, stop = work / "policy.toml", str(work / "ctl.sock"), work / "stop"
        policy.write_text(POLICY.format(cap=LOW, burst="1MiB"))
        args = ["--policy", str(policy), "--socket", sock]
        with QosfsMount(str(src), str(mnt), args, str(work / "qosfs.log")):
            writer = subprocess.Popen([sys.executable, "-c", WRITER, str(mnt / "capped" / "f"),
                                       str(stop)], stdout=subprocess.PIPE, text=True)
            marks: list[tuple[str, float, float, float, bool]] = []
            try:
                for method, count in METHODS:
                    for _ in range(count):
                        _set(sock, LOW, "1MiB")
                        lowered = time.monotonic()
                        time.sleep(PARKED_PHASE)  # a few writes at 1 MiB/s, then one parks
                        parked = _parked(sock)
                        sent, replied = _raise(method, sock, policy)
                        marks.append((method, lowered, sent, replied, parked))
                        time.sleep(0.5)  # the writer runs free for a while
            finally:
                stop.touch()
                output, _ = writer.communicate(timeout=60)
            done = json.loads(output)
            for method, lowered, sent, replied, parked in marks:
                reps.append({"method": method, "parked_before": parked,
                             **_analyse(done, lowered, sent, replied)})
    return _report(out, info, reps)


def _report(out: Path, info: dict[str, Any], reps: list[dict[str, Any]]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for method, _ in METHODS:
        delays = [r["delay_ms"] for r in reps if r["method"] == method]
        summary[method] = {"median_delay_ms": statistics.median(delays),
                           "max_delay_ms": max(delays), "n": len(delays)}
    doc = {"benchmark": "live-change", "machine": info, "low": LOW, "high": HIGH,
           "summary": summary, "repetitions": reps}
    (out / "live-change.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [
        "# Live change: a raised cap reaching a parked writer",
        "",
        f"{info['date']}, {info['hostname']}, {info['nproc']} CPU, kernel {info['kernel']}, "
        f"commit {info['git_commit']}. Cap {LOW} (burst 1 MiB) raised to {HIGH} while a "
        "1 MiB write is parked; see bench/live_change.py for the method.",
        "",
        "| method | parked | delay (ms) | ctl round trip (ms) | rate before (MiB/s) "
        "| rate after (MiB/s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in reps:
        lines.append(f"| {r['method']} | {'yes' if r['parked_before'] else 'NO'} "
                     f"| {r['delay_ms']:.1f} | {r['round_trip_ms']:.1f} "
                     f"| {r['rate_before_mib_s']:.2f} | {r['rate_after_mib_s']:.0f} |")
    lines += ["", "| method | median delay (ms) | max delay (ms) |", "|---|---|---|"]
    for method, s in summary.items():
        lines.append(f"| {method} | {s['median_delay_ms']:.1f} | {s['max_delay_ms']:.1f} |")
    lines += ["", "`cli-set` includes starting a Python interpreter for `qosfs ctl`; "
              "`set` and `reload` time the daemon alone (request sent -> parked write "
              "completed)."]
    (out / "live-change.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / 'live-change.md'} and {out / 'live-change.json'}")
    ok = all(r["parked_before"] for r in reps) and summary["set"]["max_delay_ms"] < 100
    return 0 if ok else 1


def default_out() -> Path:
    return REPO / "bench" / "results"
