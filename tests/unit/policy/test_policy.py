"""Policy parsing, validation, error messages, rendering round trips and live changes."""

from __future__ import annotations

import grp
import os
import re
import time
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qosfs.core.errors import EXIT_POLICY, QosfsError
from qosfs.policy.keys import CLASS_KEYS, LIMIT_KEYS, TENANT_KEYS
from qosfs.policy.loading import (
    default_policy,
    load_policy,
    parse_policy,
    policy_notes,
    with_changes,
)
from qosfs.policy.model import (
    Backend,
    ClassRule,
    Control,
    IdRange,
    Limits,
    Policy,
    PolicyError,
    Tenant,
    passthrough_blocker,
)
from qosfs.policy.text import DEFAULT_POLICY_TEXT

MIB, GIB = 2**20, 2**30

FULL = """\
[backend]
read_bandwidth = "4GiB/s"
write_bandwidth = "2GiB/s"
meta_iops = "50k"

[control]
admin_group = 0

[tenants.team-a]
uids = ["1000-1999", 42]
gids = [100]
paths = ["teams/a/**"]
write_bandwidth = "1GiB/s"

[tenants.ops]
paths = ["ops/**"]

[classes.datasets]
paths = ["data/**", "**/*.parquet"]
priority = "high"
min_read_bandwidth = "1GiB/s"
cache = "keep"

[classes.default]
read_iops = 5000

[classes.checkpoints]
paths = ["**/checkpoints/**", "**/*.pt"]
tenants = ["team-a"]
ops = ["write", "meta"]
write_bandwidth = "400MiB/s"
write_iops = 2000
burst = "128MiB"
burst_iops = 64
per_user = "fair"
min_write_bandwidth = "100MiB/s"

[classes.slurm]
uids = [5]
gids = ["10-20"]
job_env = "SLURM_JOB_ID"
jobs = ["1234", "55*"]
cgroups = ["/slurm/uid_*/job_*/**"]
priority = 7
target_read_latency = "5ms"
latency_percentile = 99.9
read_bandwidth = "unlimited"
"""


def errmsg(text: str) -> str:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "mlfs.toml")
    return str(info.value)


def test_full_policy_parses() -> None:
    p = parse_policy(FULL, "mlfs.toml")
    assert [c.name for c in p.classes] == ["datasets", "checkpoints", "slurm", "default"]
    assert p.backend == Backend(Limits(read_bandwidth=4 * GIB, write_bandwidth=2 * GIB,
                                       meta_iops=50_000.0))
    assert p.control == Control(admin_gid=0)
    team = p.tenant_by_name("team-a")
    assert team == Tenant("team-a", (IdRange(1000, 1999), IdRange(42, 42)), (IdRange(100, 100),),
                          ("teams/a/**",), Limits(write_bandwidth=GIB))
    assert 1500 in team.uids[0] and 2000 not in team.uids[0]
    ckpt = p.class_by_name("checkpoints")
    assert ckpt is not None
    assert ckpt.ops == frozenset({"write", "meta"})
    assert ckpt.limits == Limits(write_bandwidth=400 * MIB, write_iops=2000.0, burst=128 * MIB,
                                 burst_iops=64.0)
    assert ckpt.per_user and ckpt.priority_weight == 10 and ckpt.priority_name == "normal"
    slurm = p.class_by_name("slurm")
    assert slurm is not None
    assert (slurm.priority_weight, slurm.priority_name) == (7, "7")
    assert slurm.target_read_latency == 0.005 and slurm.latency_percentile == 99.9
    assert slurm.limits.is_unlimited and not ckpt.limits.is_unlimited
    assert p.class_by_name("datasets").priority_weight == 100  # type: ignore[union-attr]
    assert p.class_by_name("default").limits.read_iops == 5000  # type: ignore[union-attr]
    assert p.needs_job_lookup and p.job_envs == ("SLURM_JOB_ID",)
    assert p.class_by_name("nope") is None and p.tenant_by_name("nope") is None


def test_empty_policy_has_only_default() -> None:
    p = parse_policy("")
    assert p.classes == (ClassRule("default"),)
    assert p.backend is None and p.tenants == () and p.control == Control()
    assert not p.needs_job_lookup and p.job_envs == ()


def test_all_ops_normalize_to_any() -> None:
    p = parse_policy('[classes.x]\nops = ["meta", "read", "write"]\n')
    assert p.classes[0].ops == frozenset()


