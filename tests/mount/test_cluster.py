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

# Writes 1 MiB blocks (a fixed pattern, over a 32 MiB region) from start_at to stop_at and
# prints [(seconds since start_at, bytes acknowledged)], or a negative errno if one failed.
WRITER = r"""
import json, os, sys, time
path, start_at, stop_at = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
block = bytes(range(256)) * 4096
while time.time() < start_at:
    time.sleep(0.001)
marks, done = [], 0
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
try:
    while time.time() < stop_at:
        done += os.pwrite(fd, block, done % (32 << 20))
        marks.append((time.time() - start_at, done))
    os.fsync(fd)
except OSError as exc:
    marks.append((time.time() - start_at, -exc.errno))
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

    def writer(self, start_at: float, stop_at: float, name: str = "w",
               user: int | None = None) -> subprocess.Popen[str]:
        python = "/usr/bin/python3" if user is not None else sys.executable
        return subprocess.Popen(
            [python, "-c", WRITER, str(self.mnt / "ckpt" / name), str(start_at), str(stop_at)],
            stdout=subprocess.PIPE, text=True,
            preexec_fn=as_user(user) if user is not None else None)


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


def wait_for(what: str, check: object, timeout: float) -> float:
    """Poll *check* (a callable) until true; seconds it took. Fails after *timeout*."""
    assert callable(check)
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout}s"
        time.sleep(0.02)
    return time.monotonic() - start


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
        nodes: list[Node], redis_server: RedisServer) -> None:
    # 1. All four saturated for 10 s: the cap holds in aggregate and is split evenly.
    t0 = time.time() + 1.0
    procs = [n.writer(t0, t0 + 12.0 if i else t0 + 15.0) for i, n in enumerate(nodes)]
    marks = [marks_of(p) for p in procs]
    shares = [rate(m, 1.5, 11.5) for m in marks]
    total = sum(shares)
    assert abs(total - CAP) <= 0.05 * CAP, shares
    assert all(abs(s - CAP / 4) <= 0.15 * CAP / 4 for s in shares), shares
    # 2. Three stop: the fourth has >= 90% of the cap within a second.
    alone = rate(marks[0], 12.5, 13.0)
    assert alone >= 0.9 * CAP, (alone, rate(marks[0], 13.0, 15.0))
    # The cluster view (ctl status --cluster), read from Redis: all four mounts, one level.
    view = nodes[0].request({"cmd": "cluster"})
    assert view["ok"] and view["state"] == "leased", view
    (level,) = view["levels"]  # type: ignore[misc]
    assert level["level"] == "ckpt" and level["cap"] == CAP * MiB
    assert len(level["nodes"]) == 4

    # 3. A live change on one mount is in force on all four within 500 ms.
    t0 = time.time() + 0.5
    procs = [n.writer(t0, t0 + 6.0, "live") for n in nodes]
    time.sleep(2.0)
    sent = time.monotonic()
    reply = nodes[0].request({"cmd": "set", "target": "class", "name": "ckpt",
                              "changes": {"write_bandwidth": "40MiB/s"}})
    assert reply["ok"], reply

    def adopted() -> bool:
        return all(lv["cap"] == 40 * MiB
                   for n in nodes for lv in n.cluster()["levels"])  # type: ignore[union-attr]

    took = wait_for("the new cap on every mount", adopted, 2.0)
    marks = [marks_of(p) for p in procs]
    assert time.monotonic() - sent >= took and took <= 0.5, took
    after = sum(rate(m, 3.5, 6.0) for m in marks)
    assert abs(after - 40) <= 0.1 * 40, after

    # 4. Redis dies while all four are saturated, then comes back.
    for n in nodes:
        n.request({"cmd": "set", "target": "class", "name": "ckpt",
                   "changes": {"write_bandwidth": f"{CAP}MiB/s"}})
    t0 = time.time() + 0.5
    procs = [n.writer(t0, t0 + 10.0, "storm") for n in nodes]
    time.sleep(2.5)
    redis_server.kill()
    fell = wait_for("every mount on its fallback",
                    lambda: all(n.cluster()["state"] == "fallback" for n in nodes), 3.0)
    assert fell <= 1.0, fell
    time.sleep(2.0)
    redis_server.start()
    resumed = wait_for("every mount leased again",
                       lambda: all(n.cluster()["state"] == "leased" for n in nodes), 5.0)
    assert resumed <= 2.0, resumed
    marks = [marks_of(p) for p in procs]
    # No caller saw an error (marks_of), none waited 2 s beyond what 25 MiB/s implies.
    assert max(longest_wait(m) for m in marks) < 2.0 + 1 / 25
    back = sum(rate(m, 7.5, 10.0) for m in marks)
    assert abs(back - CAP) <= 0.05 * CAP, back
    # Data intact: every file underneath holds the writer's pattern, all of it.
    for n in nodes:
        for name in ("w", "live", "storm"):
            data = (n.src / "ckpt" / name).read_bytes()
            assert data and len(data) % len(PATTERN) == 0
            expected = xxhash.xxh64(PATTERN * (len(data) // len(PATTERN))).hexdigest()
            assert xxhash.xxh64(data).hexdigest() == expected


def test_a_cluster_per_user_class_gives_two_users_on_two_mounts_half_each(
        tmp_tree: Path, redis_server: RedisServer) -> None:
    text = POLICY.format(url=redis_server.url, nodes=2, cap=40,
                         extra='per_user = "fair"')
    pair = [Node(tmp_tree, i, text) for i in range(2)]
    try:
        for n in pair:
            n.mount.start()
        t0 = time.time() + 1.0
        procs = [n.writer(t0, t0 + 8.0, f"u{uid}", user=uid)
                 for n, uid in zip(pair, (4241, 4242), strict=True)]
        shares = [rate(marks_of(p), 2.0, 8.0) for p in procs]
        assert all(abs(s - 20) <= 0.1 * 20 for s in shares), shares
    finally:
        for n in pair:
            n.mount.stop()
