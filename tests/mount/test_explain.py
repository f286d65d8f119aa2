"""``qosfs explain`` against a live mount agrees with what the mount charges.

Each case makes a real request through the mount (as a uid, with an environment, in a
cgroup), reads which class, tenant and uid ``ctl stats`` charged it to, and asks
``qosfs explain --socket`` (the command line, in process) the same question: the two must
name the same account. One key of each kind: paths, ops, uids, gids, job_env/jobs,
cgroups (v2 and v1, where this host lets root make a cgroup: ``job_cgroup`` in
tests/conftest.py), tenants, and a per-user class. Writers run as other uids: root only.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from qosfs.control.ctl import Client
from qosfs.daemon import cli
from tests.mounting import QosfsMount, as_user

pytestmark = [pytest.mark.mount, pytest.mark.root]

# The cgroup job_cgroup makes: "/qosfs-test-PID/job_771", in v2 or in v1's memory.
CGROUPS = f'["/qosfs-test-{os.getpid()}/**"]'
POLICY = f"""
[tenants.team]
uids = [4242]

[tenants.staff]
gids = [4343]

[tenants.job]
job_env = "QOSFS_TEST_JOB"
jobs = ["job-*"]

[tenants.pod]
cgroups = {CGROUPS}

[classes.by_path]
paths = ["pathy/**"]

[classes.by_op]
paths = ["ops/**"]
ops = ["read"]
passthrough = "off"   # its reads are charged by the daemon, as explain says

[classes.by_uid]
uids = [4444]

[classes.by_gid]
gids = [4545]

[classes.by_env]
job_env = "QOSFS_TEST_CLASS"
jobs = ["gold"]

[classes.by_cgroup]
cgroups = {CGROUPS}
paths = ["cg/**"]

[classes.by_tenant]
tenants = ["team"]

[classes.listing]
paths = ["meta/**"]
ops = ["meta"]
meta_iops = 1000000

[classes.fair]
paths = ["fair/**"]
per_user = "fair"
write_bandwidth = "1GiB/s"
"""
DIRS = ("pathy", "ops", "plain", "meta", "fair", "cg")
NOBODY = 5000  # a uid and gid no rule names


class Live:
    def __init__(self, mount: QosfsMount, sock: Path, policy: Path) -> None:
        self.mount, self.sock, self.policy = mount, sock, policy
        self.mnt = mount.mountpoint

    def accounts(self) -> dict[tuple[str, str | None, int | None], dict[str, Any]]:
        with Client(str(self.sock)) as client:
            reply = client.request({"cmd": "stats"})
        return {(a["class"], a["tenant"], a["uid"]): a for a in reply["accounts"]}

    def charged(self, counter: str, request: Callable[[], None]
                ) -> set[tuple[str, str | None, int | None]]:
        """The accounts whose *counter* the request made grow."""
        before = self.accounts()
        request()
        after = self.accounts()
        return {key for key, acc in after.items()
                if acc[counter] > before.get(key, {}).get(counter, 0)}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("explain")
    for path in (tmp, *tmp.parents):  # other uids must reach the mount
        if path == Path("/"):
            break
        os.chmod(path, path.stat().st_mode | 0o711)
    src, mnt = tmp / "src", tmp / "mnt"
    src.mkdir()
    mnt.mkdir()
    for d in (src, *(src / d for d in DIRS)):
        d.mkdir(exist_ok=True)
        os.chmod(d, 0o777)
    for name in ("ops/r", "meta/m"):  # made underneath: nothing of them is cached
        (src / name).write_bytes(b"r" * 65536)
    policy = tmp / "policy.toml"
    policy.write_text(POLICY)
    sock = tmp / "ctl.sock"
    m = QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock))
    m.start()
    try:
        yield Live(m, sock, policy)
    finally:
        code = m.stop()
        assert code == 0, m.log()
        assert "Traceback" not in m.log(), m.log()


def explain(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code = cli.main(["explain", *args, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    body: dict[str, Any] = json.loads(out)
    return body


def account(body: dict[str, Any]) -> tuple[str, str | None, int | None]:
    """The account explain's answer says the request is counted in (uid: per_user only)."""
    uid = body["request"]["uid"] if body["class"]["per_user"] else None
    return body["class"]["name"], (body["tenant"] or {}).get("name"), uid


