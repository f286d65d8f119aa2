"""``python -m bench soak [--minutes N]``: mixed traffic and live changes for N minutes.

A qosfs mount of a scratch tmpfs, with a policy (a capped per-user checkpoint class, a
high-priority dataset class, a metadata cap), serves at once:

* readers: dataset files read whole or at random offsets, every whole read checked
  against the xxhash the file was written with;
* writers: checkpoint files of 4-24 MiB written in 1 MiB blocks, fsynced, read back and
  checked, some later deleted;
* a metadata worker: create, stat, rename, xattrs, symlinks, listdir, unlink, mkdir, rmdir;
* a controller: ``ctl set`` of the checkpoint cap every half second, an invalid change
  (which must be refused) and a reload now and then, status and stats.

At the end every surviving file is checked through the mount and in the source, and the
daemon is judged: descriptors (``/proc/PID/fd``, after the kernel was asked to forget
what it caches) and RSS must not grow, and its log must hold no ERROR, WARNING or
traceback. Figures go to ``soak.md`` / ``soak.json``; the exit code is 1 if a check fails.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import xxhash

from bench.core.system import BenchError, QosfsMount, machine_info, require_root, tmpfs_area
from qosfs.control.ctl import Client

MiB = 1 << 20
POLICY = """
[classes.checkpoints]
paths = ["ckpt/**"]
write_bandwidth = "64MiB/s"
burst = "8MiB"
per_user = "fair"
priority = "low"

[classes.datasets]
paths = ["data/**"]
priority = "high"

[classes.meta]
paths = ["meta/**"]
meta_iops = 2000

[classes.default]
"""
CAPS = ("32MiB/s", "64MiB/s", "128MiB/s", "256MiB/s")
DATA_FILES, DATA_SIZE = 8, 8 * MiB
SAMPLE_EVERY = 5.0


def default_out() -> Path:
    return Path(__file__).resolve().parent / "results"


def _digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(MiB):
            h.update(block)
    return h.hexdigest()


def _daemon(pid: int) -> dict[str, int]:
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")),
            "rss_kib": int(status["VmRSS"].split()[0]),
            "threads": int(status["Threads"])}


def _forget() -> None:
    """Ask the kernel to drop dentries and inodes, so it sends FORGETs to the daemon."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")
    time.sleep(1.0)


