"""``qosfs explain`` without a mount: the command line against a policy file (each kind of
key), its text and JSON, the ``explain`` control request and the service answering it.
Through a live mount: tests/mount/test_explain.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from qosfs.control.explain import format_explanation
from qosfs.control.protocol import ExplainRequest, Peer, ProtocolError, parse_request
from qosfs.control.service import ControlService
from qosfs.daemon import cli
from qosfs.policy.loading import parse_policy
from qosfs.qos.engine import PolicyQos
from qosfs.qos.explanation import PASSTHROUGH_READS_ONLY
from qosfs.qos.interface import PassThroughQos
from tests.mock_clock import mock_clock
from tests.unit.qos.test_explain import TEXT, line_of

ME = Peer(pid=os.getpid(), uid=4242, gid=4343)


@pytest.fixture
def policy_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "p.toml").write_text(TEXT)
    monkeypatch.chdir(tmp_path)  # a short name: the text fits 80 columns
    return "p.toml"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["explain", *args])
    out, err = capsys.readouterr()
    return code, out, err


def as_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    body: dict[str, Any] = json.loads(out)
    return body


# The command line for each kind of key: (arguments, class, tenant).
KEYS = [
    (["pathy/a", "--op", "write"], "by_path", None),
    (["ops/r", "--op", "read"], "by_op", None),
    (["ops/r", "--op", "write"], "default", None),
    (["x", "--uid", "4444"], "by_uid", None),
    (["x", "--gid", "4545"], "by_gid", None),
    (["x", "--env", "QOSFS_CLASS=gold"], "by_env", None),
    (["x", "--env", "QOSFS_CLASS="], "default", None),  # empty: unset
    (["x", "--cgroup", "/slurm/job_1"], "by_cgroup", None),
    (["x", "--cgroup", "/", "--cgroup", "/slurm/job_1/step_0"], "by_cgroup", None),  # v1
    (["x", "--gid", "50"], "by_tenant", "staff"),
    (["x", "--uid", "2001"], "default", "team"),
    (["x", "--env", "QOSFS_JOB=job-9"], "default", "job"),
    (["x", "--cgroup", "/kubepods/besteffort/pod1"], "default", "pod"),
    (["area/x"], "default", "area"),
]


@pytest.mark.parametrize(("args", "cls", "tenant"), KEYS, ids=[" ".join(k[0]) for k in KEYS])
def test_each_kind_of_key_through_the_command_line(
        capsys: pytest.CaptureFixture[str], policy_file: str, args: list[str], cls: str,
        tenant: str | None) -> None:
    # Keys not given are this process's: pin the ones a case does not set.
    pinned = [*(["--uid", "1000"] if "--uid" not in args else []),
              *(["--gid", "1000"] if "--gid" not in args else []),
              *(["--env", "UNRELATED=1"] if "--env" not in args else []),
              *(["--cgroup", "/"] if "--cgroup" not in args else [])]
    body = as_json(capsys, *args, *pinned, "--policy", policy_file)
    assert body["class"]["name"] == cls
    assert (body["tenant"] or {}).get("name") == tenant
    assert body["policy"] == {"source": policy_file, "generation": None,
                              "job_env": ["QOSFS_JOB", "QOSFS_CLASS"], "cgroups": True}
    code, out, err = run(capsys, *args, *pinned, "--policy", policy_file)
    assert code == 0, err
    assert all(len(line) <= 80 for line in out.splitlines()), out
    head = f"{policy_file}:{line_of(TEXT, f'classes.{cls}')}" if cls != "default" else \
        "default (not in the file: the loader adds it)"
    assert head in next(line for line in out.splitlines() if line.startswith("class ")), out
    if tenant is not None:
        assert f"{policy_file}:{line_of(TEXT, f'tenants.{tenant}')}" in out


def test_the_text_names_lines_levels_and_who_serves(
        capsys: pytest.CaptureFixture[str], policy_file: str) -> None:
    code, out, _ = run(capsys, "fair/ckpt", "--op", "write", "--uid", "2001", "--gid", "1000",
                       "--env", "QOSFS_JOB=job-1", "--cgroup", "/", "--policy", policy_file)
    assert code == 0
    # The lines of TEXT (tests/unit/qos/test_explain.py) each criterion is on.
    assert out == f"""\
