"""Cluster-scoped levels: caps that hold over every mount, coordinated through Redis.

A class or tenant with ``scope = "cluster"`` is capped over the sum of every mount that
shares the policy's ``[cluster]`` Redis. Requests never wait on Redis:

* **On the request path** a cluster level is a :class:`~qosfs.qos.levels.RateLevel` --
  the same code, the same cost -- whose buckets a :class:`ClusterShare` sets to this
  mount's *grant*.
* **In the background** the :class:`ClusterCoordinator` renews every grant once per
  lease period (``[cluster] lease``, 100 ms by default), in one pipelined round trip on a
  worker thread. Each renewal reports what this mount did in the last period and gets its
  grant from a Lua script that runs atomically on Redis's own clock (:data:`LEASE_SCRIPT`),
  so node clocks do not matter.

How a cap is shared (the script): a mount that had requests waiting at the level is
*saturated* and asks for a share; one that did not reports what it used. Unsaturated
mounts get what they used plus a quarter (and a sliver, so an idle one can start at once);
saturated mounts split the rest of the cap in proportion to their weight (1, or the
number of active users of a cluster ``per_user`` class on that mount, so the split is by
user across the cluster). This is max-min fair and work-conserving: one busy mount gets
the whole cap, several split it evenly, an idle one gives its share back within a lease.
The script keeps running sums, so a renewal costs O(1) however many mounts there are
(plus the removal of mounts gone silent for three leases).

Caps live in Redis (``<prefix>:{<prefix>:<level>}:caps``): the first mount writes its
policy's caps if none are there, a ``ctl set`` or reload that changes a cluster cap
overwrites them, and every mount adopts what Redis holds at its next renewal -- a change
is in force everywhere within one lease period, parked requests included. Keys of one
level share a Redis Cluster hash slot (the ``{...}`` tag), so levels spread over shards.

When Redis cannot be reached (or answers nonsense), a mount switches within one
renewal to its fallback -- its last grant, or the cap divided by ``[cluster] fallback``
nodes -- logs it once, shows it in status and metrics, and retries with backoff (at most
one second apart). Throttling continues locally: nothing errors, nothing waits for Redis.

The engine knows none of this: the coordinator is its token store
(:class:`~qosfs.qos.store.LevelFactory`), which it asks for every level and every
``per_user`` group; whatever is cluster-specific (the shares, the split by user, the
renewals) stays in this module.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import trio

from qosfs.core.limit_kinds import BY_BUCKET, Kind, default_burst
from qosfs.qos.bucket import NO_LIMITS, LevelLimits, Limit
from qosfs.qos.levels import Level, RateLevel
from qosfs.qos.store import FairShareGroup, LocalLevels

if TYPE_CHECKING:
    import redis

    from qosfs.policy.model import Cluster

__all__ = ["LEASE_SCRIPT", "ClusterCoordinator", "ClusterShare", "connect"]

log = logging.getLogger(__name__)

#: The grant of one mount for one bucket of one level, atomically on Redis.
#: KEYS: the level's caps hash, the bucket's state hash, the bucket's expiry zset.
#: ARGV: node, saturated (0/1), weight, demand (per second), lease (ms), cap mode
#: ("init": write the cap if none is there, "set": overwrite it, "keep"), cap (-1:
#: unlimited), bucket name. Returns {grant, cap, mounts} as strings (-1: unlimited).
LEASE_SCRIPT = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local node, sat = ARGV[1], tonumber(ARGV[2])
local weight, demand, lease = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local mode, bucket = ARGV[6], ARGV[8]
if mode == 'set' then
  redis.call('HSET', KEYS[1], bucket, ARGV[7])
elseif mode == 'init' then
  redis.call('HSETNX', KEYS[1], bucket, ARGV[7])
end
local cap = tonumber(redis.call('HGET', KEYS[1], bucket) or ARGV[7])
local function forget(n)
  local v = redis.call('HGET', KEYS[2], 'n:' .. n)
  if v then
    local f = {}
    for x in string.gmatch(v, '%S+') do f[#f + 1] = x end
    if f[1] == '1' then
      redis.call('HINCRBYFLOAT', KEYS[2], 'satw', -tonumber(f[2]))
    else
      redis.call('HINCRBYFLOAT', KEYS[2], 'unsat', -tonumber(f[3]))
    end
    redis.call('HDEL', KEYS[2], 'n:' .. n)
  end
  redis.call('ZREM', KEYS[3], n)
end
for _, n in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)) do forget(n) end
forget(node)
local unsat = math.max(tonumber(redis.call('HGET', KEYS[2], 'unsat') or '0'), 0)
local satw = math.max(tonumber(redis.call('HGET', KEYS[2], 'satw') or '0'), 0)
local grant = -1
if cap >= 0 then
  if sat == 1 then
    local free = math.max(cap - unsat, cap * 0.05)
    grant = free * weight / (satw + weight)
    redis.call('HINCRBYFLOAT', KEYS[2], 'satw', weight)
  else
    grant = math.min(demand * 1.25 + cap * 0.002, cap)
    redis.call('HINCRBYFLOAT', KEYS[2], 'unsat', grant)
  end
  redis.call('HSET', KEYS[2], 'n:' .. node,
             sat .. ' ' .. weight .. ' ' .. grant .. ' ' .. demand .. ' ' .. now)
  redis.call('ZADD', KEYS[3], now + 3 * lease, node)
  redis.call('PEXPIRE', KEYS[2], 60000 + 10 * lease)
  redis.call('PEXPIRE', KEYS[3], 60000 + 10 * lease)
end
return {tostring(grant), tostring(cap), tostring(redis.call('ZCARD', KEYS[3]))}
"""

