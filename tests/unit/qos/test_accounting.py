"""Hot-path counters and latency histograms: bucket math, windows, and what they cost."""

from __future__ import annotations

import time
import timeit

from qosfs.qos.accounting import (
    BUCKET_BOUNDS_SECONDS,
    NBUCKETS,
    Accounts,
    FlowStats,
    HistogramSnapshot,
    LatencyHistogram,
)


def test_buckets_are_powers_of_two_microseconds() -> None:
    assert BUCKET_BOUNDS_SECONDS[:4] == (1e-6, 2e-6, 4e-6, 8e-6)
    assert abs(BUCKET_BOUNDS_SECONDS[-1] - 16.777216) < 1e-9
    h = LatencyHistogram()
    for ns in (0, 999, 1_000, 1_999, 2_000, 3_999, 10**12, -5):
        h.observe(ns)
    counts = h.snapshot().counts
    assert counts[0] == 3  # 0, 999 and a negative (clock step) -> under 1 us
    assert counts[1] == 2  # [1 us, 2 us)
    assert counts[2] == 2  # [2 us, 4 us)
    assert counts[NBUCKETS] == 1  # 1000 s: +Inf
    assert h.sum_ns == 999 + 1000 + 1999 + 2000 + 3999 + 10**12


def test_every_observation_is_at_or_below_its_bucket_bound() -> None:
    for ns in [1, 7, 1000, 1001, 65_535_000, 123_456_789, 16_777_215_999]:
        h = LatencyHistogram()
        h.observe(ns)
        index = h.counts.index(1)
        assert ns / 1e9 <= BUCKET_BOUNDS_SECONDS[index] + 1e-6
        assert index == 0 or ns / 1e9 >= BUCKET_BOUNDS_SECONDS[index - 1]


def test_quantiles_and_windows() -> None:
    h = LatencyHistogram()
    for _ in range(99):
        h.observe(3_000)  # [2, 4) us
    h.observe(5_000_000)  # 5 ms: [4.096, 8.192) ms
    before = h.snapshot()
    assert before.quantile(0.5) == 4e-6
    assert before.quantile(0.99) == 4e-6
    assert before.quantile(1.0) == BUCKET_BOUNDS_SECONDS[13]
    for _ in range(10):
        h.observe(5_000_000)
    window = h.snapshot() - before
    assert window.count == 10 and window.quantile(0.5) == BUCKET_BOUNDS_SECONDS[13]
    assert abs(window.sum_seconds - 0.05) < 1e-9
    assert HistogramSnapshot().quantile(0.99) is None
    assert (before + window).count == h.snapshot().count


def test_record_splits_backend_time_from_the_whole_request() -> None:
    s = FlowStats()
    s.record_read(4096, 0.0, 3_000)
    s.record_write(1 << 20, 0.5, 2_000_000)
    assert (s.read_bytes, s.read_ops, s.write_bytes, s.write_ops) == (4096, 1, 1 << 20, 1)
    assert s.throttled_seconds == 0.5
    snap = s.snapshot()
    assert snap.read_latency == snap.read_backend  # no wait: the same observation
    assert snap.write_backend.quantile(1.0) == BUCKET_BOUNDS_SECONDS[11]  # 2 ms -> <= 2.048
    assert snap.write_latency.quantile(1.0) == BUCKET_BOUNDS_SECONDS[19]  # 0.502 s -> 0.524
    assert snap.write_latency.sum_ns == 502_000_000


def test_accounts_keep_keys_until_the_policy_drops_them() -> None:
    acc = Accounts()
    a = acc.get("ckpt", None, None)
    assert acc.get("ckpt", None, None) is a
    acc.get("ckpt", "team", 1000).record_read(10, 0.0, 1_500)
    acc.get("data", None, None).record_read(10, 0.0, 100_000)
    a.record_read(10, 0.0, 1_500)
    assert acc.histogram("ckpt", "read_backend").count == 2
    acc.retain(lambda key: key[0] != "data")
    assert sorted(k[0] for k in acc.keys()) == ["ckpt", "ckpt"]  # noqa: SIM118
    assert acc.histogram("data", "read_backend").count == 0