def test_default_policy() -> None:
    p = default_policy()
    assert [c.name for c in p.classes] == ["checkpoints", "datasets", "default"]
    ckpt, data, default = p.classes
    assert "**/*.safetensors" in ckpt.paths and "**/checkpoints/**" in ckpt.paths
    assert ckpt.limits == Limits(write_bandwidth=400 * MIB, burst=64 * MIB)
    assert data.priority_name == "high" and data.limits.is_unlimited
    assert default == ClassRule("default")
    assert p == parse_policy(DEFAULT_POLICY_TEXT)
    assert all(len(line) <= 100 for line in DEFAULT_POLICY_TEXT.splitlines())


@pytest.mark.parametrize("text", [FULL, DEFAULT_POLICY_TEXT, "", '[classes.x]\nuids = [7]\n'])
def test_render_round_trip(text: str) -> None:
    p = parse_policy(text, "a.toml")
    rendered = p.render()
    tomllib.loads(rendered)
    again = parse_policy(rendered, "b.toml")
    assert again == p
    assert again.render().splitlines()[1:] == rendered.splitlines()[1:]


def test_render_escapes_strings() -> None:
    p = parse_policy('[classes.x]\npaths = ["we\\"ird\\\\na\\u007fme/**", "caf\u00e9/*"]\n',
                     "odd\nsource")
    assert parse_policy(p.render()) == p


def test_burst_defaults() -> None:
    limits = Limits(write_bandwidth=400 * MIB)
    assert limits.bandwidth_burst(400 * MIB) == 40 * MIB
    assert limits.bandwidth_burst(1 * MIB) == MIB  # at least 1 MiB
    assert Limits(burst=64 * MIB).bandwidth_burst(400 * MIB) == 64 * MIB
    assert limits.iops_burst(2000) == 200 and limits.iops_burst(10) == 8
    assert Limits(burst_iops=3).iops_burst(2000) == 3