#: Which level counter measures each bucket's use: (request kind, per byte) -> attribute.
_USE = {(Kind.READ, True): "bytes_read", (Kind.WRITE, True): "bytes_written",
        (Kind.READ, False): "ops_read", (Kind.WRITE, False): "ops_write",
        (Kind.META, False): "ops_meta"}
_UNLIMITED = -1.0
MAX_BACKOFF = 1.0  # seconds between reconnection attempts, at most
RENEW_TIMEOUT = 0.5  # a renewal that takes longer counts as a failure


def connect(config: Cluster) -> redis.Redis:
    """A Redis client for *config*: TLS for ``rediss://``, a Unix socket for ``unix://``,
    the password from ``password_file`` or the ``password_env`` variable (never the
    policy), and timeouts short enough that a dead Redis is noticed within a renewal."""
    import redis as redis_module  # imported here: only a cluster mount needs the client

    password = None
    if config.password_file is not None:
        with open(config.password_file, encoding="utf-8") as f:
            password = f.read().strip()
    elif os.environ.get(config.password_env):
        password = os.environ[config.password_env]
    client: redis.Redis = redis_module.Redis.from_url(
        config.redis, password=password, socket_timeout=RENEW_TIMEOUT,
        socket_connect_timeout=RENEW_TIMEOUT, decode_responses=True)
    return client


