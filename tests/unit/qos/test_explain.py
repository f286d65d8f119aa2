"""qosfs explain's answer: the classifier's decision with its reasons, the policy lines
that made it, and the levels the engine charges, as a file states them and as a running
engine enforces them."""

from __future__ import annotations

import itertools
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from qosfs.policy.classify import CallerKey, Classifier, JobInfo
from qosfs.policy.loading import default_policy, parse_policy, with_changes
from qosfs.qos.backend import ClassPort
from qosfs.qos.engine import PolicyQos
from qosfs.qos.explanation import (
    PASSTHROUGH_READS_ONLY,
    Asked,
    explain,
    job_of,
    mount_relative,
)
from qosfs.qos.stats import AutoCaps
from tests.mock_clock import mock_clock
from tests.unit.qos.test_engine import FakeFs, fake_inode
from tests.waiting import wait_for

MiB = 1 << 20

# One policy with every kind of key, classes and tenants alike.
TEXT = """\
[backend]
read_bandwidth = "4GiB/s"
write_bandwidth = "2GiB/s"

[tenants.team]
uids = ["2000-2999"]
write_bandwidth = "1GiB/s"

[tenants.staff]
gids = [50]

[tenants.job]
job_env = "QOSFS_JOB"
jobs = ["job-*"]

[tenants.pod]
cgroups = ["/kubepods/**"]

[tenants.area]
paths = ["area/**"]

[classes.by_path]
paths = ["pathy/**"]
write_bandwidth = "100MiB/s"

[classes.by_op]
paths = ["ops/**"]
ops = ["read"]
read_bandwidth = "10MiB/s"

[classes.by_uid]
uids = [4444]

[classes.by_gid]
gids = ["4545-4546"]

[classes.by_env]
job_env = "QOSFS_CLASS"
jobs = ["gold", "pla*"]

[classes.by_cgroup]
cgroups = ["/slurm/**"]

[classes.by_tenant]
tenants = ["staff"]

[classes.fair]
paths = ["fair/**"]
per_user = "fair"
write_bandwidth = "30MiB/s"
priority = "low"
min_write_bandwidth = "10MiB/s"

[classes.streams]
detect_streaming_writes = "64MiB"
write_bandwidth = "50MiB/s"
ops = ["write"]
paths = ["streams/**"]
"""
POLICY = parse_policy(TEXT, "p.toml")


def line_of(text: str, table: str, key: str | None = None) -> int:
    """The line of ``[table]``, or of ``key = ...`` in it, found the plain way."""
    lines = text.splitlines()
    start = lines.index(f"[{table}]")
    if key is None:
        return start + 1
    return next(i for i in range(start, len(lines)) if lines[i].startswith(f"{key} =")) + 1


def ask(path: str, op: str = "read", uid: int = 1000, gid: int = 1000,
        env: dict[str, str] | None = None, cgroups: tuple[str, ...] = (),
        policy: Any = POLICY, engine: PolicyQos | None = None,
        mountpoint: str | None = None) -> dict[str, Any]:
    classifier = engine.classification.classifier if engine is not None else Classifier(policy)
    asked = Asked(path, op, uid, gid, tuple((env or {}).items()), cgroups)
    return explain(classifier, asked, pid=os.getpid(), uid=0, gid=0, mountpoint=mountpoint,
                   live=engine.statistics() if engine is not None else None)


# (request, class, its matched keys, tenant, the tenant's matched keys): a key of each kind
CASES = [
    ({"path": "pathy/a", "op": "write"}, "by_path", ["paths"], None, []),
    ({"path": "ops/r"}, "by_op", ["paths", "ops"], None, []),
    ({"path": "ops/w", "op": "write"}, "default", [], None, []),
    ({"path": "x", "uid": 4444}, "by_uid", ["uids"], None, []),
    ({"path": "x", "gid": 4546}, "by_gid", ["gids"], None, []),
    ({"path": "x", "env": {"QOSFS_CLASS": "plain"}}, "by_env", ["job_env", "jobs"], None, []),
    ({"path": "x", "cgroups": ("/", "/slurm/job_5/step_0")}, "by_cgroup", ["cgroups"], None, []),
    ({"path": "x", "gid": 50}, "by_tenant", ["tenants"], "staff", ["gids"]),
    ({"path": "x", "uid": 2500}, "default", [], "team", ["uids"]),
    ({"path": "x", "env": {"QOSFS_JOB": "job-7"}}, "default", [], "job", ["job_env", "jobs"]),
    ({"path": "x", "cgroups": ("/kubepods/pod1",)}, "default", [], "pod", ["cgroups"]),
    ({"path": "area/x"}, "default", [], "area", ["paths"]),
]