class Soak:
    def __init__(self, mnt: Path, src: Path, sock: str, policy: Path, deadline: float) -> None:
        self.mnt, self.src, self.sock, self.policy = mnt, src, sock, policy
        self.deadline = deadline
        self.lock = threading.Lock()
        self.expected: dict[str, str] = {}  # relative path -> xxh3_128 of what it holds
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def fail(self, what: str) -> None:
        with self.lock:
            if len(self.failures) < 50:
                self.failures.append(what)

    def running(self) -> bool:
        return time.monotonic() < self.deadline and len(self.failures) < 50

    def guard(self, name: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self.fail(f"{name}: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ workers

    def reader(self, seed: int) -> None:
        rnd = random.Random(seed)
        while self.running():
            name = f"data/d{rnd.randrange(DATA_FILES)}"
            if rnd.random() < 0.3:
                got = _digest(self.mnt / name)
                if got != self.expected[name]:
                    self.fail(f"read {name}: digest {got} != {self.expected[name]}")
                self.count("read_bytes", DATA_SIZE)
            else:
                with open(self.mnt / name, "rb", buffering=0) as f:
                    for _ in range(16):
                        f.seek(rnd.randrange(DATA_SIZE - 4096))
                        self.count("read_bytes", len(f.read(rnd.choice([4096, 65536]))))
            self.count("reads")

    def writer(self, seed: int) -> None:
        rnd = random.Random(seed)
        mine: list[str] = []
        i = 0
        while self.running():
            name = f"ckpt/w{seed}-{i}.pt"
            i += 1
            h = xxhash.xxh3_128()
            size = rnd.randrange(4, 25) * MiB
            with open(self.mnt / name, "wb", buffering=0) as f:
                for _ in range(size // MiB):
                    block = rnd.randbytes(MiB)
                    f.write(block)
                    h.update(block)
                os.fsync(f.fileno())
            with self.lock:
                self.expected[name] = h.hexdigest()
            self.count("write_bytes", size)
            if _digest(self.mnt / name) != h.hexdigest():
                self.fail(f"read back {name}: digest differs")
            mine.append(name)
            if len(mine) > 3:
                old = mine.pop(rnd.randrange(len(mine) - 1))
                os.unlink(self.mnt / old)
                with self.lock:
                    del self.expected[old]
            self.count("checkpoints")

    def metadata(self, seed: int) -> None:
        rnd = random.Random(seed)
        base = self.mnt / "meta"
        i = 0
        while self.running():
            d = base / f"dir{i % 7}"
            d.mkdir(exist_ok=True)
            f = d / f"f{i}"
            f.write_bytes(b"m" * rnd.randrange(0, 8192))
            os.setxattr(f, "user.soak", str(i).encode())
            if os.getxattr(f, "user.soak") != str(i).encode():
                self.fail(f"xattr of {f}")
            os.symlink(f.name, d / f"l{i}")
            os.rename(f, d / f"g{i}")
            os.lstat(d / f"l{i}")  # dangling now: its target was renamed
            names = os.listdir(d)
            if f"g{i}" not in names:
                self.fail(f"listdir {d}: g{i} missing")
            if len(names) > 40:
                for name in names:
                    os.unlink(d / name)
                d.rmdir()
            i += 1
            self.count("meta_rounds")

    def controller(self, seed: int) -> None:
        rnd = random.Random(seed)
        with Client(self.sock) as client:
            while self.running():
                time.sleep(0.5)
                roll = rnd.random()
                if roll < 0.1:
                    reply = client.request({"cmd": "set", "target": "class",
                                            "name": "checkpoints",
                                            "changes": {"write_bandwidth": "-1MiB/s"}})
                    if reply.get("code") != "policy":
                        self.fail(f"invalid set not refused: {reply}")
                    self.count("ctl_rejected")
                elif roll < 0.2:
                    reply = client.request({"cmd": "reload"})
                    self.count("ctl_reloads")
                else:
                    reply = client.request({"cmd": "set", "target": "class",
                                            "name": "checkpoints",
                                            "changes": {"write_bandwidth": rnd.choice(CAPS)}})
                    self.count("ctl_sets")
                if roll >= 0.1 and not reply.get("ok"):
                    self.fail(f"ctl change refused: {reply}")
                for cmd in ("status", "stats"):
                    if not client.request({"cmd": cmd}).get("ok"):
                        self.fail(f"ctl {cmd} failed")

    # ------------------------------------------------------------------ checks

    def final_check(self) -> int:
        checked = 0
        for name, digest in sorted(self.expected.items()):
            for root in (self.mnt, self.src):
                if _digest(root / name) != digest:
                    self.fail(f"final: {root / name} digest differs")
            checked += 1
        return checked


def run(out: Path, minutes: float) -> int:
    require_root("the soak")
    seconds = minutes * 60
    with tmpfs_area("3g", ["src", "mnt"]) as area:
        src, mnt = area / "src", area / "mnt"
        for sub in ("data", "ckpt", "meta"):
            (src / sub).mkdir()
        policy = area / "policy.toml"
        policy.write_text(POLICY)
        sock, log_file = str(area / "ctl.sock"), str(area / "qosfs.log")
        with QosfsMount(str(src), str(mnt), ["--policy", str(policy), "--socket", sock],
                        log_file) as daemon:
            if daemon.pid is None:
                raise BenchError("cannot find the daemon's pid")
            soak = Soak(mnt, src, sock, policy, time.monotonic() + seconds)
            for i in range(DATA_FILES):
                data = random.Random(1000 + i).randbytes(DATA_SIZE)
                (mnt / f"data/d{i}").write_bytes(data)
                soak.expected[f"data/d{i}"] = xxhash.xxh3_128(data).hexdigest()
            _forget()
            start = _daemon(daemon.pid)
            samples = [{"t": 0.0, **start}]
            workers = [("reader", soak.reader, 3), ("writer", soak.writer, 2),
                       ("metadata", soak.metadata, 1), ("controller", soak.controller, 1)]
            threads = [threading.Thread(target=soak.guard, args=(name, fn, seed * 10 + k))
                       for seed, (name, fn, n) in enumerate(workers) for k in range(n)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                time.sleep(SAMPLE_EVERY)
                samples.append({"t": round(time.monotonic() - t0, 1), **_daemon(daemon.pid)})
            elapsed = time.monotonic() - t0
            checked = soak.final_check()
            _forget()
            end = _daemon(daemon.pid)
            stats = Client(sock).request({"cmd": "stats"})
        log = Path(log_file).read_text(errors="replace")
    bad_log = [line for line in log.splitlines()
               if re.search(r" (ERROR|WARNING|CRITICAL) |Traceback", line)]
    third = [s for s in samples if s["t"] >= elapsed / 3]
    rss_mid = third[0]["rss_kib"] if third else start["rss_kib"]
    result: dict[str, Any] = {
        "machine": machine_info("n/a"), "minutes": round(elapsed / 60, 2),
        "counts": soak.counts, "files_checked": checked, "failures": soak.failures,
        "daemon_start": start, "daemon_end": end, "rss_after_first_third_kib": rss_mid,
        "samples": samples, "log_problems": bad_log[:20],
        "generation": stats.get("generation"),
    }
    checks = {
        "data digests match": not soak.failures,
        "no fd growth (end <= start + 8 after forgets)": end["fds"] <= start["fds"] + 8,
        "RSS stable (end <= 1.25 x after first third)": end["rss_kib"] <= rss_mid * 1.25,
        "no ERROR/WARNING/traceback in the log": not bad_log,
    }
    result["checks"] = checks
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "soak.md").write_text(_report(result))
    print(_report(result))
    return 0 if all(checks.values()) else 1


def _report(r: dict[str, Any]) -> str:
    c, s, e = r["counts"], r["daemon_start"], r["daemon_end"]
    lines = [f"# soak: {r['minutes']} min of mixed traffic and live changes",
             "", f"machine: {r['machine']['nproc']} CPUs, kernel {r['machine']['kernel']}, "
             f"commit {r['machine']['git_commit']}, load at start "
             f"{' '.join(r['machine']['loadavg_start'])}", "",
             "| what | figure |", "|---|---|",
             f"| read | {c.get('read_bytes', 0) / MiB:.0f} MiB in {c.get('reads', 0)} passes |",
             f"| written (fsynced, checked) | {c.get('write_bytes', 0) / MiB:.0f} MiB in "
             f"{c.get('checkpoints', 0)} checkpoints |",
             f"| metadata rounds (9 ops each) | {c.get('meta_rounds', 0)} |",
             f"| ctl set / reload / refused | {c.get('ctl_sets', 0)} / "
             f"{c.get('ctl_reloads', 0)} / {c.get('ctl_rejected', 0)} "
             f"(generation {r['generation']}) |",
             f"| files checked at the end (mount and source) | {r['files_checked']} |",
             f"| daemon fds start -> end | {s['fds']} -> {e['fds']} |",
             f"| daemon RSS start / after 1/3 / end | {s['rss_kib'] / 1024:.1f} / "
             f"{r['rss_after_first_third_kib'] / 1024:.1f} / {e['rss_kib'] / 1024:.1f} MiB |",
             f"| daemon threads start -> end | {s['threads']} -> {e['threads']} |", "",
             *(f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in r["checks"].items())]
    lines += [f"  - {f}" for f in r["failures"][:10]]
    lines += [f"  - log: {line}" for line in r["log_problems"][:10]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(run(default_out(), float(sys.argv[1]) if len(sys.argv) > 1 else 3.0))