SEMANTIC_ERRORS = [
    ('[classes.checkpoints]\nwrite_bandwidth = "400MB"\n',
     ('mlfs.toml:2: classes.checkpoints.write_bandwidth: expected a bandwidth like "400MiB/s", '
      'got "400MB"')),
    ('[classes.x]\npathz = ["a"]\n',
     'mlfs.toml:2: classes.x.pathz: unknown key "pathz"; did you mean "paths"?'),
    ('[clases.x]\n', 'mlfs.toml:1: clases: unknown table "clases"; did you mean "classes"?'),
    ('zzz = 1\n',
     'mlfs.toml:1: zzz: unknown key "zzz" (expected backend, control, metrics, cluster, tenants, classes)'),  # noqa: E501
    ('[backend]\nread_bandwith = "1GiB/s"\n',
     ('mlfs.toml:2: backend.read_bandwith: unknown key "read_bandwith"; did you mean '
      '"read_bandwidth"?')),
    ('classes = 3\n', 'mlfs.toml:1: classes: expected a table, got 3'),
    ('[classes]\nx = 3\n', 'mlfs.toml:2: classes.x: expected a table, got 3'),
    ('[classes.default]\npaths = ["a/**"]\n',
     ('mlfs.toml:2: classes.default.paths: the default class takes everything no other class '
      'matched; it cannot have match keys (remove "paths")')),
    ('[classes.x]\nmin_read_bandwidth = "1GiB/s"\n',
     ('mlfs.toml:2: classes.x.min_read_bandwidth: a guarantee needs [backend] read_bandwidth '
      'to be declared')),
    (('[backend]\nread_bandwidth = "1GiB/s"\n[classes.x]\nmin_read_bandwidth = "768MiB/s"\n'
      '[classes.y]\nmin_read_bandwidth = "512MiB/s"\n'),
     ('mlfs.toml:6: classes.y.min_read_bandwidth: the sum of min_read_bandwidth over classes '
      '(1280MiB/s) exceeds backend read_bandwidth (1GiB/s)')),
    (('[backend]\nwrite_bandwidth = "1GiB/s"\n[classes.x]\nwrite_bandwidth = "100MiB/s"\n'
      'min_write_bandwidth = "200MiB/s"\n'),
     ('mlfs.toml:5: classes.x.min_write_bandwidth: min_write_bandwidth (200MiB/s) exceeds the '
      "class's own write_bandwidth cap (100MiB/s)")),
    ('[classes.x]\ntenants = ["t"]\n',
     'mlfs.toml:2: classes.x.tenants: no tenant named "t" (tenants: none)'),
    ('[tenants.t]\nuids = ["5-1"]\n',
     'mlfs.toml:2: tenants.t.uids: range "5-1" is backwards (expected lo-hi with lo <= hi)'),
    ('[tenants.t]\nuids = [-1]\n', 'mlfs.toml:2: tenants.t.uids: id -1 out of range 0..4294967295'),
    ('[tenants.t]\ngids = ["0-4294967296"]\n',
     'mlfs.toml:2: tenants.t.gids: id "0-4294967296" out of range 0..4294967295'),
    ('[tenants.t]\nuids = ["abc"]\n',
     'mlfs.toml:2: tenants.t.uids: expected ids like 1000 or "1000-1999", got "abc"'),
    ('[tenants.t]\nuids = 1000\n',
     ('mlfs.toml:2: tenants.t.uids: expected a non-empty list of ids like 1000 or "1000-1999", '
      'got 1000')),
    ('[tenants.t]\nuids = []\n',
     ('mlfs.toml:2: tenants.t.uids: expected a non-empty list of ids like 1000 or "1000-1999", '
      'got a list')),
    ('[tenants.t]\nwrite_bandwidth = "1GiB/s"\n',
     ('mlfs.toml:1: tenants.t: a tenant needs at least one of uids, gids, paths, cgroups or '
      'job_env')),
    ('[control]\nadmin_group = "no-such-group-qosfs"\n',
     'mlfs.toml:2: control.admin_group: no group named "no-such-group-qosfs"'),
    ('[control]\nadmin_group = true\n',
     'mlfs.toml:2: control.admin_group: expected a group name or gid, got true'),
    ('[classes.x]\npaths = ["/data/**"]\n',
     ('mlfs.toml:2: classes.x.paths: invalid glob "/data/**": must be relative to the mount '
      'root (no leading "/")')),
    ('[classes.x]\npaths = ["data/../etc"]\n',
     ('mlfs.toml:2: classes.x.paths: invalid glob "data/../etc": ".." component never matches '
      '(paths are normalized)')),
    ('[classes.x]\npaths = [""]\n', 'mlfs.toml:2: classes.x.paths: invalid glob "": empty pattern'),
    ('[classes.x]\npaths = ["a[bc"]\n',
     'mlfs.toml:2: classes.x.paths: invalid glob "a[bc": unbalanced "["'),
    ('[classes.x]\npaths = [3]\n',
     'mlfs.toml:2: classes.x.paths: expected a list of path globs, got 3 in it'),
    ('[classes.x]\ncgroups = ["slurm/**"]\n',
     ('mlfs.toml:2: classes.x.cgroups: invalid glob "slurm/**": cgroup paths are absolute '
      '(start with "/")')),
    ('[classes.x]\nops = ["rd"]\n',
     'mlfs.toml:2: classes.x.ops: expected ops from "read", "write", "meta", got "rd"'),
    ('[classes.x]\npriority = "urgent"\n',
     ('mlfs.toml:2: classes.x.priority: expected "low", "normal", "high" or a weight 1..10000, '
      'got "urgent"')),
    ('[classes.x]\npriority = 0\n',
     ('mlfs.toml:2: classes.x.priority: expected "low", "normal", "high" or a weight 1..10000, '
      'got 0')),
    ('[classes.x]\nper_user = "yes"\n',
     'mlfs.toml:2: classes.x.per_user: expected one of "none", "fair", got "yes"'),
    ('[classes.x]\ncache = "off"\n',
     'mlfs.toml:2: classes.x.cache: expected one of "auto", "keep", "direct", "direct-writes", got "off"'),  # noqa: E501
    ('[classes.x]\npaths = ["a/**"]\npassthrough = "all"\n',
     'mlfs.toml:3: classes.x.passthrough: expected one of "auto", "reads", "off", got "all"'),
    ('[classes.x]\njobs = ["1"]\n',
     ('mlfs.toml:2: classes.x.jobs: jobs needs job_env, the variable holding the value (e.g. '
      '"SLURM_JOB_ID")')),
    ('[classes.x]\njob_env = "A-B"\n',
     ('mlfs.toml:2: classes.x.job_env: expected an environment variable name like '
      '"SLURM_JOB_ID", got "A-B"')),
    ('[tenants.t]\njobs = ["a*"]\n',
     ('mlfs.toml:2: tenants.t.jobs: jobs needs job_env, the variable holding the value (e.g. '
      '"SLURM_JOB_ID")')),
    ('[classes.x]\nlatency_percentile = 100\n',
     ('mlfs.toml:2: classes.x.latency_percentile: expected a percentile between 0 and 100, got '
      '100')),
    ('[classes.x]\ntarget_read_latency = "5"\n',
     ('mlfs.toml:2: classes.x.target_read_latency: expected a duration like "5ms", "250us" or '
      '"1s", got "5"')),
    ('[classes.x]\nburst = "unlimited"\n',
     ('mlfs.toml:2: classes.x.burst: expected a size like "128MiB" or a whole number of bytes, '
      'got "unlimited"')),
    ('[classes.x]\nwrite_iops = 0\n',
     'mlfs.toml:2: classes.x.write_iops: expected an IOPS rate above zero, got 0'),
    ('[classes."a b"]\n',
     ('mlfs.toml:1: classes."a b": invalid name "a b" (use up to 64 letters, digits, "_" and '
      '"-")')),
    ('[classes]\nx.paths = ["/a"]\n',
     ('mlfs.toml:2: classes.x.paths: invalid glob "/a": must be relative to the mount root (no '
      'leading "/")')),
    ('classes.x = { write_iops = -1 }\n',
     'mlfs.toml:1: classes.x.write_iops: expected an IOPS rate above zero, got -1'),
]