@pytest.mark.parametrize(("kw", "cls", "keys", "tenant", "tenant_keys"), CASES,
                         ids=[f"{c[1]}-{c[3]}" for c in CASES])
def test_each_kind_of_key_names_the_class_tenant_and_their_lines(
        kw: dict[str, Any], cls: str, keys: list[str], tenant: str | None,
        tenant_keys: list[str]) -> None:
    body = ask(**kw)
    assert body["class"]["name"] == cls
    assert [c["key"] for c in body["class"]["matched"]] == keys
    expected = line_of(TEXT, f"classes.{cls}") if cls != "default" else None
    assert body["class"]["line"] == expected  # default: not in the file, no line
    for c in body["class"]["matched"]:
        assert c["line"] == line_of(TEXT, f"classes.{cls}", c["key"])
    if tenant is None:
        assert body["tenant"] is None
    else:
        assert body["tenant"]["name"] == tenant
        assert body["tenant"]["line"] == line_of(TEXT, f"tenants.{tenant}")
        assert [c["key"] for c in body["tenant"]["matched"]] == tenant_keys
        for c in body["tenant"]["matched"]:
            assert c["line"] == line_of(TEXT, f"tenants.{tenant}", c["key"])
    # Everything before the winner is listed with the criterion it failed, and its line.
    names = [c.name for c in POLICY.classes]
    passed = body["classes_passed"]
    assert [p["name"] for p in passed] == names[:names.index(cls)]
    for p in passed:
        assert p["line"] == line_of(TEXT, f"classes.{p['name']}", p["key"])


def test_what_matched_and_what_failed_is_shown_with_the_callers_values() -> None:
    body = ask("x", uid=4444, env={"QOSFS_CLASS": "gold"})
    assert body["class"]["matched"] == [
        {"key": "uids", "value": "4444", "caller": "4444",
         "line": line_of(TEXT, "classes.by_uid", "uids")}]
    failed = {p["name"]: (p["key"], p["caller"]) for p in ask("x", op="write")["classes_passed"]}
    assert failed == {"by_path": ("paths", "x"), "by_op": ("ops", "write"),
                      "by_uid": ("uids", "uid 1000"), "by_gid": ("gids", "gid 1000"),
                      "by_env": ("job_env", "QOSFS_CLASS unset"),
                      "by_cgroup": ("cgroups", "no cgroup"),
                      "by_tenant": ("tenants", "no tenant"), "fair": ("paths", "x"),
                      "streams": ("paths", "x")}
    jobs = ask("x", env={"QOSFS_CLASS": "silver"})["classes_passed"]
    assert ("by_env", "jobs", "QOSFS_CLASS=silver") in [
        (p["name"], p["key"], p["caller"]) for p in jobs]
    tenants = ask("x", env={"QOSFS_JOB": "other"})["tenants_passed"]
    assert [(t["name"], t["key"]) for t in tenants] == [
        ("team", "uids"), ("staff", "gids"), ("job", "jobs"), ("pod", "cgroups"),
        ("area", "paths")]


def test_the_decision_is_the_classifiers_for_every_combination() -> None:
    """decide() and resolve() share each criterion's test; they agree everywhere."""
    classifier = Classifier(POLICY)
    paths = ["pathy/a", "ops/r", "x", "area/model.pt.tmp1", "fair/a", "streams/s", ""]
    jobs = [None, JobInfo((("QOSFS_CLASS", "gold"),)), JobInfo((("QOSFS_JOB", "job-1"),)),
            JobInfo(cgroup="/slurm/j/s"), JobInfo(cgroup="/", v1_cgroups=("/kubepods/p",))]
    for path, uid, gid, op, job in itertools.product(
            paths, [1000, 2500, 4444], [1000, 50, 4545], ["read", "write", "meta"], jobs):
        caller = CallerKey(op, uid, gid, 0)
        decision = classifier.decide(path, caller, job)
        assert (decision.rule, decision.tenant) == classifier.resolve(path, caller, job)


