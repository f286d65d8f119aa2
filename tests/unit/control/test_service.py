"""Control commands on a real engine, on trio's mock clock: set, reload, permissions."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from qosfs.control.protocol import Peer, ReloadRequest, SetRequest, SimpleRequest, encode
from qosfs.control.service import ControlService
from qosfs.policy.loading import parse_policy
from qosfs.policy.model import Policy
from qosfs.qos.engine import PolicyQos
from qosfs.qos.flow import PolicyFlow
from qosfs.qos.interface import PassThroughQos
from tests.mock_clock import mock_clock
from tests.unit.policy.test_policy import hostile_policy

MiB = 1 << 20
ROOT = Peer(pid=1, uid=0, gid=0)
USER = Peer(pid=2, uid=4242, gid=4242)
ADMIN = Peer(pid=3, uid=4243, gid=100, groups=(100, 777))
TEXT = """
[control]
admin_group = 777
[classes.ckpt]
paths = ["ckpt/**"]
write_bandwidth = "1MiB/s"
burst = "1MiB"
"""


def make(policy_path: str | None = None) -> tuple[ControlService, PolicyQos]:
    engine = PolicyQos(parse_policy(TEXT, "test.toml"))
    return ControlService(engine, policy_path), engine


def set_req(name: str, **changes: Any) -> SetRequest:
    return SetRequest("class", name, tuple(changes.items()))


def limits(engine: PolicyQos) -> dict[str, Any]:
    return {lv.name: lv.limits for lv in engine.statistics().classes.values()}


@mock_clock
async def test_set_applies_and_counts() -> None:
    ctl, engine = make()
    reply = await ctl.handle(set_req("ckpt", write_bandwidth="400MiB/s", write_iops="2k"), ROOT)
    assert reply == {"ok": True, "generation": 2, "policy_source": "test.toml"}
    rule = engine.policy.class_by_name("ckpt")
    assert rule is not None and rule.limits.write_bandwidth == 400 * MiB
    assert rule.limits.write_iops == 2000
    assert ctl.changes[("set", "applied")] == 1


@pytest.mark.parametrize(("request_", "message"), [
    (set_req("ckpt", write_bandwidth="-4MiB/s"), "ctl: classes.ckpt.write_bandwidth: expected"),
    (set_req("nope", write_bandwidth="4MiB/s"), 'ctl: no class named "nope" (classes: ckpt'),
    (set_req("ckpt", colour="red"), 'ctl: classes.ckpt.colour: unknown key "colour"'),
    (SetRequest("tenant", "ghost", (("write_bandwidth", "1MiB/s"),)), 'ctl: no tenant named'),
    (ReloadRequest("[classes.x]\npaths = 3\n", "/tmp/new.toml"), "/tmp/new.toml:2: classes.x"),
    (ReloadRequest("not toml [", "/tmp/new.toml"), "/tmp/new.toml:1: invalid TOML"),
])
def test_rejected_changes_leave_the_policy_exactly_as_it_was(request_: Any,
                                                             message: str) -> None:
    async def main() -> None:
        ctl, engine = make()
        before: Policy = engine.policy
        before_limits = limits(engine)
        reply = await ctl.handle(request_, ROOT)
        assert reply["ok"] is False and reply["code"] == "policy"
        assert reply["error"].startswith(message), reply["error"]
        assert engine.policy is before and engine.generation == 1
        assert limits(engine) == before_limits
        assert ctl.changes[(request_.cmd, "rejected")] == 1

    trio.run(main)


@mock_clock
async def test_only_root_and_the_admin_group_may_change() -> None:
    ctl, engine = make()
    status = await ctl.handle(SimpleRequest("status"), USER)
    assert status["ok"] is True and status["generation"] == 1
    denied = await ctl.handle(set_req("ckpt", write_bandwidth="2MiB/s"), USER)
    assert denied["ok"] is False and denied["code"] == "denied"
    assert "uid 4242 may not change the policy" in denied["error"]
    assert (await ctl.handle(ReloadRequest(), USER))["code"] == "denied"
    assert engine.generation == 1
    assert (await ctl.handle(set_req("ckpt", write_bandwidth="2MiB/s"), ADMIN))["ok"] is True


def test_reload_rereads_the_mounts_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(TEXT.replace("1MiB/s", "3MiB/s"))

    async def main() -> None:
        ctl, engine = make(str(path))
        hooked: list[Policy] = []
        ctl.on_swap.append(hooked.append)
        reply = await ctl.handle(ReloadRequest(), ROOT)
        assert reply["ok"] is True and reply["generation"] == 2
        rule = engine.policy.class_by_name("ckpt")
        assert rule is not None and rule.limits.write_bandwidth == 3 * MiB
        assert hooked == [engine.policy]
        path.write_text("[classes.ckpt]\nwrite_bandwidth = 5\n")
        bad = await ctl.handle(ReloadRequest(), ROOT)
        assert bad["code"] == "policy" and bad["error"].startswith(f"{path}:2: ")
        assert ctl.last_reload_ok is False and engine.generation == 2

    trio.run(main)


def test_a_refused_reload_of_the_mounts_file_is_kept_with_its_reason(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(TEXT)

    async def main() -> None:
        ctl, engine = make(str(path))
        status = await ctl.handle(SimpleRequest("status"), ROOT)
        assert status["last_reload_ok"] is True and status["last_reload_failure"] is None
        path.write_text("[classes.ckpt]\npaths = [\"ckpt/**\"]\nwrite_iops = -1\n")
        before = time.time()
        assert (await ctl.reload(ReloadRequest(), "SIGHUP"))["ok"] is False
        for cmd in ("status", "stats"):
            status = await ctl.handle(SimpleRequest(cmd), ROOT)
            failure = status["last_reload_failure"]
            assert status["last_reload_ok"] is False and engine.generation == 1
            assert before <= failure["time"] <= time.time() and failure["by"] == "SIGHUP"
            assert (failure["source"], failure["line"], failure["key"]) == (
                str(path), 3, "classes.ckpt.write_iops")
            assert failure["reason"].startswith("expected an IOPS rate")
            assert failure["error"] == f"{path}:3: classes.ckpt.write_iops: {failure['reason']}"
        assert ctl.status_line().startswith("policy reload refused at ")
        assert ctl.status_line().endswith(f"(SIGHUP), previous policy kept: {failure['error']}")
        # The same file named explicitly is the mount's own too: still failed, by root now.
        bad = await ctl.handle(ReloadRequest(path.read_text(), str(path)), ROOT)
        assert bad["ok"] is False and ctl.reload_failure is not None
        assert ctl.reload_failure["by"] == "uid 0 (pid 1)"
        path.write_text(TEXT)
        assert (await ctl.handle(ReloadRequest(), ROOT))["ok"] is True
        status = await ctl.handle(SimpleRequest("status"), ROOT)
        assert status["last_reload_ok"] is True and status["last_reload_failure"] is None
        assert ctl.status_line() == f"serving; policy {path} generation 2"

    trio.run(main)


@mock_clock
async def test_a_refused_reload_of_another_file_is_answered_not_alerted() -> None:
    """Its caller got the reason; the policy in force and the mount's file are fine."""
    ctl, engine = make("/etc/qosfs/mine.toml")
    other = ReloadRequest("[classes.x]\nwrite_iops = -1\n", "/tmp/other.toml")
    reply = await ctl.handle(other, ROOT)
    assert reply["ok"] is False and reply["error"].startswith("/tmp/other.toml:2: ")
    assert ctl.last_reload_ok is True and ctl.reload_failure is None
    assert ctl.changes[("reload", "rejected")] == 1
    # Nor does an applied one clear a failure of the mount's own file.
    ctl.reload_failure = {"time": 0.0, "by": "SIGHUP", "source": "/etc/qosfs/mine.toml",
                          "line": 1, "key": None, "reason": "r", "error": "e"}
    assert (await ctl.handle(ReloadRequest(TEXT, "/tmp/other.toml"), ROOT))["ok"] is True
    assert engine.generation == 2 and ctl.last_reload_ok is False