@pytest.mark.parametrize(("text", "message"), SEMANTIC_ERRORS)
def test_semantic_errors(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=f"^{re.escape(message)}$"):
        parse_policy(text, "mlfs.toml")


def test_error_fields() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy('# c\n[classes.ckpt]\npaths = ["a/**"]\nwrite_bandwidth = "400MB"\n',
                     "mlfs.toml")
    err = info.value
    assert (err.source, err.line, err.key) == ("mlfs.toml", 4, "classes.ckpt.write_bandwidth")
    assert err.reason == 'expected a bandwidth like "400MiB/s", got "400MB"'
    assert isinstance(err, QosfsError) and err.exit_code == EXIT_POLICY


@pytest.mark.parametrize(("text", "message"), [
    ("[classes.x]\nburst = \n", "mlfs.toml:2: invalid TOML: invalid value (column 9)"),
    ("[x]\n[x]\n", "mlfs.toml:2: invalid TOML: cannot declare ('x',) twice (column 3)"),
    ("a = ", "mlfs.toml:1: invalid TOML: invalid value (at end of document)"),
    ("[classes.a]\n[classes.a]\n",
     "mlfs.toml:2: invalid TOML: cannot declare ('classes', 'a') twice (column 11)"),
])
def test_syntax_errors(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=f"^{re.escape(message)}$") as info:
        parse_policy(text, "mlfs.toml")
    assert info.value.key is None


def test_admin_group_by_name_and_number() -> None:
    root = grp.getgrgid(0).gr_name
    assert parse_policy(f'[control]\nadmin_group = "{root}"\n').control.admin_gid == 0
    assert parse_policy('[control]\nadmin_group = "1234"\n').control.admin_gid == 1234


def test_load_policy(tmp_path: Path) -> None:
    path = tmp_path / "mlfs.toml"
    path.write_text('[classes.x]\nwrite_bandwidth = "1GiB/s"\n')
    assert load_policy(path).class_by_name("x") is not None
    with pytest.raises(PolicyError, match=f"^{re.escape(str(tmp_path))}/missing.toml: cannot "
                       "read policy: No such file or directory$"):
        load_policy(tmp_path / "missing.toml")
    path.write_bytes(b"# ok\n\xff = 1\n")
    with pytest.raises(PolicyError, match=r"mlfs.toml:2: not UTF-8 text$"):
        load_policy(path)
    path.write_text('[classes.x]\nwrite_bandwidth = "1MB"\n')
    with pytest.raises(PolicyError, match=r"mlfs.toml:2: classes.x.write_bandwidth: expected"):
        load_policy(path)


