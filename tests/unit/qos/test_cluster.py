"""Cluster-scoped levels against a real redis-server: how grants split a cap, follow a
change, weigh users, expire silent mounts, and fall back when Redis is gone or wrong."""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import trio

from qosfs.policy.loading import parse_policy
from qosfs.qos.cluster import ClusterCoordinator, connect
from qosfs.qos.engine import PolicyQos
from qosfs.qos.levels import RateLevel
from tests.redis_server import RedisServer
from tests.waiting import wait_for

MiB = float(1 << 20)
CAP = 100 * MiB


def policy(server: RedisServer, cap: str = "100MiB/s", extra: str = "") -> str:
    return f"""
[cluster]
redis = "{server.url}"
lease = "100ms"
{extra}
[classes.ckpt]
paths = ["ckpt/**"]
scope = "cluster"
write_bandwidth = "{cap}"
"""


def expect_warnings(caplog: pytest.LogCaptureFixture, *fragments: str) -> None:
    """Each fragment was logged as a warning exactly once (the fallback is logged once,
    not per renewal); those records were expected."""
    records = [r for r in caplog.records if r.levelno == logging.WARNING]
    for fragment in fragments:
        found = [r for r in records if fragment in r.getMessage()]
        assert len(found) == 1, (fragment, [r.getMessage() for r in records])
    for r in records:
        r.expected = True  # type: ignore[attr-defined]


class Mount:
    """One mount's engine and coordinator, without a filesystem."""

    def __init__(self, text: str, node: str) -> None:
        p = parse_policy(text)
        assert p.cluster is not None
        self.coordinator = ClusterCoordinator(p.cluster, node)
        self.qos = PolicyQos(p, level_factory=self.coordinator)
        level = self.qos.classes["ckpt"].level
        share = self.coordinator.shares["ckpt"]  # the store's own record of its levels
        assert share.level is level and isinstance(level, RateLevel)
        self.level, self.share = level, share

    async def renew(self, busy: bool, wrote: float = 0.0) -> bool:
        if busy:
            self.level.waits += 1  # a request parked here since the last renewal
        self.level.bytes_written += int(wrote)
        return await self.coordinator.renew_once()

    @property
    def enforced(self) -> float:
        return self.level.limits.write_bytes.rate


def test_saturated_mounts_split_the_cap_and_a_lone_busy_one_gets_it_all(
        redis_server: RedisServer) -> None:
    mounts = [Mount(policy(redis_server), f"node{i}") for i in range(4)]

    async def main() -> None:
        for _ in range(3):
            for m in mounts:
                assert await m.renew(busy=True)
        for m in mounts:
            assert abs(m.enforced - CAP / 4) < 0.01 * CAP, m.enforced
        for _ in range(2):  # three go quiet: their shares come back to the busy one
            for i, m in enumerate(mounts):
                assert await m.renew(busy=i == 0)
        assert mounts[0].enforced >= 0.98 * CAP
        assert sum(m.enforced for m in mounts) <= 1.0001 * CAP  # float rounding

    trio.run(main)


def test_a_cap_changed_on_one_mount_is_in_force_on_the_others_at_their_next_renewal(
        redis_server: RedisServer) -> None:
    a, b = Mount(policy(redis_server), "a"), Mount(policy(redis_server), "b")

    async def main() -> None:
        for m in (a, b):
            assert await m.renew(busy=True)
        a.qos.swap(parse_policy(policy(redis_server, cap="200MiB/s")))  # a ctl set on a
        assert await a.renew(busy=True)
        assert await b.renew(busy=True)
        assert b.share.caps.write_bytes.rate == 200 * MiB  # b's policy still says 100
        assert abs(b.enforced - 100 * MiB) < 2 * MiB  # half of the new cap
        b.qos.swap(parse_policy(policy(redis_server)))  # b re-reads its unchanged file:
        assert await b.renew(busy=True)  # that is not a change, the cluster cap stays
        assert b.share.caps.write_bytes.rate == 200 * MiB

    trio.run(main)


def test_a_cap_changed_while_a_renewal_is_in_flight_is_kept_and_pushed(
        redis_server: RedisServer) -> None:
    """A ``ctl set`` that lands while a renewal is on its worker thread: the reply carries
    the cap from before the change. It used to overwrite the change on this mount and
    mark it pushed, so the new cap was in force nowhere (slow renewals, under load)."""
    a, b = Mount(policy(redis_server), "a"), Mount(policy(redis_server), "b")
    renew = a.coordinator._renew

    def renew_then_change(reports: list[Any]) -> list[Any]:
        replies = renew(reports)  # answered; the trio thread has not seen it yet
        trio.from_thread.run_sync(
            a.qos.swap, parse_policy(policy(redis_server, cap="40MiB/s")))
        return replies

    async def main() -> None:
        for m in (a, b):
            assert await m.renew(busy=True)
        a.coordinator._renew = renew_then_change  # type: ignore[method-assign]
        assert await a.renew(busy=True)
        a.coordinator._renew = renew  # type: ignore[method-assign]
        assert a.share.caps.write_bytes.rate == 40 * MiB
        for m in (a, b):
            assert await m.renew(busy=True)
        for m in (a, b):
            assert m.share.caps.write_bytes.rate == 40 * MiB
            assert m.enforced < 40 * MiB

    trio.run(main)


