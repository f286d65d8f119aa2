"""Cluster-wide caps through real mounts: four qosfs daemons on this machine share one
cap through a real redis-server (a Unix socket of the test's own), as four nodes would."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from qosfs.control.ctl import Client
from tests.mounting import QosfsMount, as_user
from tests.redis_server import RedisServer
from tests.waiting import wait_for

pytestmark = pytest.mark.mount

MiB = 1 << 20
CAP = 100  # MiB/s, the cluster write cap the mounts share

POLICY = """
[cluster]
redis = "{url}"
lease = "100ms"
fallback = {nodes}

[classes.ckpt]
paths = ["ckpt/**"]
scope = "cluster"
write_bandwidth = "{cap}MiB/s"
{extra}
"""

# Writes 1 MiB blocks (a fixed pattern, over a 32 MiB region) until the file *stop* exists
# and prints [(time.time(), bytes acknowledged)], or a negative errno if one failed.
WRITER = r"""
import json, os, sys, time
path, stop = sys.argv[1], sys.argv[2]
block = bytes(range(256)) * 4096
marks, done = [], 0
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
try:
    while not os.path.exists(stop):
        done += os.pwrite(fd, block, done % (32 << 20))
        marks.append((time.time(), done))
    os.fsync(fd)
except OSError as exc:
    marks.append((time.time(), -exc.errno))
finally:
    os.close(fd)
print(json.dumps(marks))
"""
PATTERN = bytes(range(256)) * 4096


class Node:
    """One mount (one 'node'): its own source tree, control socket and daemon."""

    def __init__(self, root: Path, index: int, policy: str) -> None:
        self.src, self.mnt = root / f"src{index}", root / f"mnt{index}"
        for d in (self.src, self.mnt, self.src / "ckpt"):
            d.mkdir()
            os.chmod(d, 0o777)
        self.policy = root / f"policy{index}.toml"
        self.policy.write_text(policy)
        self.sock = root / f"ctl{index}.sock"
        self.mount = QosfsMount(self.src, self.mnt, "--policy", str(self.policy),
                                "--socket", str(self.sock))

    def request(self, body: dict[str, object]) -> dict[str, object]:
        with Client(str(self.sock)) as client:
            reply: dict[str, object] = client.request(body)
        return reply

    def cluster(self) -> dict[str, object]:
        status = self.request({"cmd": "status"})
        cluster = status["cluster"]
        assert isinstance(cluster, dict)
        return cluster



Marks = list[tuple[float, int]]


class Writers:
    """Writer processes (one per mount) that run until the test touches their stop file;
    any still running when the test ends (it failed) are killed and reaped, so none
    outlives it holding a pipe."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, nodes: list[Node], name: str,
              users: list[int] | None = None) -> Batch:
        stop = self.root / f"stop-{name}-{len(self.procs)}"
        procs = []
        for i, node in enumerate(nodes):
            user = None if users is None else users[i]
            python = "/usr/bin/python3" if user is not None else sys.executable
            procs.append(subprocess.Popen(
                [python, "-c", WRITER, str(node.mnt / "ckpt" / name), str(stop)],
                stdout=subprocess.PIPE, text=True,
                preexec_fn=as_user(user) if user is not None else None))
        self.procs += procs
        return Batch(stop, procs)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


class Batch:
    """Writers started together, stopped together: ``stop()`` gives each one's marks."""

    def __init__(self, stop: Path, procs: list[subprocess.Popen[str]]) -> None:
        self.stop_file, self.procs = stop, procs

    def stop(self) -> list[Marks]:
        self.stop_file.touch()
        return [marks_of(p) for p in self.procs]


def marks_of(proc: subprocess.Popen[str]) -> list[tuple[float, int]]:
    out, _ = proc.communicate(timeout=120)
    marks = [(float(t), int(b)) for t, b in json.loads(out)]
    assert marks and all(b >= 0 for _, b in marks), f"a write failed: {marks[-3:]}"
    return marks