def test_hot_path_cost_is_small() -> None:
    """The micro-measurement behind the cost quoted in qosfs.qos.accounting's docstring.

    Per read: one perf_counter_ns() pair plus record_read(). The bound is generous (a
    shared 2-CPU machine); the printed figure is what to quote.
    """
    s = FlowStats()
    now = time.perf_counter_ns
    n = 200_000

    def one() -> None:
        start = now()
        s.record_read(4096, 0.0, now() - start)

    best = min(timeit.repeat(one, number=n, repeat=3)) / n
    empty = min(timeit.repeat(lambda: None, number=n, repeat=3)) / n
    cost = best - empty
    print(f"accounting per request: {cost * 1e9:.0f} ns")
    assert cost < 5e-6


def test_a_class_labels_at_most_user_series_uids_and_folds_the_rest() -> None:
    acc = Accounts(user_series=2)
    a, b = acc.get("c", None, 1), acc.get("c", None, 2)
    shared = acc.get("c", None, 3)  # past the bound: counted in the class's uid-less key
    assert shared is acc.get("c", None, None) and acc.uid_keys == 2
    a.record_write(100, 0.5, 2000)
    b.record_write(10, 0.0, 2000)
    shared.record_write(1, 0.0, 1000)
    assert acc.set_user_series(1) == [("c", None, 2)]  # the least traffic goes first
    old, into = acc.fold(("c", None, 2)) or (None, None)
    assert old is b and into is shared and acc.uid_keys == 1
    assert (into.write_bytes, into.write_ops, into.write_latency.snapshot().count) == (11, 2, 2)
    assert acc.fold(("c", None, 2)) is None and acc.fold(("c", None, None)) is None
    assert acc.get("c", None, 4) is shared  # still at the bound of 1


def test_idle_uids_are_those_without_requests_between_looks() -> None:
    acc = Accounts()
    busy, quiet = acc.get("c", None, 1), acc.get("c", None, 2)
    acc.get("c", None, None)
    assert acc.idle_uids(0.0, 10.0) == []  # first look: everyone just seen
    busy.record_read(1, 0.0, 1000)
    assert acc.idle_uids(9.0, 10.0) == []
    busy.record_read(1, 0.0, 1000)
    assert acc.idle_uids(10.0, 10.0) == [("c", None, 2)]
    quiet.meta_ops += 1  # any request counts
    assert acc.idle_uids(11.0, 10.0) == []


def test_a_successors_accounts_go_on_from_the_predecessors_totals() -> None:
    """qosfs upgrade: every counter and histogram carries on through JSON; a uid past
    the successor's bound adds to its class's uid-less key; the fine histogram does not
    travel (the latency controller diffs it per window)."""
    import json

    from qosfs.qos.accounting import Accounts

    old = Accounts()
    old.set_fine_classes(frozenset({"data"}))
    old.get("data", None, None).record_read(4096, 0.5, 2_000_000)
    old.get("ckpt", "team", 7).record_write(1 << 20, 0.0, 9_000)
    old.get("ckpt", "team", 8).record_write(1 << 10, 0.0, 9_000)
    new = Accounts(user_series=1)
    new.set_fine_classes(frozenset({"data"}))
    new.get("data", None, None).record_read(10, 0.0, 1_000)
    assert new.import_totals(json.loads(json.dumps(old.export_totals()))) == 3
    data = new.snapshot()[("data", None, None)]
    assert (data.read_bytes, data.read_ops, data.throttled_seconds) == (4106, 2, 0.5)
    assert data.read_latency.count == 2 and data.read_backend.sum_seconds == 0.002001
    assert new.get("data", None, None).read_fine is not None
    assert sum(new.get("data", None, None).read_fine.snapshot()) == 1  # its own only
    keys = new.snapshot()
    assert keys[("ckpt", "team", 7)].write_bytes == 1 << 20
    assert keys[("ckpt", "team", None)].write_bytes == 1 << 10  # past the bound of 1