def dd(args: list[str], uid: int, gid: int, env: dict[str, str],
       cgroup: Path | None = None) -> Callable[[], None]:
    def enter() -> None:
        if cgroup is not None:  # as root, then drop to the user
            (cgroup / "cgroup.procs").write_text("0")
        as_user(uid, gid)()

    return lambda: subprocess.run(["dd", *args, "status=none"], check=True,
                                  env={"PATH": os.environ["PATH"], **env}, preexec_fn=enter)


# (what, path, uid, gid, the writer's environment, expected class, expected tenant)
WRITES = [
    ("paths", "pathy/a", NOBODY, NOBODY, {}, "by_path", None),
    ("ops-write", "ops/w", NOBODY, NOBODY, {}, "default", None),
    ("uids", "plain/u", 4444, NOBODY, {}, "by_uid", None),
    ("gids", "plain/g", NOBODY, 4545, {}, "by_gid", None),
    ("env-class", "plain/e", NOBODY, NOBODY, {"QOSFS_TEST_CLASS": "gold"}, "by_env", None),
    ("env-miss", "plain/m", NOBODY, NOBODY, {"QOSFS_TEST_CLASS": "lead"}, "default", None),
    ("env-tenant", "plain/j", NOBODY, NOBODY, {"QOSFS_TEST_JOB": "job-3"}, "default", "job"),
    ("tenants", "plain/t", 4242, NOBODY, {}, "by_tenant", "team"),
    ("gid-tenant", "plain/s", NOBODY, 4343, {}, "default", "staff"),
    ("per-user", "fair/f", NOBODY, NOBODY, {}, "fair", None),
]


@pytest.mark.parametrize(("path", "uid", "gid", "env", "cls", "tenant"),
                         [w[1:] for w in WRITES], ids=[w[0] for w in WRITES])
def test_explain_names_the_account_a_write_is_charged_to(
        live: Live, capsys: pytest.CaptureFixture[str], path: str, uid: int, gid: int,
        env: dict[str, str], cls: str, tenant: str | None) -> None:
    write = dd(["if=/dev/zero", f"of={live.mnt / path}", "bs=64k", "count=2"], uid, gid, env)
    charged = live.charged("write_bytes", write)
    given_env = [f"--env={k}={v}" for k, v in env.items()] or ["--env=QOSFS_TEST_JOB="]
    body = explain(capsys, path, "--op", "write", "--uid", str(uid), "--gid", str(gid),
                   *given_env, "--socket", str(live.sock))
    assert charged == {account(body)}
    assert account(body)[:2] == (cls, tenant)
    assert body["mount"] == str(live.mnt) and body["policy"]["source"] == str(live.policy)
    # The line named is the class's own in the policy file.
    if cls != "default":
        lines = live.policy.read_text().split("\n")
        assert lines[body["class"]["line"] - 1] == f"[classes.{cls}]"