class ClusterShare:
    """This mount's side of one cluster level: the cluster caps, this mount's grants, and
    the :class:`~qosfs.qos.levels.RateLevel` they steer.

    The engine hands the level the policy's caps (``set_limits``, as to any level); the
    share decides what the level enforces: this mount's grant per capped bucket. A call
    with no limits at all (the daemon draining, or the class leaving the policy) lifts
    them on this mount only: it is never pushed to the other mounts.
    """

    def __init__(self, name: str, limits: LevelLimits, fallback_nodes: int | None) -> None:
        self.name = name
        self.caps = limits  # the cluster-wide caps in force (ours, or another mount's change)
        self.configured = limits  # what this mount's policy last said
        self.grants: dict[str, float] = {}  # bucket -> this mount's rate (-1: unlimited)
        self.fallback: int | None = fallback_nodes
        self.lifted = False
        self.pending = "init"  # what the next renewal does with the caps: init/set/keep
        self.changes = 0  # local cap changes so far: a renewal sent before one must not undo it
        self.group: FairShareGroup | None = None  # a cluster per_user class's users
        self.seen = 0  # the level's (and its users') waits at the last renewal
        self.level = RateLevel(name, self._effective(last_grant=False))
        self.level.steering = self

    def steer(self, limits: LevelLimits) -> None:
        if limits == NO_LIMITS:
            self.lifted = True
        else:
            self.lifted = False
            if limits != self.configured:  # a change here (ctl set, reload): push it
                self.configured = self.caps = limits
                self.pending = "set"
                self.changes += 1
        self.apply()

    def weight(self) -> int:
        """This mount's weight in the split of a saturated cap: 1, or the active users of
        a ``per_user`` class here, so that the cap is split by user across the cluster."""
        return max(1, len(self.group.children)) if self.group is not None else 1

    def coordinated(self) -> list[str]:
        """The buckets with a cluster cap (the ones renewed)."""
        return [bucket for bucket, limit in self.caps.set_items() if limit.rate != _INF]

    def apply(self, *, last_grant: bool = True) -> None:
        """Put this mount's share in force now (parked requests re-check at once)."""
        self.level.enforce(self._effective(last_grant=last_grant))
        if self.group is not None:
            self.group.resplit()

    def _effective(self, *, last_grant: bool) -> LevelLimits:
        if self.lifted:
            return NO_LIMITS
        out = {}
        for bucket, cap in self.caps.set_items():
            rate = self.grants.get(bucket) if last_grant else None
            if rate is None:  # no grant yet, or falling back by a node count
                rate = cap.rate / (self.fallback or 1)
            if rate == _UNLIMITED:
                continue
            kind = BY_BUCKET[bucket]
            burst = default_burst(kind, rate)
            if cap.burst is not None:  # a configured burst, scaled to this mount's share
                burst = max(cap.burst * rate / cap.rate, 1.0)
            out[bucket] = Limit(max(rate, 1e-3), burst)
        return LevelLimits(**out)


_INF = float("inf")


@dataclass
class _Report:
    """One bucket's renewal: what this mount asks (built on the loop, sent from a thread)."""

    share: ClusterShare
    bucket: str
    saturated: bool
    weight: int
    demand: float
    mode: str
    cap: float
    changes: int  # the share's local changes when this report was built


@dataclass
class CoordinatorStats:
    """What status and metrics show of the coordination."""

    state: str = "starting"  # starting, leased, fallback
    renewals: int = 0
    failures: int = 0
    denials: int = 0  # renewals of a saturated bucket (it wanted more than its grant)
    last_rtt: float = 0.0
    rtt_sum: float = 0.0
    last_error: str | None = None
    since: float = field(default_factory=time.monotonic)