def rate(marks: list[tuple[float, int]], t0: float, t1: float) -> float:
    """MiB/s acknowledged between t0 and t1."""
    def done_at(t: float) -> int:
        return max((b for s, b in marks if s <= t), default=0)

    return (done_at(t1) - done_at(t0)) / MiB / (t1 - t0)


def longest_wait(marks: list[tuple[float, int]]) -> float:
    """The longest time one 1 MiB write took (between two acknowledgements)."""
    return max(b[0] - a[0] for a, b in itertools.pairwise(marks))


def grants(nodes: list[Node]) -> list[float | None]:
    """Each mount's grant of the cluster write cap, in bytes/s (None: none yet)."""
    return [lv["grant"] for n in nodes for lv in n.cluster()["levels"]]  # type: ignore[union-attr]


def even_split(cap: float, nodes: list[Node], what: str) -> None:
    """Wait until every one of *nodes* is granted an equal share of *cap* MiB/s (each is
    saturated and leased: the state a measurement of the split needs)."""
    share = cap * MiB / len(nodes)
    wait_for(f"{what}: each of {len(nodes)} mounts granted {cap / len(nodes):g} MiB/s",
             lambda: grants(nodes), timeout=10.0,
             until=lambda gs: all(g is not None and abs(g - share) <= 0.02 * share
                                  for g in gs))


def measure(seconds: float) -> tuple[float, float]:
    """A measurement window from now (the state to measure is in force)."""
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


@pytest.fixture
def writers(tmp_tree: Path) -> Iterator[Writers]:
    w = Writers(tmp_tree)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def nodes(tmp_tree: Path, redis_server: RedisServer) -> Iterator[list[Node]]:
    text = POLICY.format(url=redis_server.url, nodes=4, cap=CAP, extra="")
    started: list[Node] = []
    try:
        for i in range(4):
            node = Node(tmp_tree, i, text)
            node.mount.start()
            started.append(node)
        yield started
    finally:
        for node in started:
            node.mount.stop()