def test_a_cluster_per_user_class_splits_by_user_across_mounts(
        redis_server: RedisServer) -> None:
    text = policy(redis_server).replace('scope = "cluster"', 'scope = "cluster"\nper_user = "fair"')
    a, b = Mount(text, "a"), Mount(text, "b")

    async def main() -> None:
        group = a.qos.classes["ckpt"].group
        assert group is not None
        group.level_for(1000)
        group.level_for(1001)  # two users write through a, one through b
        b_group = b.qos.classes["ckpt"].group
        assert b_group is not None
        b_group.level_for(1002)
        for _ in range(3):
            for m in (a, b):
                assert await m.renew(busy=True)
        assert abs(a.enforced - CAP * 2 / 3) < 0.02 * CAP
        assert abs(b.enforced - CAP / 3) < 0.02 * CAP
        assert abs(group.children[1000].limits.write_bytes.rate - CAP / 3) < 0.02 * CAP

    trio.run(main)


def test_a_silent_mount_leaves_after_three_leases(redis_server: RedisServer) -> None:
    a, b = Mount(policy(redis_server), "a"), Mount(policy(redis_server), "b")

    async def main() -> None:
        for m in (a, b):
            assert await m.renew(busy=True)
        assert await a.renew(busy=True)
        assert a.enforced < 0.6 * CAP
        await trio.sleep(0.35)  # b stopped renewing (its node died)
        assert await a.renew(busy=True)
        assert a.enforced >= 0.99 * CAP

    trio.run(main)


def test_without_redis_a_mount_falls_back_at_once_and_resumes(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    m = Mount(policy(redis_server, extra="fallback = 4"), "a")

    async def main() -> None:
        assert await m.renew(busy=True)
        assert m.enforced >= 0.99 * CAP and m.coordinator.stats.state == "leased"
        redis_server.kill()
        start = time.monotonic()
        assert not await m.renew(busy=True)
        assert time.monotonic() - start < 1.0
        assert not await m.renew(busy=True)  # still down: logged once, not per renewal
        assert m.coordinator.stats.state == "fallback"
        assert abs(m.enforced - CAP / 4) < 1.0  # the stated safe rate: cap / 4 nodes
        redis_server.start()
        assert await m.renew(busy=True)
        assert m.coordinator.stats.state == "leased" and m.enforced >= 0.99 * CAP

    trio.run(main)
    expect_warnings(caplog, "the cap divided by 4 nodes", "leases resumed")


def test_last_grant_is_the_default_fallback(redis_server: RedisServer,
                                            caplog: pytest.LogCaptureFixture) -> None:
    a, b = Mount(policy(redis_server), "a"), Mount(policy(redis_server), "b")

    async def main() -> None:
        for _ in range(2):
            for m in (a, b):
                assert await m.renew(busy=True)
        before = a.enforced
        redis_server.kill()
        assert not await a.renew(busy=True)
        assert a.enforced == before  # what it had: the cluster stays near its cap

    trio.run(main)
    expect_warnings(caplog, "enforces its last grant")


def test_a_key_of_the_wrong_type_is_a_clear_error_and_the_fallback(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    m = Mount(policy(redis_server, extra="fallback = 2"), "a")
    _, state, _ = m.coordinator.keys("ckpt", "write_bytes")
    redis_server.client().set(state, "not a hash")

    async def main() -> None:
        assert not await m.renew(busy=True)
        assert m.coordinator.stats.state == "fallback"
        assert "WRONGTYPE" in (m.coordinator.stats.last_error or "")
        assert abs(m.enforced - CAP / 2) < 1.0

    trio.run(main)
    expect_warnings(caplog, "WRONGTYPE")


def test_the_password_comes_from_a_file_or_the_environment_never_the_policy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = RedisServer(tmp_path, "--requirepass", "s3cret")
    server.start()
    try:
        secret = tmp_path / "redis.password"
        secret.write_text("s3cret\n")
        from_file = parse_policy(policy(server, extra=f'password_file = "{secret}"')).cluster
        assert from_file is not None
        assert connect(from_file).ping()
        monkeypatch.setenv("QOSFS_REDIS_PASSWORD", "s3cret")
        from_env = parse_policy(policy(server)).cluster
        assert from_env is not None
        assert connect(from_env).ping()
        monkeypatch.delenv("QOSFS_REDIS_PASSWORD")
        with pytest.raises(redis.AuthenticationError):
            connect(from_env).ping()
    finally:
        server.kill()


def test_a_rediss_url_speaks_tls_to_redis(tmp_path: Path) -> None:
    """rediss:// with the site's CA named in the URL (ssl_ca_certs), against a
    redis-server listening with TLS only."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
         str(cert), "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def listens() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                assert server.poll() is None, "redis-server exited at start"
                return False

        # Until it listens (a renewal before would log a fallback).
        wait_for("redis-server to listen on TLS", listens)
        text = policy(RedisServer(tmp_path)).replace(
            f'"unix://{tmp_path}/redis.sock"',
            f'"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"')
        m = Mount(text, "tls")

        async def main() -> None:
            assert await m.renew(busy=True), m.coordinator.stats.last_error
            assert m.coordinator.stats.state == "leased" and m.enforced >= 0.99 * CAP

        trio.run(main)
    finally:
        server.kill()
        server.wait(timeout=10)