class ClusterCoordinator(LocalLevels):
    """The mount's side of cluster coordination: the engine's token store
    (:class:`~qosfs.qos.store.LevelFactory`), which builds ``scope = "cluster"`` levels
    steered by their :class:`ClusterShare` and every other level in-process, and renews
    the shares' grants. Like the local store it refuses a swap that changes ``[cluster]``
    (:meth:`~qosfs.qos.store.LocalLevels.check_swap`): it was built from that table.

    Args:
        config: the policy's ``[cluster]``.
        node: this mount's name in Redis (host and mountpoint by default).
        client: a Redis client (tests); by default :func:`connect` makes one.
    """

    def __init__(self, config: Cluster, node: str, client: redis.Redis | None = None) -> None:
        self.config = config
        self.node = node
        self.client = client
        self.shares: weakref.WeakValueDictionary[str, ClusterShare] = \
            weakref.WeakValueDictionary()
        self.stats = CoordinatorStats()
        self._script: Any = None
        self._last: tuple[float, dict[str, dict[str, int]]] | None = None
        self._threads = trio.CapacityLimiter(1)

    # -- the token store (qosfs.qos.store.LevelFactory) --------------------------------

    def __call__(self, name: str, limits: LevelLimits = NO_LIMITS,
                 scope: str = "node") -> Level:
        if scope != "cluster":
            return super().__call__(name, limits, scope)
        share = ClusterShare(name, limits, self.config.fallback_nodes)
        self.shares[name] = share
        return share.level

    def fair_share(self, name: str, limits: LevelLimits, scope: str = "node") -> FairShareGroup:
        """A ``per_user`` class; in the cluster scope its share weighs this mount by its
        active users and re-splits them whenever the grant changes."""
        group = FairShareGroup(name, limits, factory=self, scope=scope)
        if scope == "cluster":
            self.shares[name].group = group  # built just now, as the group's parent
        return group

    # -- keys ----------------------------------------------------------------------------

    def keys(self, level: str, bucket: str) -> list[str]:
        """The caps hash, the bucket's state and its expiry set (one hash slot)."""
        tag = f"{{{self.config.key_prefix}:{level}}}"
        prefix = self.config.key_prefix
        return [f"{prefix}:{tag}:caps", f"{prefix}:{tag}:{bucket}",
                f"{prefix}:{tag}:{bucket}:exp"]

    # -- the renewal loop ----------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Renew every lease period until cancelled; never raises for Redis's sake."""
        task_status.started()
        backoff = 0.0
        while True:
            start = trio.current_time()
            ok = await self.renew_once()
            if ok:
                backoff = 0.0
                await trio.sleep_until(start + self.config.lease)
            else:
                backoff = min(max(backoff * 2, self.config.lease), MAX_BACKOFF)
                await trio.sleep_until(start + backoff)

    async def renew_once(self) -> bool:
        """One renewal of every cluster bucket; on failure, the fallback. Returns success."""
        reports = self._reports()
        if not reports:
            return True
        started = time.monotonic()
        try:
            with trio.fail_after(RENEW_TIMEOUT * 2):
                replies = await trio.to_thread.run_sync(
                    self._renew, reports, limiter=self._threads, abandon_on_cancel=True)
            grants = [self._parse(reply) for reply in replies]
        except Exception as exc:  # Redis down, slow, restarted, or a reply we cannot read
            self._fall_back(exc)
            return False
        rtt = time.monotonic() - started
        self.stats.renewals += 1
        self.stats.last_rtt = rtt
        self.stats.rtt_sum += rtt
        if self.stats.state != "leased":
            if self.stats.state == "fallback":
                log.warning("cluster: Redis reachable again, leases resumed")
            self.stats.state = "leased"
            self.stats.since = time.monotonic()
            self.stats.last_error = None
        touched = set()
        for report, (grant, cap) in zip(reports, grants, strict=True):
            share = report.share
            share.grants[report.bucket] = grant
            if report.saturated:
                self.stats.denials += 1
            touched.add(share)
            if share.changes != report.changes:
                # Changed here while this renewal was in flight: Redis answered with the
                # cap from before the change. Keep ours and push it at the next renewal.
                continue
            share.pending = "keep"
            known = share.caps.get(report.bucket)
            if cap != (known.rate if known.rate != _INF else _UNLIMITED):
                # Another mount changed the cluster cap: adopt it (and its burst default).
                rate = _INF if cap == _UNLIMITED else cap
                caps = dict(share.caps.set_items())
                caps[report.bucket] = Limit(rate) if rate == _INF else Limit(rate, known.burst)
                share.caps = LevelLimits(**caps)
        for share in touched:
            share.apply()
        return True

    def _reports(self) -> list[_Report]:
        now = time.monotonic()
        last = self._last
        used: dict[str, dict[str, int]] = {}
        reports = []
        for name, share in list(self.shares.items()):
            if share.lifted:
                continue
            level = share.level
            counters = {attr: getattr(level, attr) for attr in _USE.values()}
            used[name] = counters
            waits, depth = level.waits, level.queue_depth
            if share.group is not None:
                for child in share.group.children.values():
                    waits += child.waits
                    depth += child.queue_depth
            busy = waits != share.seen or depth > 0
            share.seen = waits
            for bucket in share.coordinated():
                kind = BY_BUCKET[bucket]
                attr = _USE[(kind.charges, kind.per_byte)]
                demand = 0.0
                if last is not None and name in last[1] and now > last[0]:
                    demand = max(counters[attr] - last[1][name][attr], 0) / (now - last[0])
                cap = share.caps.get(bucket).rate
                reports.append(_Report(share, bucket, busy, share.weight(), demand,
                                       share.pending, _UNLIMITED if cap == _INF else cap,
                                       share.changes))
        self._last = (now, used)
        return reports

    def _renew(self, reports: list[_Report]) -> list[Any]:
        """On a worker thread: one pipelined round trip for every bucket."""
        if self.client is None:
            self.client = connect(self.config)
        if self._script is None:
            self._script = self.client.register_script(LEASE_SCRIPT)
        lease_ms = int(self.config.lease * 1000)
        pipe = self.client.pipeline(transaction=False)
        for r in reports:
            self._script(keys=self.keys(r.share.name, r.bucket),
                         args=[self.node, int(r.saturated), r.weight, f"{r.demand:.3f}",
                               lease_ms, r.mode, f"{r.cap:.3f}", r.bucket], client=pipe)
        replies: list[Any] = pipe.execute()
        return replies

    @staticmethod
    def _parse(reply: Any) -> tuple[float, float]:
        """(grant, cap) from a script reply; ValueError for anything else."""
        if not isinstance(reply, list) or len(reply) != 3:
            raise ValueError(f"unexpected reply from the lease script: {reply!r}")
        grant, cap = float(reply[0]), float(reply[1])
        return grant, cap

    def _fall_back(self, exc: BaseException) -> None:
        self.stats.failures += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"[:300]
        if self.stats.state != "fallback":
            rule = ("the cap divided by " + str(self.config.fallback_nodes) + " nodes"
                    if self.config.fallback_nodes else "its last grant")
            log.warning("cluster: Redis at %s unusable (%s); each mount enforces %s until "
                        "it answers", self.config.redis, self.stats.last_error, rule)
            self.stats.state = "fallback"
            self.stats.since = time.monotonic()
            for share in list(self.shares.values()):
                if share.pending == "keep":  # a restarted Redis may have lost the caps
                    share.pending = "init"
                share.apply(last_grant=self.config.fallback_nodes is None
                            and bool(share.grants))
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
            self.client = None
            self._script = None

    # -- observation ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """This mount's side: state, counters, and each cluster bucket's cap and grant."""
        s = self.stats
        levels = []
        for name, share in sorted(self.shares.items()):
            for bucket in share.coordinated():
                grant = share.grants.get(bucket)
                levels.append({"level": name, "bucket": bucket,
                               "key": BY_BUCKET[bucket].key,
                               "cap": share.caps.get(bucket).rate,
                               "grant": None if grant is None or grant < 0 else grant,
                               "enforced": share.level.limits.get(bucket).rate})
        return {"node": self.node, "redis": self.config.redis, "state": s.state,
                "lease_seconds": self.config.lease, "renewals": s.renewals,
                "failures": s.failures, "denials": s.denials,
                "redis_seconds_last": s.last_rtt, "redis_seconds_sum": s.rtt_sum,
                "last_error": s.last_error, "state_seconds": time.monotonic() - s.since,
                "levels": levels}

    def cluster_view(self) -> list[dict[str, Any]]:
        """On a worker thread: every mount's entry for every cluster bucket, from Redis
        (its own connection: the renewals' may be in use or being replaced)."""
        client = connect(self.config)
        try:
            return self._read_view(client)
        finally:
            client.close()

    def _read_view(self, client: redis.Redis) -> list[dict[str, Any]]:
        out = []
        for name, share in sorted(self.shares.items()):
            for bucket in share.coordinated():
                caps_key, state_key, _ = self.keys(name, bucket)
                # decode_responses=True: strings, whatever the client's stubs say
                entries = cast(dict[str, str], client.hgetall(state_key))
                cap = cast(str | None, client.hget(caps_key, bucket))
                nodes = []
                for field_name, value in sorted(entries.items()):
                    if not field_name.startswith("n:"):
                        continue
                    sat, weight, grant, demand, at = value.split()
                    nodes.append({"node": field_name[2:], "saturated": sat == "1",
                                  "weight": float(weight), "grant": float(grant),
                                  "used": float(demand), "renewed_ms": int(float(at))})
                out.append({"level": name, "bucket": bucket, "key": BY_BUCKET[bucket].key,
                            "cap": None if cap is None else float(cap), "nodes": nodes})
        return out