def test_a_temporary_name_is_explained_by_the_name_it_will_get() -> None:
    body = ask("run/model.pt.tmp42", op="write", policy=default_policy())
    assert body["class"]["name"] == "checkpoints"
    assert body["class"]["decided_on"] == "run/model.pt"
    assert body["class"]["matched"][0]["value"] == "**/*.pt"
    assert any("temporary name" in note for note in body["notes"])


def test_the_default_policy_is_located_in_its_own_text() -> None:
    body = ask("data/x", policy=default_policy())
    assert body["policy"]["source"] == "<default policy>"
    text = default_policy().text
    assert text is not None
    assert text.splitlines()[body["class"]["line"] - 1] == "[classes.datasets]"


def test_notes_say_what_can_still_move_or_skip_a_request() -> None:
    moves = ask("x", op="write")["notes"]
    assert moves == ["a writable open that writes 64MiB mostly sequentially moves to class "
                     "streams (detect_streaming_writes)"]
    assert ask("pathy/x", op="write")["notes"] == []  # a capped class keeps its writers
    assert "neither classified nor counted" in ask("x", op="meta")["notes"][0]
    capped = TEXT.replace('[classes.by_path]\n', '[classes.by_path]\nmeta_iops = 100\n')
    assert ask("x", op="meta", policy=parse_policy(capped))["notes"] == []


def test_served_by_the_daemon_and_where_the_page_cache_answers() -> None:
    body = ask("x")
    assert body["served_by"] == {"by": "daemon", "passthrough": False,
                                 "reason": "[backend] caps reads, which every class shares "
                                           "by priority", "page_cache": "used"}
    assert ask("ops/r")["served_by"]["page_cache"] == "bypassed"  # a read cap
    assert "page_cache" not in ask("x", op="write")["served_by"]


PASSING = """\
[tenants.capped]
uids = [3000]
read_iops = 500

[classes.fair]
paths = ["fair/**"]
per_user = "fair"
passthrough = "reads"

[classes.data]
paths = ["data/**"]
passthrough = "reads"
"""


def test_reads_of_a_passthrough_class_nothing_caps_are_served_by_the_kernel() -> None:
    served = ask("data/x", policy=default_policy())["served_by"]
    assert served["by"] == "kernel" and served["passthrough"] is True
    assert "page_cache" not in served
    policy = parse_policy(PASSING)
    assert ask("data/x", policy=policy, uid=1)["served_by"]["by"] == "kernel"
    # Writes, metadata, and every level that caps reads keep the daemon.
    assert ask("data/x", op="write", policy=policy)["served_by"]["reason"] == \
        PASSTHROUGH_READS_ONLY
    tenant = ask("data/x", policy=policy, uid=3000)["served_by"]
    assert tenant["by"] == "daemon" and "tenant capped caps reads" in tenant["reason"]
    assert "per_user" in ask("fair/x", policy=policy, uid=1)["served_by"]["reason"]
    backend = parse_policy('[backend]\nread_bandwidth = "1GiB/s"\n' + PASSING)
    assert "[backend] caps reads" in ask("data/x", policy=backend,
                                         uid=1)["served_by"]["reason"]
    own = parse_policy(PASSING + 'read_bandwidth = "1MiB/s"\n')  # in [classes.data]
    served = ask("data/x", policy=own, uid=1)["served_by"]
    assert served["reason"] == "the class caps its reads" and served["page_cache"] == "bypassed"


DEFAULTS = """\
[classes.off]
paths = ["off/**"]
passthrough = "off"

[classes.measured]
paths = ["measured/**"]
target_read_latency = "5ms"
latency_measure = "backend"

[classes.canary]
paths = ["canary/**"]
target_read_slowdown = 1.5

[classes.writes]
paths = ["writes/**"]
ops = ["write"]
write_bandwidth = "100MiB/s"
"""


