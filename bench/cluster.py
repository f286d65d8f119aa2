"""``python -m bench cluster``: two mounts sharing one cluster cap through Redis, and
what coordination costs Redis.

Two qosfs daemons on this machine stand for two nodes. They mount two tmpfs trees with
the same policy: class ``ckpt`` capped at 100 MiB/s with ``scope = "cluster"``, leases of
100 ms from a redis-server started here on a Unix socket. The bench shows the split when
both write flat out, what one gets alone, how long a ``ctl set`` takes to be in force on
both, and how long a mount takes to fall back when Redis is killed and to resume when it
returns. Then it measures the lease script's throughput on that Redis with
``redis-benchmark`` (1,000 simulated mounts on one level), which is what sizes Redis for
a cluster: each mount renews each cluster bucket once per lease.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.core.system import QosfsMount, require_root, tmpfs_area

MiB = 1 << 20
CAP = 100  # MiB/s
LEASE = 0.1
POLICY = """
[cluster]
redis = "unix://{sock}"
lease = "100ms"
fallback = 2

[classes.ckpt]
paths = ["ckpt/**"]
scope = "cluster"
write_bandwidth = "{cap}MiB/s"
"""
WRITER = r"""
import json, os, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
block, done, start = b"c" * (1 << 20), 0, time.time()
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
while time.time() - start < seconds:
    done += os.pwrite(fd, block, done % (32 << 20))