fair/ckpt: write by uid 2001, gid 1000
env      QOSFS_JOB=job-1, QOSFS_CLASS unset
cgroups  /
policy   p.toml: the file, not a mount
class    fair                                     p.toml:47
           paths "fair/**" matches fair/ckpt      p.toml:48
           not by_path: no glob of paths matches fair/ckpt  p.toml:23
           not by_op: ops exclude write           p.toml:28
           not by_uid: uids exclude uid 2001      p.toml:32
           not by_gid: gids exclude gid 1000      p.toml:35
           not by_env: job_env: QOSFS_CLASS unset  p.toml:38
           not by_cgroup: cgroups exclude /       p.toml:42
           not by_tenant: tenants exclude team    p.toml:45
tenant   team                                     p.toml:5
           uids 2000-2999 holds uid 2001          p.toml:6
charged  user fair/uid=2001: an equal share of the class's caps among its active
         users
         class fair: w:30MiB/s
         tenant team: w:1GiB/s
         backend: r:4GiB/s w:2GiB/s; priority low (weight 1), guaranteed
         w:10MiB/s
served   the daemon ({PASSTHROUGH_READS_ONLY})
"""
    assert line_of(TEXT, "classes.fair", "paths") == 48  # the numbers above


def test_json_keys_are_the_documented_schema(capsys: pytest.CaptureFixture[str],
                                             policy_file: str) -> None:
    body = as_json(capsys, "x", "--policy", policy_file)
    assert list(body) == ["path", "mount", "request", "policy", "class", "classes_passed",
                          "tenant", "tenants_passed", "levels", "served_by", "notes"]
    assert list(body["request"]) == ["op", "uid", "gid", "env", "cgroups", "from_caller"]
    assert body["request"]["from_caller"] == ["uid", "gid", "env", "cgroups"]
    assert (body["request"]["uid"], body["request"]["gid"]) == (os.geteuid(), os.getegid())
    assert list(body["class"]) == ["name", "line", "decided_on", "matched", "priority",
                                   "per_user", "cache"]
    assert body["served_by"]["by"] == "daemon" and body["served_by"]["passthrough"] is False
    # Documented where the other commands are.
    docs = (Path(__file__).resolve().parents[3] / "docs" / "policy.md").read_text()
    for key in (*body, *body["request"], *body["class"], *body["served_by"],
                *body["levels"][0]):
        assert f"`{key}`" in docs, key


@pytest.mark.parametrize(("args", "message"), [
    (["/etc/passwd"], "/etc/passwd is absolute: give PATH relative to the mount root"),
    (["../x"], "../x is outside the mount root"),
    (["x", "--env", "NOVALUE"], "--env NOVALUE: expected NAME=VALUE"),
    (["x", "--cgroup", "slurm/x"], "--cgroup slurm/x: cgroup paths are absolute"),
    (["x", "--uid", "-1"], "--uid -1: expected 0 to 4294967295"),
])
def test_usage_mistakes_exit_2_naming_what_is_wrong(
        capsys: pytest.CaptureFixture[str], policy_file: str, args: list[str],
        message: str) -> None:
    code, out, err = run(capsys, *args, "--policy", policy_file)
    assert (code, out) == (2, "") and err.startswith(f"qosfs: {message}"), err


def test_a_bad_policy_exits_6_and_no_mount_exits_7(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[classes.x]\npaths = 3\n")
    code, _, err = run(capsys, "x", "--policy", str(bad))
    assert code == 6 and f"{bad}:2: classes.x.paths" in err
    code, _, err = run(capsys, "x", "--socket", str(tmp_path / "none.sock"))
    assert code == 7 and "cannot reach the qosfs control socket" in err
    code, _, err = run(capsys, str(tmp_path / "x"))
    assert code == 2 and "is not in a qosfs mount" in err


def test_env_given_but_not_read_is_pointed_out(capsys: pytest.CaptureFixture[str],
                                               policy_file: str) -> None:
    code, out, _ = run(capsys, "x", "--env", "SLURM_JOB_ID=5", "--policy", policy_file)
    assert code == 0
    assert "note     --env SLURM_JOB_ID: this policy matches no variable SLURM_JOB_ID" in out


def test_text_of_a_mount_says_which_generation_is_in_force() -> None:
    body = {"path": "", "mount": "/mnt/m",
            "request": {"op": "meta", "uid": 0, "gid": 0, "env": {}, "cgroups": ["/"],
                        "from_caller": ["uid", "gid", "env", "cgroups"]},
            "policy": {"source": "/etc/qosfs/m.toml", "generation": 7, "job_env": [],
                       "cgroups": False},
            "class": {"name": "default", "line": None, "decided_on": "", "matched": [],
                      "priority": "normal", "per_user": False, "cache": "auto"},
            "classes_passed": [], "tenant": None, "tenants_passed": [],
            "levels": [{"level": "class", "name": "default", "limits": {"read_bandwidth": 2.0},
                        "configured": {"read_bandwidth": 4.0}, "scope": "node",
                        "auto_limits": {"read_bandwidth": 2.0}}],
            "served_by": {"by": "daemon", "passthrough": False, "reason": PASSTHROUGH_READS_ONLY},
            "notes": []}
    assert format_explanation(body).splitlines()[:2] == [
        "/: meta by uid 0, gid 0 (yours)",
        "policy   /etc/qosfs/m.toml, generation 7, in force on /mnt/m"]
    assert "class default: r:2B/s (lowered by the latency target); policy: r:4B/s" in \
        format_explanation(body)


# ------------------------------------------------------------------ the control request

def test_explain_requests_parse_with_their_keys_optional() -> None:
    assert parse_request(b'{"cmd": "explain", "path": "a"}') == ExplainRequest("a")
    full = parse_request(json.dumps({
        "cmd": "explain", "path": "/m/a", "op": "write", "uid": 5, "gid": 6,
        "env": {"A": "1"}, "cgroups": ["/x", "/y"]}).encode())
    assert full == ExplainRequest("/m/a", "write", 5, 6, (("A", "1"),), ("/x", "/y"))


@pytest.mark.parametrize(("body", "message"), [
    ({"cmd": "explain"}, '"path" is required'),
    ({"cmd": "explain", "path": "a", "op": "delete"}, '"op" must be one of read, write, meta'),
    ({"cmd": "explain", "path": "a", "uid": -1}, '"uid" must be an integer from 0'),
    ({"cmd": "explain", "path": "a", "gid": True}, '"gid" must be an integer from 0'),
    ({"cmd": "explain", "path": "a", "uid": 2**32}, '"uid" must be an integer from 0'),
    ({"cmd": "explain", "path": "a", "env": ["A=1"]}, '"env" must be an object'),
    ({"cmd": "explain", "path": "a", "env": {"A": 1}}, '"env" must be an object'),
    ({"cmd": "explain", "path": "a", "cgroups": ["x"]}, '"cgroups" must be a list of at'),
    ({"cmd": "explain", "path": "a", "cgroups": "/x"}, '"cgroups" must be a list of at'),
    ({"cmd": "explain", "path": "a", "pid": 1}, 'unknown key "pid" for "explain"'),
])
def test_malformed_explain_requests_are_refused(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse_request(json.dumps(body).encode())


@mock_clock
async def test_the_service_answers_from_the_policy_in_force_for_any_peer() -> None:
    engine = PolicyQos(parse_policy(TEXT, "/etc/qosfs/p.toml"))
    service = ControlService(engine, info={"mountpoint": "/mnt/m"})
    reply = await service.handle(ExplainRequest("/mnt/m/x", cgroups=("/",)), ME)
    assert reply["ok"] is True and reply["mount"] == "/mnt/m" and reply["path"] == "x"
    # The peer's own uid and gid, and the tenant they make.
    assert (reply["request"]["uid"], reply["request"]["gid"]) == (4242, 4343)
    assert reply["request"]["from_caller"] == ["uid", "gid", "env"]
    assert reply["policy"]["generation"] == 1
    given = await service.handle(ExplainRequest("pathy/x", "write", uid=2001), ME)
    assert (given["class"]["name"], given["tenant"]["name"]) == ("by_path", "team")
    refused = await service.handle(ExplainRequest("/elsewhere/x"), ME)
    assert refused == {"ok": False, "code": "path",
                       "error": "/elsewhere/x is not in the mount /mnt/m"}
    assert reply["served_by"]["page_cache"] == "used"
    service.info["page_cache"] = "never"  # mounted with --cache never: no read is cached
    bypassed = await service.handle(ExplainRequest("x"), ME)
    assert bypassed["served_by"]["page_cache"] == "bypassed"


@mock_clock
async def test_a_mount_without_policy_has_nothing_to_explain() -> None:
    service = ControlService(PassThroughQos(), info={"mountpoint": "/mnt/m"})
    reply = await service.handle(ExplainRequest("x"), ME)
    assert reply["ok"] is False and reply["code"] == "unavailable"
    assert "--no-qos" in reply["error"]