def test_every_class_nothing_caps_passes_reads_through_unless_it_opts_out() -> None:
    """No passthrough key: the default class, a class with a canary-measured latency
    target and a checkpoint file whose class caps only writes are read by the kernel; a
    class with passthrough = "off" or a "backend"-measured target is read by the daemon,
    each with its reason."""
    policy = parse_policy(DEFAULTS)
    for path in ("x", "canary/x", "writes/model.pt"):
        served = ask(path, policy=policy)["served_by"]
        assert served["by"] == "kernel" and "no level caps" in served["reason"], path
    assert ask("off/x", policy=policy)["served_by"] == {
        "by": "daemon", "passthrough": False, "page_cache": "used",
        "reason": 'passthrough = "off" keeps the class\'s reads in the daemon'}
    measured = ask("measured/x", policy=policy)["served_by"]
    assert measured["by"] == "daemon" and 'latency_measure = "backend"' in measured["reason"]
    assert ask("writes/model.pt", op="write", policy=policy)["served_by"]["by"] == "daemon"
    for path in ("checkpoints/model.pt", "run/misc/fio-test.bin"):  # the embedded policy
        assert ask(path, policy=default_policy())["served_by"]["by"] == "kernel", path


def test_levels_from_a_file_are_its_caps_in_charging_order() -> None:
    body = ask("fair/x", op="write", uid=2500)
    assert [(lv["level"], lv["name"]) for lv in body["levels"]] == [
        ("user", "fair"), ("class", "fair"), ("tenant", "team"), ("backend", "backend")]
    user, cls, tenant, backend = body["levels"]
    assert user["uid"] == 2500 and user["active_users"] is None
    assert cls["limits"] == cls["configured"] == {"write_bandwidth": 30 * MiB}
    assert tenant["limits"] == {"write_bandwidth": 1 << 30}
    assert backend["limits"] == {"read_bandwidth": 4 << 30, "write_bandwidth": 2 << 30}
    assert (backend["priority"], backend["weight"]) == ("low", 1)
    assert backend["min_write_bandwidth"] == 10 * MiB


def _chain(flow: Any) -> list[tuple[str, str]]:
    """What a PolicyFlow charges, as (level, name) like explain's levels."""
    out = []
    for level in flow.chain():
        if isinstance(level, ClassPort):
            out.append(("backend", "backend"))
        elif level.name.startswith("tenant:"):
            out.append(("tenant", level.name.removeprefix("tenant:")))
        elif "/uid=" in level.name:
            out.append(("user", level.name.split("/uid=")[0]))
        else:
            out.append(("class", level.name))
    return out


@pytest.mark.parametrize(("path", "uid", "gid"), [
    ("fair/x", 2500, 1000), ("pathy/a", 1000, 1000), ("x", 1000, 50), ("area/x", 1000, 1000),
    ("fair/x", 1000, 1000)])
def test_levels_are_the_chain_the_engine_charges(path: str, uid: int, gid: int) -> None:
    async def main() -> None:
        engine = PolicyQos(POLICY)
        ctx = SimpleNamespace(uid=uid, gid=gid, pid=0)
        flow = engine.open_flow(FakeFs(), fake_inode(path), ctx, True)  # type: ignore[arg-type]
        body = ask(path, op="write", uid=uid, gid=gid, engine=engine)
        assert (body["class"]["name"], (body["tenant"] or {}).get("name")) == (
            flow.cls.rule.name, flow.tenant_name)
        assert [(lv["level"], lv["name"]) for lv in body["levels"]] == _chain(flow)

    trio.run(main)


@mock_clock
async def test_an_engine_answers_with_the_limits_in_force() -> None:
    engine = PolicyQos(POLICY)
    before = ask("pathy/a", op="write", engine=engine)
    assert before["policy"]["generation"] == 1
    engine.swap(with_changes(engine.policy, "class", "by_path",
                             {"write_bandwidth": "7MiB/s"}))
    body = ask("pathy/a", op="write", engine=engine)
    assert body["policy"]["generation"] == 2
    assert body["levels"][0]["limits"] == {"write_bandwidth": 7 * MiB}
    # ctl set changes settings only: the lines of the file still hold.
    assert body["class"]["line"] == before["class"]["line"] == line_of(TEXT, "classes.by_path")
    engine.set_auto_caps("by_path", AutoCaps(write_bandwidth=2 * MiB))
    level = ask("pathy/a", op="write", engine=engine)["levels"][0]
    assert level["limits"] == {"write_bandwidth": 2 * MiB}
    assert level["configured"] == {"write_bandwidth": 7 * MiB}
    assert level["auto_limits"] == {"write_bandwidth": 2 * MiB}