os.close(fd)
print(json.dumps({"seconds": time.time() - start, "bytes": done}))
"""


class _Redis:
    """A redis-server of the bench's own on a Unix socket (killed by PID)."""

    def __init__(self, directory: Path) -> None:
        self.sock = str(directory / "redis.sock")
        self.directory = directory
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found: make deps installs it")
        self.proc = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", self.sock, "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while self.cli("PING") != "PONG":
            if time.monotonic() > deadline:
                raise SystemExit("redis-server did not start")
            time.sleep(0.02)

    def cli(self, *args: str) -> str:
        out = subprocess.run(["redis-cli", "-s", self.sock, *args], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
        if os.path.exists(self.sock):
            os.unlink(self.sock)


def _status(sock: str) -> dict[str, Any]:
    from qosfs.control.ctl import call

    return call(sock, {"cmd": "status"})["cluster"]  # type: ignore[no-any-return]


def _write(mounts: list[tuple[QosfsMount, str]], seconds: float) -> list[float]:
    """MiB/s each of *mounts* writes flat out for *seconds*, all at once."""
    procs = [subprocess.Popen([sys.executable, "-c", WRITER,
                               f"{m.mountpoint}/ckpt/f", str(seconds)],
                              stdout=subprocess.PIPE, text=True) for m, _ in mounts]
    out = [json.loads(p.communicate(timeout=seconds + 60)[0]) for p in procs]
    return [o["bytes"] / MiB / o["seconds"] for o in out]


def _until(check: Any, timeout: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.01)
    return None


def _script_throughput(redis: _Redis) -> dict[str, Any]:
    """Lease-script calls per second one Redis serves: redis-benchmark, 1,000 mounts on
    one level, 50 clients, pipelines of 10 (one renewal round trip per mount)."""
    from qosfs.qos.cluster import LEASE_SCRIPT

    sha = redis.cli("SCRIPT", "LOAD", LEASE_SCRIPT)
    keys = ["bench:{bench:ckpt}:caps", "bench:{bench:ckpt}:write_bytes",
            "bench:{bench:ckpt}:write_bytes:exp"]
    cmd = ["redis-benchmark", "-s", redis.sock, "-n", "200000", "-c", "50", "-P", "10",
           "-r", "1000", "-q", "EVALSHA", sha, "3", *keys, "node:__rand_int__", "1", "1",
           "0", "100", "init", str(CAP * MiB), "write_bytes"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout
    found = re.findall(r"([0-9.]+) requests per second", out)
    calls = float(found[-1]) if found else 0.0
    nodes = redis.cli("ZCARD", keys[2])
    return {"script_calls_per_second": calls, "mounts_simulated": int(nodes or 0),
            "command": " ".join(cmd[:12]) + " ..."}


def run() -> int:
    require_root("mounting two qosfs daemons")
    results: dict[str, Any] = {"cap_mib_s": CAP, "lease_s": LEASE}
    with tempfile.TemporaryDirectory(prefix="qosfs-cluster-") as tmp, \
            tmpfs_area("512m", ["src0", "src1", "mnt0", "mnt1"]) as top:
        redis = _Redis(Path(tmp))
        redis.start()
        try:
            policy = Path(tmp) / "policy.toml"
            policy.write_text(POLICY.format(sock=redis.sock, cap=CAP))
            mounts = []
            for i in range(2):
                (top / f"src{i}" / "ckpt").mkdir()
                sock = f"{tmp}/ctl{i}.sock"
                m = QosfsMount(str(top / f"src{i}"), str(top / f"mnt{i}"),
                               ["--policy", str(policy), "--socket", sock],
                               f"{tmp}/qosfs{i}.log")
                mounts.append((m.__enter__(), sock))
            try:
                results.update(_measure(mounts, redis))
            finally:
                for m, _ in mounts:
                    m.__exit__(None, None, None)
            results["redis"] = _script_throughput(redis)
        finally:
            redis.kill()
    _print(results)
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "cluster.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _measure(mounts: list[tuple[QosfsMount, str]], redis: _Redis) -> dict[str, Any]:
    r: dict[str, Any] = {}
    before = [_status(sock)["renewals"] for _, sock in mounts]
    started = time.monotonic()
    both = _write(mounts, 8.0)
    r["both_mib_s"] = [round(x, 1) for x in both]
    r["alone_mib_s"] = round(_write(mounts[:1], 5.0)[0], 1)
    renewals = [_status(sock)["renewals"] - b for (_, sock), b in zip(mounts, before,
                                                                       strict=True)]
    elapsed = time.monotonic() - started
    # One lease-script call per cluster bucket per renewal (here one bucket).
    r["redis_calls_per_mount_per_level_s"] = round(sum(renewals) / len(renewals) / elapsed, 1)

    from qosfs.control.ctl import call

    sent = time.monotonic()
    call(mounts[0][1], {"cmd": "set", "target": "class", "name": "ckpt",
                        "changes": {"write_bandwidth": "60MiB/s"}})
    r["change_in_force_s"] = _until(lambda: all(
        lv["cap"] == 60 * MiB for _, s in mounts for lv in _status(s)["levels"]), 5.0)
    r["change_asked_at_s"] = round(time.monotonic() - sent, 3)
    redis.kill()
    r["fallback_after_s"] = _until(
        lambda: all(_status(s)["state"] == "fallback" for _, s in mounts), 5.0)
    redis.start()
    r["resumed_after_s"] = _until(
        lambda: all(_status(s)["state"] == "leased" for _, s in mounts), 5.0)
    return r


def _print(r: dict[str, Any]) -> None:
    both = r["both_mib_s"]
    print(f"two mounts, one cluster cap of {r['cap_mib_s']} MiB/s (lease {r['lease_s']}s):")
    print(f"  both writing:     {both[0]:.1f} + {both[1]:.1f} = {sum(both):.1f} MiB/s")
    print(f"  one alone:        {r['alone_mib_s']:.1f} MiB/s")
    print(f"  ctl set on one, in force on both after {r['change_in_force_s']:.3f} s")
    print(f"  Redis killed: both on their fallback after {r['fallback_after_s']:.3f} s; "
          f"restarted: leased again after {r['resumed_after_s']:.3f} s")
    print(f"  Redis calls per mount per cluster level: "
          f"{r['redis_calls_per_mount_per_level_s']}/s")
    red = r["redis"]
    print(f"lease script on this Redis: {red['script_calls_per_second']:,.0f} calls/s "
          f"({red['mounts_simulated']} simulated mounts on one level)")