def test_with_changes() -> None:
    p = parse_policy(FULL, "mlfs.toml")
    q = with_changes(p, "class", "checkpoints", {"write_bandwidth": "800MiB/s", "priority": "3"})
    ckpt = q.class_by_name("checkpoints")
    assert ckpt is not None and ckpt.limits.write_bandwidth == 800 * MIB
    assert ckpt.priority_weight == 3
    assert q.source == "mlfs.toml" and p.class_by_name("checkpoints") != ckpt
    assert [c.name for c in q.classes] == [c.name for c in p.classes]
    r = with_changes(q, "class", "checkpoints", {"write_bandwidth": "unlimited"})
    assert r.class_by_name("checkpoints").limits.write_bandwidth is None  # type: ignore[union-attr]
    t = with_changes(p, "tenant", "team-a", {"read_iops": "2k"})
    assert t.tenant_by_name("team-a").limits.read_iops == 2000  # type: ignore[union-attr]
    b = with_changes(parse_policy(""), "backend", None, {"read_bandwidth": "4GiB/s"})
    assert b.backend == Backend(Limits(read_bandwidth=4 * GIB))
    assert with_changes(b, "backend", None, {"read_bandwidth": "unlimited"}).backend is None


@pytest.mark.parametrize(("kind", "name", "changes", "message"), [
    ('class', 'nope', {},
     'ctl: no class named "nope" (classes: datasets, checkpoints, slurm, default)'),
    ('tenant', 'nope', {}, 'ctl: no tenant named "nope" (tenants: team-a, ops)'),
    ('zone', None, {}, 'ctl: unknown target "zone" (expected "class", "tenant" or "backend")'),
    ('class', 'checkpoints', {'write_bandwith': '1GiB/s'},
     ('ctl: classes.checkpoints.write_bandwith: unknown key "write_bandwith"; did you mean '
      '"write_bandwidth"?')),
    ('class', 'checkpoints', {'paths': 'x'},
     ('ctl: classes.checkpoints.paths: not settable live: change it in the policy file, then '
      '`qosfs ctl reload` (settable live on a class: read_bandwidth, '
      'write_bandwidth, read_iops, write_iops, meta_iops, burst, burst_iops, '
      'min_read_bandwidth, min_write_bandwidth, priority, per_user, cache, passthrough, '
      'target_read_latency, target_read_slowdown, latency_percentile, latency_measure, '
      'detect_streaming_writes, entry_timeout, attr_timeout)')),
    ('tenant', 'team-a', {'uids': '7'},
     ('ctl: tenants.team-a.uids: not settable live: change it in the policy file, then '
      '`qosfs ctl reload` (settable live on a tenant: read_bandwidth, write_bandwidth, '
      'read_iops, write_iops, meta_iops, burst, burst_iops)')),
    ('backend', None, {'priority': 'high'},
     ('ctl: backend.priority: a key of classes, not of the backend (settable live on the '
      'backend: read_bandwidth, write_bandwidth, read_iops, write_iops, meta_iops, burst, '
      'burst_iops)')),
    ('class', 'checkpoints', {'write_bandwidth': '1MB'},
     'ctl: classes.checkpoints.write_bandwidth: expected a bandwidth like "400MiB/s", got "1MB"'),
    ('class', 'datasets', {'min_read_bandwidth': '5GiB/s'},
     ('ctl: classes.datasets.min_read_bandwidth: the sum of min_read_bandwidth over classes '
      '(5GiB/s) exceeds backend read_bandwidth (4GiB/s)')),
    ('backend', None, {'read_bandwidth': 'unlimited'},
     ('ctl: classes.datasets.min_read_bandwidth: a guarantee needs [backend] read_bandwidth to '
      'be declared')),
])
def test_with_changes_rejects(kind: str, name: str | None, changes: dict[str, str],
                              message: str) -> None:
    p = parse_policy(FULL, "mlfs.toml")
    with pytest.raises(PolicyError, match=f"^{re.escape(message)}$"):
        with_changes(p, kind, name, changes)


def test_policy_equality_ignores_source() -> None:
    assert parse_policy(FULL, "a") == parse_policy(FULL, "b")
    assert isinstance(parse_policy(FULL), Policy)


# ------------------------------------------------------------------ fuzzing

_FRAGMENTS = [
    "\n", " ", "=", "[", "]", "[[", '"', "'", ",", ".", "#", "{", "}", "-", "*", "/", "classes",
    "tenants", "backend", "control", "default", "paths", "uids", "gids", "ops", "priority",
    "burst", "write_bandwidth", "min_read_bandwidth", "admin_group", "job_env", "jobs",
    "cgroups", "per_user", "cache", '"400MiB/s"', '"2k"', "1000", "-5", "nan", "inf", "true",
    '"unlimited"', '"1000-1999"', '"**/*.pt"', '"/a"', '"[a"', "1979-05-27", "0x10", "1e400",
    "\x00", "\x7f", "\u00e9", '"\\u0000"', "999999999999999999999999",
]