def test_four_mounts_share_a_cluster_cap_follow_a_change_and_survive_redis(
        nodes: list[Node], redis_server: RedisServer, writers: Writers) -> None:
    # Each measurement starts once the state it measures is in force (grants settled, as
    # status shows them), not at a fixed time: under load a mount renews late.
    # 1. All four saturated for 10 s: the cap holds in aggregate and is split evenly.
    first, others = writers.start(nodes[:1], "w"), writers.start(nodes[1:], "w")
    even_split(CAP, nodes, "all four writing")
    t0, t1 = measure(10.0)
    marks = others.stop()
    stopped = max(m[-1][0] for m in marks)
    # 2. Three stop: the fourth is granted >= 90% of the cap within a second, and gets it
    # (measured over 2.5 s, as the other phases: over 1 s, a writer starved of CPU on a
    # machine at load 600 got 15 MiB/s with 100 granted).
    wait_for("the lone writer's grant to reach 90% of the cap", lambda: grants(nodes[:1])[0],
             until=lambda g: g is not None and g >= 0.9 * CAP * MiB, timeout=5.0)
    granted = time.time()
    assert granted - stopped <= 1.0, granted - stopped
    a0, a1 = measure(2.5)
    marks.insert(0, first.stop()[0])
    shares = [rate(m, t0, t1) for m in marks]
    total = sum(shares)
    assert abs(total - CAP) <= 0.05 * CAP, shares
    assert all(abs(s - CAP / 4) <= 0.15 * CAP / 4 for s in shares), shares
    alone = rate(marks[0], a0, a1)
    assert alone >= 0.9 * CAP, alone
    # The cluster view (ctl status --cluster), read from Redis: all four mounts, one level.
    view = nodes[0].request({"cmd": "cluster"})
    assert view["ok"] and view["state"] == "leased", view
    (level,) = view["levels"]  # type: ignore[misc]
    assert level["level"] == "ckpt" and level["cap"] == CAP * MiB
    assert len(level["nodes"]) == 4

    # 3. A live change on one mount is in force on all four (bench: within 500 ms).
    live = writers.start(nodes, "live")
    even_split(CAP, nodes, "all four writing")
    sent = time.monotonic()
    reply = nodes[0].request({"cmd": "set", "target": "class", "name": "ckpt",
                              "changes": {"write_bandwidth": "40MiB/s"}})
    assert reply["ok"], reply
    wait_for("the new cap on every mount",
             lambda: [lv["cap"] for n in nodes for lv in n.cluster()["levels"]],  # type: ignore[union-attr]
             until=lambda caps: all(cap == 40 * MiB for cap in caps), timeout=5.0)
    took = time.monotonic() - sent
    # The figure (the lease is 100 ms: in force everywhere within 500 ms) is measured by
    # `python -m bench cluster`; four mounts and their writers on two shared cores may
    # take longer here. A change that did not travel would never arrive (the wait).
    assert took <= 2.0, took
    even_split(40, nodes, "the new cap in force")
    t0, t1 = measure(2.5)
    after = sum(rate(m, t0, t1) for m in live.stop())
    assert abs(after - 40) <= 0.1 * 40, after

    # 4. Redis dies while all four are saturated, then comes back.
    for n in nodes:
        reply = n.request({"cmd": "set", "target": "class", "name": "ckpt",
                           "changes": {"write_bandwidth": f"{CAP}MiB/s"}})
        assert reply["ok"], reply
    storm = writers.start(nodes, "storm")
    even_split(CAP, nodes, "all four writing under the cap again")
    redis_server.kill()
    start = time.monotonic()
    wait_for("every mount on its fallback", lambda: [n.cluster()["state"] for n in nodes],
             until=lambda states: set(states) == {"fallback"}, timeout=3.0)
    fell = time.monotonic() - start
    assert fell <= 1.0, fell
    time.sleep(2.0)  # the outage: the writers go on at the fallback rate
    redis_server.start()
    start = time.monotonic()
    wait_for("every mount leased again", lambda: [n.cluster()["state"] for n in nodes],
             until=lambda states: set(states) == {"leased"}, timeout=5.0)
    resumed = time.monotonic() - start
    assert resumed <= 2.0, resumed
    even_split(CAP, nodes, "the leases resumed")
    t0, t1 = measure(2.5)
    marks = storm.stop()
    # No caller saw an error (marks_of), none waited 2 s beyond what 25 MiB/s implies.
    assert max(longest_wait(m) for m in marks) < 2.0 + 1 / 25
    back = sum(rate(m, t0, t1) for m in marks)
    assert abs(back - CAP) <= 0.05 * CAP, back
    # Data intact: every file underneath holds the writer's pattern, all of it.
    for n in nodes:
        for name in ("w", "live", "storm"):
            data = (n.src / "ckpt" / name).read_bytes()
            assert data and len(data) % len(PATTERN) == 0
            expected = xxhash.xxh64(PATTERN * (len(data) // len(PATTERN))).hexdigest()
            assert xxhash.xxh64(data).hexdigest() == expected


def test_a_cluster_per_user_class_gives_two_users_on_two_mounts_half_each(
        tmp_tree: Path, redis_server: RedisServer, writers: Writers) -> None:
    text = POLICY.format(url=redis_server.url, nodes=2, cap=40,
                         extra='per_user = "fair"')
    pair = [Node(tmp_tree, i, text) for i in range(2)]
    try:
        for n in pair:
            n.mount.start()
        users = writers.start(pair, "u", users=[4241, 4242])
        even_split(40, pair, "both users writing")
        t0, t1 = measure(6.0)
        shares = [rate(m, t0, t1) for m in users.stop()]
        assert all(abs(s - 20) <= 0.1 * 20 for s in shares), shares
    finally:
        writers.close()  # before the unmount: a writer left running keeps the mount busy
        for n in pair:
            n.mount.stop()