@mock_clock
async def test_status_reads_the_engines_counters_from_the_engine_not_the_filesystem() -> None:
    ctl, engine = make()
    ctl.info_sources.append(lambda: {"inodes": 3})  # what the filesystem reports
    writer = PolicyFlow(engine.classes["ckpt"], None, None, 0, parking=engine.parking)
    await writer.admit_write(MiB)  # the burst
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.admit_write, 2 * MiB)  # parks at 1 MiB/s
        await trio.sleep(0.01)
        status = await ctl.handle(SimpleRequest("status"), ROOT)
        nursery.cancel_scope.cancel()
    assert status["inodes"] == 3
    assert (status["parked_requests"], status["parked_bytes"]) == (1, 2 * MiB)
    assert status["streaming_moves"] == {} and status["users_expired"] == 0


@mock_clock
async def test_no_qos_mount_reports_no_policy_and_refuses_changes() -> None:
    ctl = ControlService(PassThroughQos())
    status = await ctl.handle(SimpleRequest("status"), ROOT)
    assert status["qos"] is False and status["levels"] == []
    for request in (set_req("default", write_bandwidth="1MiB/s"), ReloadRequest()):
        reply = await ctl.handle(request, ROOT)
        assert reply["code"] == "unavailable" and "--no-qos" in reply["error"]