def test_explain_names_the_account_a_read_is_charged_to(
        live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    read = dd([f"if={live.mnt / 'ops/r'}", "of=/dev/null", "bs=64k"], NOBODY, NOBODY, {})
    charged = live.charged("read_bytes", read)
    body = explain(capsys, str(live.mnt / "ops/r"), "--uid", str(NOBODY), "--gid",
                   str(NOBODY), "--socket", str(live.sock))  # an absolute PATH in the mount
    assert body["path"] == "ops/r"
    assert charged == {account(body)} == {("by_op", None, None)}
    assert body["class"]["matched"][1]["key"] == "ops"


def test_explain_names_the_account_metadata_is_charged_to(
        live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    stat = lambda: subprocess.run(["stat", str(live.mnt / "meta" / "m")], check=True,  # noqa: E731
                                  capture_output=True, preexec_fn=as_user(NOBODY))
    charged = live.charged("meta_ops", stat)
    asked = [explain(capsys, path, "--op", "meta", "--uid", str(NOBODY), "--gid",
                     str(NOBODY), "--socket", str(live.sock)) for path in ("meta/m", "")]
    # The lookup of "meta" is charged at the root, the rest at meta/ and meta/m.
    assert account(asked[0]) == ("listing", None, None)
    assert account(asked[1]) == ("default", None, None)
    assert charged == {account(asked[0]), account(asked[1])}


def test_explain_names_the_account_of_a_writer_in_a_cgroup(
        live: Live, capsys: pytest.CaptureFixture[str], job_cgroup: Path) -> None:
    """The cgroup (v2, or v1's memory controller) a scheduler would put a job in: the
    class and the tenant that match on it."""
    write = dd(["if=/dev/zero", f"of={live.mnt / 'cg/x'}", "bs=64k", "count=2"], NOBODY,
               NOBODY, {}, cgroup=job_cgroup)
    charged = live.charged("write_bytes", write)
    path = f"/{job_cgroup.parent.name}/{job_cgroup.name}"
    body = explain(capsys, "cg/x", "--op", "write", "--uid", str(NOBODY), "--gid",
                   str(NOBODY), "--cgroup", path, "--socket", str(live.sock))
    assert charged == {account(body)} == {("by_cgroup", "pod", None)}
    assert [c["key"] for c in body["class"]["matched"]] == ["paths", "cgroups"]
    outside = explain(capsys, "cg/x", "--op", "write", "--uid", str(NOBODY), "--gid",
                      str(NOBODY), "--cgroup", "/", "--socket", str(live.sock))
    assert account(outside) == ("default", None, None)


def test_the_mount_is_found_from_the_path_and_answers_what_is_in_force(
        tmp_tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No --socket: an absolute PATH names its mount, whose default socket answers; a
    `ctl set` is in the next answer; a PATH outside the mount is refused naming it."""
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir()
    mnt.mkdir()
    policy = tmp_tree / "policy.toml"
    policy.write_text(POLICY)
    with QosfsMount(src, mnt, "--policy", str(policy)):
        code = cli.main(["explain", str(mnt / "pathy/ckpt.pt"), "--op", "write"])
        out, err = capsys.readouterr()
        assert code == 0, err
        words = " ".join(out.split())  # long temporary paths wrap
        assert f"policy {policy}, generation 1, in force on {mnt}" in words
        assert "served the daemon (only read-only opens are passed through to the kernel)" \
            in words
        assert cli.main(["ctl", "--socket", str(mnt), "set", "by_path",
                         "write_bandwidth=3MiB/s"]) == 0
        capsys.readouterr()
        body = explain(capsys, "pathy/ckpt.pt", "--op", "write", "--socket", str(mnt))
        assert body["policy"]["generation"] == 2
        assert body["levels"][0]["limits"] == {"write_bandwidth": 3 << 20}
        assert body["request"]["uid"] == os.geteuid()  # the asker's own, from SO_PEERCRED
        code = cli.main(["explain", str(tmp_tree / "elsewhere"), "--socket", str(mnt)])
        _, err = capsys.readouterr()
        assert (code, err) == (2, f"qosfs: {tmp_tree / 'elsewhere'} is not in the mount "
                                  f"{mnt}\n")
        # A policy file, with PATH in the mount: relative to that mount, nothing asked of it.
        other = tmp_tree / "other.toml"
        other.write_text('[classes.elsewhere]\npaths = ["pathy/**"]\n')
        body = explain(capsys, str(mnt / "pathy/ckpt.pt"), "--policy", str(other))
        assert (body["mount"], body["path"]) == (str(mnt), "pathy/ckpt.pt")
        assert body["class"]["name"] == "elsewhere" and body["policy"]["generation"] is None


def test_a_mount_in_place_explains_what_it_charges(
        tmp_tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Mounted over its source (as systemd and the DaemonSet deploy it): the path in the
    mount is the path of the source, and its derived socket answers."""
    src = tmp_tree / "src"
    for d in (src, src / "pathy"):
        d.mkdir()
        os.chmod(d, 0o777)
    policy = tmp_tree / "policy.toml"
    policy.write_text(POLICY)
    sock = tmp_tree / "ctl.sock"
    with QosfsMount(src, src, "--policy", str(policy), "--socket", str(sock)) as m:
        live = Live(m, sock, policy)
        write = dd(["if=/dev/zero", f"of={src / 'pathy/a'}", "bs=64k", "count=2"], 4242,
                   NOBODY, {})
        charged = live.charged("write_bytes", write)
        body = explain(capsys, str(src / "pathy/a"), "--op", "write", "--uid", "4242",
                       "--gid", str(NOBODY), "--socket", str(sock))
        assert (body["mount"], body["path"]) == (str(src), "pathy/a")
        assert charged == {account(body)} == {("by_path", "team", None)}
