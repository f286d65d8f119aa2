"""``qosfs check`` warnings: each one through the command line (file:line, exit 0, exit 6
under ``--strict``, ``--json``), the glob-cover relation against brute force, and none
on the policies qosfs ships."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest

from qosfs.core.errors import EXIT_POLICY
from qosfs.daemon.cli import main
from qosfs.plan.planner import PlanInputs, make_plan
from qosfs.plan.report import plan_policy_text
from qosfs.policy.globs import compile_glob, glob_covers
from qosfs.policy.lint import policy_warnings
from qosfs.policy.loading import parse_policy
from qosfs.policy.text import DEFAULT_POLICY_TEXT
from tests.mounting import ROOT


def check(capsys: pytest.CaptureFixture[str], path: Path, *flags: str) -> tuple[int, str, str]:
    code = main(["check", *flags, str(path)])
    out, err = capsys.readouterr()
    return code, out, err


# Each case: a policy, and the one warning it must give (line, key, message start).
CASES = {
    "shadowed-by-paths-and-ops": (
        '[classes.models]\npaths = ["**/*.pt", "runs/**"]\nops = ["read", "write"]\n\n'
        '[classes.ckpt]\npaths = ["runs/*/checkpoints/**", "**/step-*/*.pt"]\n'
        'ops = ["write"]\nwrite_bandwidth = "100MiB/s"\n',
        5, "classes.ckpt", "never matches: classes.models, earlier in the file, matches every "
        "request this class would (its paths and ops cover this class's)"),
    "shadowed-by-ids-tenants-and-jobs": (
        '[tenants.a]\nuids = ["1000-1999"]\n[tenants.b]\nuids = [5]\n\n'
        '[classes.wide]\nuids = ["0-999", "1000-1999"]\ntenants = ["a", "b"]\n'
        'job_env = "SLURM_JOB_ID"\njobs = ["1*"]\n'
        'cgroups = ["/slurm/**"]\n\n'
        '[classes.narrow]\nuids = ["900-1100"]\ntenants = ["a"]\njob_env = "SLURM_JOB_ID"\n'
        'jobs = ["12"]\ncgroups = ["/slurm/uid_1000/job_*/**"]\n',
        13, "classes.narrow", "never matches: classes.wide"),
    "shadowed-by-a-class-without-criteria": (
        '[classes.all]\nwrite_bandwidth = "1GiB/s"\n[classes.later]\nops = ["meta"]\n',
        3, "classes.later", "never matches: classes.all, earlier in the file, matches every "
        "request this class would (it has no criteria)"),
    "priority-without-backend": (
        '[classes.ckpt]\npaths = ["**/*.pt"]\npriority = "low"\n',
        3, "classes.ckpt.priority", 'priority "low" has no effect: priorities share out the '
        "caps declared in [backend] and decide which classes a latency target may cap, and "
        "there is no [backend] and no class has a latency target"),
    "priority-on-ops-the-backend-does-not-cap": (
        '[backend]\nwrite_bandwidth = "1GiB/s"\n'
        '[classes.data]\npaths = ["data/**"]\nops = ["read", "meta"]\npriority = 50\n',
        6, "classes.data.priority", 'priority "50" has no effect: priorities share out the '
        "caps declared in [backend] and decide which classes a latency target may cap, and "
        "the [backend] caps none of the ops this class takes (meta, read)"),
    "minimum-of-a-direction-the-class-never-takes": (
        '[backend]\nread_bandwidth = "1GiB/s"\n'
        '[classes.ckpt]\npaths = ["**/*.pt"]\nops = ["write"]\n'
        'min_read_bandwidth = "100MiB/s"\n',
        6, "classes.ckpt.min_read_bandwidth", "min_read_bandwidth has no effect: the class "
        'takes no reads (ops = ["write"])'),
    "passthrough-on-a-read-capped-class": (
        '[classes.data]\npaths = ["data/**"]\npassthrough = "reads"\n'
        'read_bandwidth = "1GiB/s"\n',
        3, "classes.data.passthrough", "the class caps its reads: those reads stay in the "
        "daemon, where the cap holds, and such opens are not passed through to the kernel"),
    "passthrough-under-a-backend-read-cap": (
        '[backend]\nread_bandwidth = "4GiB/s"\n'
        '[classes.data]\npaths = ["data/**"]\npassthrough = "reads"\n',
        5, "classes.data.passthrough", "[backend] caps reads, which every class shares by "
        "priority: those reads stay in the daemon"),
    "passthrough-with-a-read-capped-tenant": (
        '[tenants.t]\nuids = [1]\nread_iops = 100\n'
        '[classes.data]\npaths = ["data/**"]\npassthrough = "reads"\n',
        6, "classes.data.passthrough", "tenant t caps reads: opens charged to it stay in "
        "the daemon"),
    "passthrough-per-user": (
        '[classes.data]\npaths = ["data/**"]\nper_user = "fair"\npassthrough = "reads"\n',
        4, "classes.data.passthrough", 'per_user = "fair" shares the class\'s reads out per '
        "uid"),
    "passthrough-with-a-backend-measured-target": (
        '[classes.data]\npaths = ["data/**"]\npassthrough = "reads"\n'
        'target_read_latency = "5ms"\nlatency_measure = "backend"\n',
        3, "classes.data.passthrough", "its read latency target is measured on its own "
        'reads\' backing times (latency_measure = "backend"), which only the daemon sees: '
        "those reads stay in the daemon, and such opens are not passed through"),
    "passthrough-without-reads": (
        '[classes.data]\npaths = ["data/**"]\nops = ["write"]\npassthrough = "reads"\n',
        4, "classes.data.passthrough", "passthrough has no effect: the class takes no reads "
        '(ops = ["write"])'),
    "fractional-iops": (
        '[tenants.t]\nuids = [1]\nmeta_iops = 0.5\n[classes.c]\npaths = ["a/**"]\n'
        'write_iops = "2.5"\n',
        3, "tenants.t.meta_iops", '0.5 is not a whole number of operations per second '
        '(requests are whole operations); did you mean "0.5k"?'),
    "glob-of-one-component": (
        '[classes.ckpt]\npaths = [\n    "**/checkpoints/**",\n    "*.safetensors",\n]\n',
        4, "classes.ckpt.paths", '"*.safetensors" matches only names directly in the '
        "mount's root: globs are anchored there, not matched at any depth as in .gitignore; "
        '"**/*.safetensors" matches at any depth'),
    "glob-of-a-directory": (
        '[tenants.t]\nuids = [1]\npaths = ["teams/t/checkpoints"]\n',
        3, "tenants.t.paths", '"teams/t/checkpoints" matches the directory "checkpoints" '
        'itself, not the files written in it; "teams/t/checkpoints/**" matches both'),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_each_warning_is_reported_with_file_and_line(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, line, key, message = CASES[case]
    path = tmp_path / "p.toml"
    path.write_text(text)
    code, out, err = check(capsys, path)
    assert code == 0, err
    assert out.startswith("# qosfs policy, resolved from")  # still printed, still a policy
    first = err.splitlines()[0]
    assert first.startswith(f"qosfs: warning: {path}:{line}: {key}: {message}"), err
    code, out, err = check(capsys, path, "--strict")
    assert code == EXIT_POLICY and out == ""
    assert err.splitlines()[0].startswith(f"qosfs: error: {path}:{line}: {key}: {message}")
    assert re.fullmatch(rf"qosfs: {re.escape(str(path))}: \d+ warnings?, errors under "
                        r"--strict", err.splitlines()[-1]), err


def test_the_fractional_iops_case_warns_for_each_figure() -> None:
    text = CASES["fractional-iops"][0]
    warnings = policy_warnings(parse_policy(text, "p.toml"), text)
    assert [(w.kind, w.key, w.line) for w in warnings] == [
        ("fractional-iops", "tenants.t.meta_iops", 3),
        ("fractional-iops", "classes.c.write_iops", 6)]


@pytest.mark.parametrize("text", [
    # The later class is narrower in one criterion only where the earlier one has none:
    '[classes.a]\npaths = ["**/*.pt"]\n[classes.b]\nuids = [1]\n',
    # ... or where the earlier one is narrower:
    '[classes.a]\npaths = ["**/*.pt"]\nops = ["write"]\n[classes.b]\npaths = ["x/*.pt"]\n',
    '[classes.a]\npaths = ["*/*.pt"]\n[classes.b]\npaths = ["**/*.pt"]\n',
    '[classes.a]\npaths = ["**/*.pt"]\n[classes.b]\npaths = ["**/*.pth"]\n',
    '[classes.a]\npaths = ["a/*"]\n[classes.b]\npaths = ["a/**"]\n',
    '[classes.a]\nuids = ["1-10"]\n[classes.b]\nuids = ["5-11"]\n',
    '[classes.a]\njob_env = "J"\njobs = ["1*"]\n[classes.b]\njob_env = "J"\n',
    '[classes.a]\njob_env = "J"\n[classes.b]\njob_env = "K"\n',
    # Only two earlier classes together cover it: not claimed.
    '[classes.a]\nops = ["read"]\n[classes.b]\nops = ["write"]\n'
    '[classes.c]\nops = ["read", "write"]\n',
    # A class that takes streaming writers gets them whatever it matches.
    '[classes.a]\npaths = ["**"]\n[classes.b]\npaths = ["x/**"]\n'
    'detect_streaming_writes = "256MiB"\n',
    # A priority that a latency target reads.
    '[classes.a]\npaths = ["data/**"]\ntarget_read_latency = "5ms"\npriority = "high"\n'
    '[classes.b]\npaths = ["**/*.pt"]\npriority = "low"\n',
    '[classes.a]\npaths = ["**", "data/**/x"]\n',
    # Passthrough by default: a capped class simply stays in the daemon (a note says it),
    # and so does one that opts out or whose ops take no reads.
    '[classes.a]\npaths = ["a/**"]\nread_bandwidth = "1GiB/s"\n'
    '[classes.b]\npaths = ["b/**"]\npassthrough = "auto"\nper_user = "fair"\n'
    '[classes.c]\npaths = ["c/**"]\npassthrough = "off"\nread_iops = 10\n'
    '[classes.d]\npaths = ["d/**"]\nops = ["write"]\n',
])
def test_no_warning_where_none_can_be_proven(text: str) -> None:
    assert policy_warnings(parse_policy(text), text) == []


def test_check_notes_the_classes_whose_reads_stay_in_the_daemon_and_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Passing reads through is the default: `qosfs check` names, as notes (not warnings),
    each class that takes reads and keeps them in the daemon, with the reason; not a
    class that opts out itself, nor one that takes no reads."""
    path = tmp_path / "p.toml"
    path.write_text('[classes.capped]\npaths = ["a/**"]\nread_bandwidth = "1GiB/s"\n'
                    '[classes.seen]\npaths = ["s/**"]\ntarget_read_slowdown = 1.5\n'
                    'latency_measure = "backend"\n'
                    '[classes.canary]\npaths = ["c/**"]\ntarget_read_slowdown = 1.5\n'
                    '[classes.off]\npaths = ["o/**"]\npassthrough = "off"\n'
                    '[classes.ckpt]\npaths = ["**/*.pt"]\nops = ["write"]\n'
                    '[classes.default]\nper_user = "fair"\n')
    code, out, err = check(capsys, path, "--json")
    body = json.loads(out)
    assert code == 0 and body["warnings"] == [], err
    assert body["notes"] == [
        "classes.capped: its reads are served by the daemon, not passed through to the "
        "kernel: the class caps its reads",
        "classes.seen: its reads are served by the daemon, not passed through to the "
        "kernel: its read latency target is measured on its own reads' backing times "
        '(latency_measure = "backend"), which only the daemon sees',
        "classes.default: its reads are served by the daemon, not passed through to the "
        'kernel: per_user = "fair" shares the class\'s reads out per uid']
    code, out, _ = check(capsys, path)
    assert code == 0 and "# note: classes.capped: its reads are served by the daemon" in out