@mock_clock
async def test_a_raised_cap_releases_a_parked_writer_at_once() -> None:
    ctl, engine = make()
    writer = PolicyFlow(engine.classes["ckpt"], None, None, 0)
    await writer.admit_write(MiB)  # the burst
    done: list[float] = []

    async def write() -> None:
        await writer.admit_write(8 * MiB)  # 8 s at 1 MiB/s
        done.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        await trio.sleep(0.5)
        assert not done
        await ctl.handle(set_req("ckpt", write_bandwidth="1GiB/s", burst="64MiB"), ROOT)
        changed_at = trio.current_time()
    assert done and done[0] - changed_at < 0.01


_SET_VALUES = st.one_of(st.sampled_from(["1MiB/s", "unlimited", "high", "fair", "keep", "-1",
                                         "nan", "", "9" * 400 + "KiB", "1e400"]),
                        st.integers(), st.floats(allow_nan=False, allow_infinity=False))
_SETS = st.builds(
    lambda target, name, changes: SetRequest(target, name, tuple(changes.items())),
    st.sampled_from(["class", "tenant", "backend"]), st.sampled_from(["ckpt", "default", "x",
                                                                       None]),
    st.dictionaries(st.sampled_from(["write_bandwidth", "read_iops", "burst", "priority",
                                     "per_user", "cache", "min_read_bandwidth", "paths"]),
                    _SET_VALUES, min_size=1, max_size=3))
_RELOADS = st.builds(ReloadRequest, hostile_policy(), st.just("/tmp/new.toml"))


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.one_of(_SETS, _RELOADS), st.sampled_from([ROOT, USER, ADMIN]))
def test_any_change_is_applied_whole_or_leaves_everything_as_it_was(request_: Any,
                                                                    peer: Peer) -> None:
    async def main() -> None:
        ctl, engine = make()
        before, before_limits, rendered = engine.policy, limits(engine), engine.policy.render()
        reply = await ctl.handle(request_, peer)
        assert json.loads(encode(reply)) == reply
        if reply["ok"]:
            assert peer is not USER and engine.generation == 2
            assert parse_policy(engine.policy.render()) == engine.policy
        else:
            assert reply["code"] == ("denied" if peer is USER else "policy"), reply
            assert "\n" not in reply["error"]
            assert engine.policy is before and engine.generation == 1
            assert limits(engine) == before_limits and before.render() == rendered

    trio.run(main)