@mock_clock
async def test_a_fair_share_is_split_among_the_users_active_now() -> None:
    engine = PolicyQos(POLICY)
    for uid in (7001, 7002):
        ctx = SimpleNamespace(uid=uid, gid=uid, pid=0)
        flow = engine.open_flow(FakeFs(), fake_inode("fair/x"), ctx, True)  # type: ignore[arg-type]
        await flow.admit_write(4096)  # active from its first request
    user = ask("fair/y", op="write", uid=7003, engine=engine)["levels"][0]
    assert user["active_users"] == 3  # this uid's request would make a third
    assert user["limits"] == {"write_bandwidth": pytest.approx(10 * MiB)}
    active = ask("fair/y", op="write", uid=7001, engine=engine)["levels"][0]
    assert active["active_users"] == 2
    assert active["limits"] == {"write_bandwidth": pytest.approx(15 * MiB)}


def test_explaining_charges_nothing_and_makes_no_account() -> None:
    async def main() -> None:
        engine = PolicyQos(POLICY)
        for path in ("pathy/a", "fair/x", "x"):
            ask(path, op="write", uid=2500, engine=engine)
        assert not engine.accounts.snapshot() and not engine._flows
        assert not engine.classes["fair"].group.children  # type: ignore[union-attr]

    trio.run(main)


def test_keys_left_out_are_the_asking_processs_own() -> None:
    """Its environment and cgroups are read from /proc, as the mount reads a caller's."""
    proc = subprocess.Popen(["sleep", "30"], env={"QOSFS_CLASS": "gold", "OTHER": "x"})
    try:
        environ = Path(f"/proc/{proc.pid}/environ")
        # Until it has exec'd (its environ is then sleep's own).
        wait_for("sleep to exec", lambda: b"QOSFS_CLASS=gold" in environ.read_bytes(),
                 interval=0.01)
        body = explain(Classifier(POLICY), Asked("x"), pid=proc.pid, uid=321, gid=654)
    finally:
        proc.kill()
        proc.wait()
    assert body["request"]["env"] == {"QOSFS_CLASS": "gold"}  # only what the policy reads
    assert body["request"]["from_caller"] == ["uid", "gid", "env", "cgroups"]
    assert (body["request"]["uid"], body["request"]["gid"]) == (321, 654)
    assert body["class"]["name"] == "by_env"
    given = explain(Classifier(POLICY), Asked("x", env=(), cgroups=()), pid=os.getpid(),
                    uid=321, gid=654)
    assert given["request"]["env"] == {} and given["request"]["cgroups"] == []
    assert given["request"]["from_caller"] == ["uid", "gid"]


def test_job_of_keeps_what_the_policy_reads_and_drops_empty_values() -> None:
    job = job_of({"A": "1", "B": "", "C": "3"}, ["/v2", "/v1a"], ("B", "A"))
    assert job == JobInfo((("A", "1"),), "/v2", ("/v1a",))


@pytest.mark.parametrize(("path", "mountpoint", "expected"), [
    ("data/x", None, "data/x"), ("./data//x/", None, "data/x"), ("", None, ""),
    (".", None, ""), ("a/../b", None, "b"), ("/mnt/m/data/x", "/mnt/m", "data/x"),
    ("/mnt/m", "/mnt/m", ""), ("//mnt/m/x", "/mnt/m", "x"), ("/x", "/", "x"),
])
def test_paths_are_relative_to_the_mount_root(path: str, mountpoint: str | None,
                                              expected: str) -> None:
    assert mount_relative(path, mountpoint) == expected


@pytest.mark.parametrize(("path", "mountpoint", "message"), [
    ("/mnt/m/x", None, "/mnt/m/x is absolute: give PATH relative to the mount root"),
    ("/mnt/mx/y", "/mnt/m", "/mnt/mx/y is not in the mount /mnt/m"),
    ("/mnt/m/../x", "/mnt/m", "/mnt/m/../x is not in the mount /mnt/m"),
    ("../x", "/mnt/m", "../x is outside the mount root"),
])
def test_paths_outside_the_mount_are_refused_naming_it(path: str, mountpoint: str | None,
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        mount_relative(path, mountpoint)