def test_the_policies_qosfs_ships_give_no_warning(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    planned = plan_policy_text(make_plan(PlanInputs(
        params=70e9, ranks=64, nodes=8, backend_write=20e9, reserve_read=8e9)))
    for name, text in [("default", DEFAULT_POLICY_TEXT), ("planned", planned),
                       ("systemd", (ROOT / "systemd" / "mnt-mlfs.toml").read_text())]:
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        code, _, err = check(capsys, path, "--strict")
        assert code == 0 and err == "", (name, err)


def test_check_json_carries_policy_warnings_and_notes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, line, key, message = CASES["shadowed-by-paths-and-ops"]
    path = tmp_path / "p.toml"
    path.write_text(text + '[classes.jobs]\njob_env = "SLURM_JOB_ID"\njobs = ["1"]\n')
    code, out, _ = check(capsys, path, "--json")
    body = json.loads(out)
    assert code == 0 and body["ok"] is True and body["source"] == str(path)
    assert parse_policy(_toml(body["policy"])) == parse_policy(path.read_text())
    [warning] = body["warnings"]
    assert warning["kind"] == "shadowed" and warning["line"] == line
    assert warning["key"] == key and warning["message"].startswith(message)
    assert warning["source"] == str(path)
    assert len(body["notes"]) == 1 and "SLURM_JOB_ID" in body["notes"][0]
    code, out, _ = check(capsys, path, "--json", "--strict")
    assert code == EXIT_POLICY and json.loads(out)["ok"] is False


def test_check_json_of_an_invalid_policy_names_file_line_and_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[classes.x]\npaths = ["a/**"]\nwrite_bandwidth = "fast"\n')
    code, out, err = check(capsys, path, "--json")
    assert code == EXIT_POLICY
    error = json.loads(out)["error"]
    assert (error["source"], error["line"], error["key"]) == (
        str(path), 3, "classes.x.write_bandwidth")
    assert error["reason"].startswith("expected a bandwidth like")
    assert err == f"qosfs: {error['message']}\n"  # the one line as without --json


def _toml(raw: dict[str, Any]) -> str:
    from qosfs.policy.text import dump_toml

    return dump_toml(raw, "json")


# --------------------------------------------------------------- covering, by brute force

COMPONENTS = ["**", "*", "a", "*.pt", "x.pt", "[ab]"]
NAMES = ["a", "b", "x.pt", "c.pt"]
GLOBS = ["/".join(p) for n in (1, 2, 3) for p in itertools.product(COMPONENTS, repeat=n)]
PATHS = ["/".join(p) for n in (1, 2, 3, 4) for p in itertools.product(NAMES, repeat=n)]


def test_glob_covers_is_sound() -> None:
    """Whenever it says "covers", every path the inner glob matches, the outer matches."""
    matched = {g: {p for p in PATHS if compile_glob(g).fullmatch(p)} for g in GLOBS}
    claimed = 0
    for outer, inner in itertools.product(GLOBS, repeat=2):
        if glob_covers(outer, inner):
            claimed += 1
            assert matched[inner] <= matched[outer], (outer, inner)
    assert claimed > 2000  # and it proves a good share of what holds


@pytest.mark.parametrize(("outer", "inner"), [
    ("**/*.pt", "runs/*/model.pt"), ("**/checkpoints/**", "a/checkpoints/*.pt"),
    ("data/**", "data"), ("data/**", "data/x/**"), ("**", "a"), ("**/*.pt", "x.pt"),
    ("*/**", "a/b"), ("/slurm/**", "/slurm/job_*/**"),
])
def test_glob_covers_what_it_should(outer: str, inner: str) -> None:
    absolute = outer.startswith("/")
    assert glob_covers(outer, inner, absolute=absolute)