@st.composite
def mutated(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from([FULL, DEFAULT_POLICY_TEXT]))
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(text)))
        end = min(len(text), at + draw(st.integers(0, 12)))
        insert = draw(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=4)))
        text = text[:at] + insert + text[end:]
    return text


_VALUES = st.recursive(
    st.one_of(st.sampled_from(_FRAGMENTS[20:]), st.text(max_size=8), st.integers(),
              st.floats(), st.booleans()),
    lambda inner: st.lists(inner, max_size=3), max_leaves=6)


@st.composite
def structured(draw: st.DrawFn) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 4))):
        table = draw(st.sampled_from(["classes.a", "classes.b", "classes.default", "tenants.t",
                                      "backend", "control"]))
        lines.append(f"[{table}]")
        for _ in range(draw(st.integers(0, 4))):
            key = draw(st.sampled_from(_FRAGMENTS[20:36]))
            value = draw(_VALUES)
            lines.append(f"{key} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(value), repr(value))
    if isinstance(value, str) and not value.startswith('"'):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


@settings(derandomize=True, max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(mutated(), structured()))
def test_fuzz_only_policy_errors(text: str) -> None:
    try:
        p = parse_policy(text, "fuzz.toml")
    except PolicyError as err:
        assert "\n" not in str(err)
        assert err.line is None or err.line >= 1
    else:
        assert parse_policy(p.render()) == p


# ------------------------------------------------------------ hostile policies
#
# Whole policies built from the schema's own vocabulary plus everything a careless or
# hostile writer adds: unknown tables and keys, bad names, duplicate tables and keys,
# quantities with hundreds of digits, negative, zero, NaN and infinite numbers, overlapping
# id ranges, invalid globs. Every one must give a valid policy or one PolicyError line
# that names the file, the line and (unless the TOML itself is broken) the key.

_GOOD_TABLES = ["backend", "control", "tenants.t", "tenants.u", "classes.a", "classes.b",
                "classes.default"]
_BAD_TABLES = ['tenants."a b"', 'classes."x.y"', "clases.z", "classes", "backend.x"]
_UNKNOWN_KEYS = ["colour", "write_bandwith", '"quoted key"', "a.b"]
_GOOD_VALUES = {  # per key: mostly valid spellings, so that deep checks are reached
    "bandwidth": ['"400MiB/s"', '"1GiB/s"', '"unlimited"', '"2MiB/s"', '"1.5GiB/s"'],
    "iops": ['2000', '"2k"', '"unlimited"', '0.5', '"1M"'],
    "burst": ['"128MiB"', '4096', '"1GiB"'],
    "burst_iops": ['64', '"1k"'],
    "paths": ['["data/**"]', '["**/*.pt", "ckpt/**"]', '["a/*/b?.[ch]"]'],
    "uids": ['["1000-1999"]', '[42, "1500-2500"]', '["0-4294967295"]'],
    "gids": ['[100]', '["10-20", "15-30"]'],
    "tenants": ['["t"]', '["t", "u"]'],
    "ops": ['["read"]', '["write", "meta"]'],
    "job_env": ['"SLURM_JOB_ID"'],
    "jobs": ['["1234", "55*"]'],
    "cgroups": ['["/slurm/uid_*/job_*/**"]'],
    "priority": ['"high"', '"low"', '7', '10000'],
    "min_read_bandwidth": ['"1MiB/s"', '"100MiB/s"'],
    "min_write_bandwidth": ['"1MiB/s"', '"3GiB/s"'],
    "per_user": ['"fair"', '"none"'],
    "cache": ['"auto"', '"keep"', '"direct"'],
    "target_read_latency": ['"5ms"', '"250us"'],
    "latency_percentile": ['99.9', '50'],
    "admin_group": ['0', '"0"', '"root"'],
}
_HOSTILE_VALUES = st.one_of(
    st.sampled_from(['"-4MiB/s"', '"0B/s"', '"NaN"', '"400MB"', "nan", "inf", "-inf", "-0.0",
                     "0", "-1", "true", '""', '"' + "9" * 400 + 'KiB"', "9" * 30, "1e400",
                     "{}", '{ write_iops = -1 }', '"5-1"', '["[a"]', '["/abs"]',
                     '["a/../b"]', '[""]', '["0-4294967296"]', '[-1]', "[]", '["rd"]',
                     '"urgent"', '"A-B"', '[true]', '[[1]]', '"no-such-group-qosfs"']),
    st.integers().map(str), st.floats().map(_toml))


def _keys_of(table: str) -> tuple[str, ...]:
    if table.startswith("classes."):
        return CLASS_KEYS
    if table.startswith("tenants."):
        return TENANT_KEYS
    return ("admin_group",) if table == "control" else LIMIT_KEYS


def _good_value(key: str) -> list[str]:
    if key in _GOOD_VALUES:
        return _GOOD_VALUES[key]
    return _GOOD_VALUES["bandwidth" if key.endswith("bandwidth") else "iops"]


@st.composite
def hostile_policy(draw: st.DrawFn) -> str:
    tables = draw(st.lists(st.sampled_from(_GOOD_TABLES), unique=True, max_size=5))
    if draw(st.integers(0, 5)) == 0:
        tables.insert(draw(st.integers(0, len(tables))), draw(st.sampled_from(_BAD_TABLES)))
    if tables and draw(st.integers(0, 15)) == 0:
        tables.append(tables[0])  # a class (or any table) declared twice
    lines: list[str] = []
    for table in tables:
        lines.append(f"[{table}]")
        keys = draw(st.lists(st.sampled_from(_keys_of(table)), unique=True, max_size=4))
        if draw(st.integers(0, 7)) == 0:
            keys.append(draw(st.sampled_from(_UNKNOWN_KEYS)))
        if keys and draw(st.integers(0, 15)) == 0:
            keys.append(keys[0])  # a key given twice
        for key in keys:
            hostile = draw(st.integers(0, 3)) == 0
            value = draw(_HOSTILE_VALUES if hostile else st.sampled_from(_good_value(key)))
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


def _key_parts(key: str) -> list[str]:
    return [part.strip('"') for part in re.findall(r'"[^"]*"|[^.]+', key)]


@settings(derandomize=True, max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(hostile_policy())
def test_hostile_policies_are_valid_or_one_error_naming_file_line_and_key(text: str) -> None:
    try:
        p = parse_policy(text, "fuzz.toml")
    except PolicyError as err:
        message = str(err)
        assert "\n" not in message and err.source == "fuzz.toml"
        assert err.line is not None and 1 <= err.line <= text.count("\n") + 1, message
        if err.key is None:
            assert message.startswith(f"fuzz.toml:{err.line}: invalid TOML: "), message
        else:
            assert message.startswith(f"fuzz.toml:{err.line}: {err.key}: "), message
            # The line named holds the key, or the header of the table it is in.
            line = text.split("\n")[err.line - 1]
            assert any(part in line for part in _key_parts(err.key)), (message, line)
    else:
        assert parse_policy(p.render()) == p


_SET_KEYS = ["read_bandwidth", "write_bandwidth", "write_iops", "meta_iops", "burst",
             "burst_iops", "priority", "per_user", "cache", "min_read_bandwidth",
             "min_write_bandwidth", "paths", "colour"]
_SET_VALUES = st.one_of(
    st.sampled_from(["400MiB/s", "2k", "unlimited", "high", "low", "7", "0", "10001", "fair",
                     "none", "keep", "direct", "-1", "nan", "inf", "", "5GiB/s", "1B/s",
                     "9" * 400 + "MiB/s", "9" * 400 + "KiB", "1e400"]),
    st.integers().map(str))


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.sampled_from(["class", "tenant", "backend", "zone"]),
       st.sampled_from(["datasets", "checkpoints", "slurm", "default", "team-a", "ops", "nope",
                        None]),
       st.dictionaries(st.sampled_from(_SET_KEYS), _SET_VALUES, min_size=1, max_size=3))
def test_live_changes_are_valid_or_one_error_and_never_touch_the_running_policy(
        kind: str, name: str | None, changes: dict[str, str]) -> None:
    running = parse_policy(FULL, "mlfs.toml")
    rendered = running.render()
    try:
        changed = with_changes(running, kind, name, changes)
    except PolicyError as err:
        assert "\n" not in str(err) and str(err).startswith("ctl: ")
        assert err.key is None or str(err).startswith(f"ctl: {err.key}: ")
    else:
        assert parse_policy(changed.render()) == changed
        assert changed.source == running.source
    assert running.render() == rendered and running == parse_policy(FULL)


@pytest.mark.parametrize("kind", ["dev-zero-symlink", "fifo", "directory", "too-large"])
def test_only_regular_files_of_bounded_size_are_read(tmp_path: Path, kind: str) -> None:
    """A symlink to /dev/zero read until memory ran out; a FIFO blocked for ever."""
    path = tmp_path / "policy.toml"
    if kind == "dev-zero-symlink":
        path.symlink_to("/dev/zero")
        reason = "not a regular file (a character device)"
    elif kind == "fifo":
        os.mkfifo(path)  # nobody writes: opening it for reading would block
        reason = "not a regular file (a FIFO)"
    elif kind == "directory":
        path.mkdir()
        reason = "not a regular file (a directory)"
    else:
        path.write_text("# padding\n" * 120_000)  # 1.2 MB of comments
        reason = "larger than 1048576 bytes"
    start = time.monotonic()
    with pytest.raises(PolicyError, match=f"^{re.escape(str(path))}: cannot read policy: "
                                          f"{re.escape(reason)}"):
        load_policy(path)
    assert time.monotonic() - start < 1.0


def test_tenants_defined_by_ids_alone_may_not_share_one() -> None:
    text = '[tenants.a]\nuids = ["1000-1999"]\n[tenants.b]\nuids = [1500, 3000]\n'
    assert errmsg(text) == ("mlfs.toml:4: tenants.b.uids: uid 1500 is also in tenants.a.uids "
                            "(a request belongs to one tenant; give each id to one, or tell "
                            "them apart by paths)")
    gids = '[tenants.a]\ngids = [50]\n[tenants.b]\ngids = ["40-60"]\n'
    assert "gid 50 is also in tenants.a.gids" in errmsg(gids)
    # Told apart by paths: allowed, and check names the precedence.
    by_paths = '[tenants.a]\nuids = ["1000-1999"]\npaths = ["a/**"]\n[tenants.b]\nuids = [1500]\n'
    assert policy_notes(parse_policy(by_paths)) == [
        "tenants a and b share uids: where both match a request (their paths), a wins "
        "(file order)"]


def test_check_notes_rules_the_caller_controls() -> None:
    policy = parse_policy('[classes.slurm]\njob_env = "SLURM_JOB_ID"\njobs = ["77*"]\n'
                          '[classes.pinned]\ncgroups = ["/slurm/job_77*/**"]\n')
    notes = policy_notes(policy)
    assert len(notes) == 1 and notes[0].startswith(
        "classes.slurm matches jobs by the environment variable SLURM_JOB_ID, which the "
        "caller sets")


def test_cache_timeouts_need_paths_and_render_back() -> None:
    with pytest.raises(PolicyError, match="attr_timeout needs paths"):
        parse_policy('[classes.x]\nuids = [1]\nattr_timeout = "5s"\n', "m.toml")
    p = parse_policy('[classes.d]\npaths = ["data/**"]\nentry_timeout = "60s"\n'
                     'attr_timeout = "0s"\n[classes.default]\nattr_timeout = "2s"\n')
    d = p.class_by_name("d")
    assert d is not None and (d.entry_timeout, d.attr_timeout) == (60.0, 0.0)
    assert parse_policy(p.render()) == p


def test_passthrough_is_auto_unless_set_and_the_older_reads_still_loads() -> None:
    """Every class passes reads through by default ("auto"), the embedded policy's too;
    "reads", the spelling of policies written before it was the default, loads and means
    the same; "off" opts out; each renders back to itself."""
    policy = parse_policy('[classes.a]\npaths = ["a/**"]\n[classes.b]\npaths = ["b/**"]\n'
                          'passthrough = "reads"\n[classes.c]\npaths = ["c/**"]\n'
                          'passthrough = "off"\n')
    assert [c.passthrough for c in policy.classes] == ["auto", "reads", "off", "auto"]
    assert [passthrough_blocker(policy, c) for c in policy.classes] == [
        None, None, 'passthrough = "off" keeps the class\'s reads in the daemon', None]
    assert parse_policy(policy.render()) == policy
    assert {c.passthrough for c in default_policy().classes} == {"auto"}
