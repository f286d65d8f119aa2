"""qosfs plan: the arithmetic against hand-computed cases, every impossible plan, the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qosfs.core.errors import EXIT_PLAN
from qosfs.daemon.cli import main
from qosfs.plan.planner import PlanError, PlanInputs, make_plan, parse_params
from qosfs.plan.report import plan_policy_text, render_plan
from qosfs.policy.loading import load_policy, parse_policy

GB = 1e9
# The administrator's example: 70B, AdamW, bf16, 512 ranks on 64 nodes, storage 20 GB/s,
# dataset reads need 8 GB/s, a checkpoint every 30 minutes.
EXAMPLE = PlanInputs(params=70e9, ranks=512, nodes=64, interval=1800.0,
                     backend_write=20 * GB, reserve_read=8 * GB)


def _replace(**changes: object) -> PlanInputs:
    fields = {name: getattr(EXAMPLE, name) for name in PlanInputs.__dataclass_fields__}
    return PlanInputs(**{**fields, **changes})  # type: ignore[arg-type]


def _fails(message: str, **changes: object) -> None:
    with pytest.raises(PlanError, match=f"^{re.escape(message)}$"):
        make_plan(_replace(**changes))


@pytest.mark.parametrize(("text", "count"), [
    ("70B", 70e9), ("7b", 7e9), ("1T", 1e12), ("175M", 175e6), ("1.5B", 1.5e9),
    ("125k", 125e3), ("7000000000", 7e9), (" 70 B ", 70e9),
])
def test_parse_params(text: str, count: float) -> None:
    assert parse_params(text) == count


@pytest.mark.parametrize("text", ["70x", "B", "", "-7B", "70GB", "1e9", "7 billion"])
def test_parse_params_rejects(text: str) -> None:
    with pytest.raises(PlanError, match=r'^--params: expected a parameter count like "70B"'):
        parse_params(text)


@pytest.mark.parametrize("text", ["0", "0.5", "2000T"])
def test_parse_params_range(text: str) -> None:
    message = f'--params: expected 1 to 1000T parameters, got "{text}"'
    with pytest.raises(PlanError, match=f"^{re.escape(message)}$"):
        parse_params(text)


@pytest.mark.parametrize(("changes", "bpp"), [
    ({}, 6),  # bf16 weights + 2 bf16 moments: 3 x 2
    ({"optimizer": "sgd"}, 4),  # weights + momentum
    ({"optimizer": "none"}, 2),
    ({"dtype": "fp32"}, 12),
    ({"dtype": "fp16", "optimizer": "adam"}, 6),
    ({"state": "mixed"}, 14),  # 2 + 4 master + 2 x 4 moments
    ({"state": "mixed", "optimizer": "sgd"}, 10),
    ({"state": "mixed", "optimizer": "none"}, 6),
    ({"bytes_per_param": 16.0, "state": "mixed", "dtype": "fp32"}, 16),  # the override wins
])
def test_bytes_per_param(changes: dict[str, object], bpp: float) -> None:
    plan = make_plan(PlanInputs(params=1e9, **changes))  # type: ignore[arg-type]
    assert plan.bytes_per_param == bpp
    assert plan.checkpoint_bytes == bpp * 1e9


@pytest.mark.parametrize(("params", "size"), [
    (7e9, 42 * GB), (70e9, 420 * GB), (1e12, 6000 * GB), (1.5e9, 9 * GB),
])
def test_checkpoint_size_matches_the_usual_write_ups(params: float, size: float) -> None:
    assert make_plan(PlanInputs(params=params)).checkpoint_bytes == size


def test_shard_and_replicas() -> None:
    plan = make_plan(EXAMPLE)
    assert plan.written_bytes == 420 * GB
    assert plan.shard_bytes == 420 * GB / 512 == 820.3125e6
    two = make_plan(PlanInputs(params=7e9, ranks=8, replicas=2))
    assert (two.checkpoint_bytes, two.written_bytes, two.shard_bytes) == (42 * GB, 84 * GB,
                                                                          10.5 * GB)


def test_no_backend_gives_sizes_only() -> None:
    plan = make_plan(PlanInputs(params=7e9))
    assert plan.timing is None
    assert "give --backend-write for write times and a cap" in render_plan(plan)


def test_synchronous_example() -> None:
    t = make_plan(EXAMPLE).timing
    assert t is not None
    assert t.full_rate == 16 * GB  # 20 GB/s x 0.8
    assert t.full_seconds == pytest.approx(26.25)  # 420 GB / 16 GB/s
    assert t.highest_cap == pytest.approx(9.6 * GB)  # 20 x (1 - 8/20) x 0.8
    assert t.cap == t.highest_cap  # synchronous: the shortest stall that keeps the reserve
    assert t.cap_per_mount == 150e6  # 9.6 GB/s / 64
    assert t.cap_seconds == pytest.approx(43.75)
    assert t.cap_seconds / EXAMPLE.interval == pytest.approx(0.0243, abs=1e-4)


def test_separate_read_bandwidth_takes_the_same_fraction_of_writes() -> None:
    t = make_plan(_replace(backend_read=40 * GB)).timing
    assert t is not None
    assert t.cap == pytest.approx(12.8 * GB)  # 20 x (1 - 8/40) x 0.8


def test_no_reserve_and_other_efficiency() -> None:
    t = make_plan(_replace(reserve_read=None, efficiency=0.5, nodes=1)).timing
    assert t is not None
    assert (t.full_rate, t.cap, t.cap_seconds) == (10 * GB, 10 * GB, 42.0)


def test_asynchronous_cap_is_the_lowest_that_meets_the_target() -> None:
    one = make_plan(_replace(asynchronous=True, nodes=1)).timing
    assert one is not None
    # 420 GB in half of 30 min needs 466.67 MB/s; rounded up to 3 digits
    assert one.cap == 467e6 and one.target_met
    assert one.cap_seconds == pytest.approx(420e9 / 467e6)
    many = make_plan(_replace(asynchronous=True)).timing
    assert many is not None
    assert many.cap_per_mount == 7.3e6  # 7.29 MB/s per mount, rounded up
    assert many.cap == pytest.approx(467.2e6)
    quarter = make_plan(_replace(asynchronous=True, nodes=1, target_share=0.25)).timing
    assert quarter is not None and quarter.cap == 934e6  # 933.3 MB/s rounded up


def test_asynchronous_target_out_of_reach_falls_back_to_the_highest_cap() -> None:
    plan = make_plan(_replace(asynchronous=True, target_share=0.01))
    assert plan.timing is not None
    assert plan.timing.cap == pytest.approx(9.6 * GB) and not plan.timing.target_met
    assert "note: even the highest cap takes 2.43% of the interval, above the 1% target" in (
        render_plan(plan))


def test_caps_are_rounded_down_per_mount() -> None:
    t = make_plan(PlanInputs(params=7e9, ranks=3, nodes=3, backend_write=7 * GB)).timing
    assert t is not None
    assert t.cap_per_mount == 1.86e9  # 5.6 GB/s / 3 = 1.8667 GB/s
    assert t.cap == pytest.approx(5.58e9)


def test_max_stall_that_holds() -> None:
    t = make_plan(_replace(max_stall=60.0)).timing
    assert t is not None and t.cap_seconds <= 60


# ------------------------------------------------------------------ impossible plans

def test_reserve_above_the_backend() -> None:
    _fails("--reserve-read 25GB/s exceeds the backend's read bandwidth 20GB/s by 5 GB/s "
           "(no --backend-read: reads share --backend-write)", reserve_read=25 * GB)
    _fails("--reserve-read 50GB/s exceeds the backend's read bandwidth 40GB/s by 10 GB/s",
           reserve_read=50 * GB, backend_read=40 * GB)


def test_reserve_equal_to_the_backend() -> None:
    _fails("--reserve-read 20GB/s is all of the backend's read bandwidth (no --backend-read: "
           "reads share --backend-write), leaving nothing for checkpoints",
           reserve_read=20 * GB)


def test_interval_too_short_even_at_full_bandwidth() -> None:
    _fails("a 420 GB checkpoint cannot finish within the 10 s interval even at full bandwidth: "
           "at 16 GB/s (20GB/s x efficiency 0.8) it takes 26.2 s, 16.2 s too long; it needs "
           "52.5 GB/s of backend write bandwidth or an --interval of at least 26.2 s",
           interval=10.0)
    _fails("a 6 TB checkpoint cannot finish within the 5 min interval even at full bandwidth: "
           "at 16 GB/s (20GB/s x efficiency 0.8) it takes 6.25 min, 75 s too long; it "
           "needs 25 GB/s of backend write bandwidth or an --interval of at least 6.25 min",
           params=1e12, interval=300.0, asynchronous=True)


def test_interval_too_short_with_the_reserve() -> None:
    # 420 GB at 20 x (1 - 19/20) x 0.8 = 0.8 GB/s takes 525 s; 420 GB in 120 s needs
    # 3.5 GB/s = 20 x (1 - R/20) x 0.8, so R <= 15.625 GB/s
    _fails("a 420 GB checkpoint cannot finish within the 2 min interval while 19GB/s is "
           "reserved for reads: at the highest cap that keeps the reserve, 800 MB/s, it takes "
           "8.75 min, 6.75 min too long; reserve at most 15.6 GB/s or lengthen --interval",
           reserve_read=19 * GB, interval=120.0)


def test_interval_missed_only_by_rounding_the_cap_down() -> None:
    # 42 GB at 7 GB/s x 0.8 = 5.6 GB/s takes 7.5 s; per mount 1.8667 GB/s is rounded down to
    # 1.86 GB/s, 5.58 GB/s over 3 mounts, which takes 7.5269 s
    with pytest.raises(PlanError, match=re.escape(
            "a 42 GB checkpoint cannot finish within the 7.51 s interval at the highest cap, "
            "5.58 GB/s (rounded down): it takes 7.53 s, 0.0169 s too long; lengthen "
            "--interval")):
        make_plan(PlanInputs(params=7e9, ranks=3, nodes=3, backend_write=7 * GB,
                             interval=7.51))


def test_stall_above_max_stall() -> None:
    _fails("a synchronous 420 GB checkpoint stalls training for 43.8 s at the highest cap that "
           "keeps the read reserve, 9.6 GB/s: 13.8 s over --max-stall 30 s; it needs 14 GB/s "
           "for checkpoints (or use --async)", max_stall=30.0)
    _fails("a synchronous 420 GB checkpoint stalls training for 26.2 s at the highest cap, "
           "16 GB/s: 6.25 s over --max-stall 20 s; it needs 21 GB/s for checkpoints (or use "
           "--async)", max_stall=20.0, reserve_read=None, nodes=1)


@pytest.mark.parametrize(("changes", "message"), [
    ({"ranks": 0}, "--ranks: expected at least 1, got 0"),
    ({"nodes": 0}, "--nodes: expected at least 1, got 0"),
    ({"replicas": 0}, "--replicas: expected at least 1, got 0"),
    ({"nodes": 3}, "--nodes 3 does not divide --ranks 512: the plan assumes every mount "
                   "writes the same number of shards"),
    ({"efficiency": 0.0}, "--efficiency: expected a fraction above 0 and at most 1, got 0"),
    ({"efficiency": 1.5}, "--efficiency: expected a fraction above 0 and at most 1, got 1.5"),
    ({"efficiency": float("nan")},
     "--efficiency: expected a fraction above 0 and at most 1, got nan"),
    ({"asynchronous": True, "target_share": 2.0},
     "--target-share: expected a fraction above 0 and at most 1, got 2"),
    ({"bytes_per_param": -1.0}, "--bytes-per-param: expected a number above 0, got -1"),
    ({"bytes_per_param": float("inf")}, "--bytes-per-param: expected a number above 0, got inf"),
    ({"state": "mixed", "dtype": "fp32"},
     "--state mixed needs a 16-bit --dtype (bf16 or fp16): fp32 weights are their own master "
     "copy, use --state simple"),
    ({"dtype": "int8"}, '--dtype: expected one of bf16, fp16, fp32, got "int8"'),
    ({"asynchronous": True, "max_stall": 60.0},
     "--max-stall applies to synchronous checkpoints; an asynchronous one stalls training "
     "only for its snapshot (drop --async or --max-stall)"),
    ({"target_share": 0.5}, "--target-share applies to asynchronous checkpoints (add --async)"),
    ({"backend_write": None}, "--reserve-read needs --backend-write: every time and cap "
                              "starts from the storage's write bandwidth"),
    ({"backend_write": None, "reserve_read": None, "max_stall": 1.0},
     "--max-stall needs --backend-write: every time and cap starts from the storage's write "
     "bandwidth"),
])
def test_bad_inputs(changes: dict[str, object], message: str) -> None:
    _fails(message, **changes)


def test_policy_needs_a_backend() -> None:
    with pytest.raises(PlanError, match="^--policy-out needs --backend-write: the caps start "  # noqa: RUF043
                                        "from it$"):
        plan_policy_text(make_plan(PlanInputs(params=7e9)))


# -------------------------------------------------------------------------- policy

def test_policy_holds_the_per_mount_figures() -> None:
    policy = parse_policy(plan_policy_text(make_plan(EXAMPLE)))
    assert [c.name for c in policy.classes] == ["checkpoints", "datasets", "default"]
    checkpoints, datasets = policy.classes[0], policy.classes[1]
    assert checkpoints.limits.write_bandwidth == 150e6
    assert "**/checkpoints/**" in checkpoints.paths
    assert datasets.priority_name == "high"
    assert datasets.min_read_bandwidth == 125e6  # 8 GB/s / 64
    assert policy.backend is not None
    assert policy.backend.limits.write_bandwidth == 312e6  # 20 GB/s / 64, rounded down
    assert policy.backend.limits.read_bandwidth == 312e6  # one pipe
    assert policy.classes[2].limits.is_unlimited


def test_policy_without_reserve_has_no_guarantee() -> None:
    policy = parse_policy(plan_policy_text(make_plan(_replace(reserve_read=None))))
    assert policy.classes[1].min_read_bandwidth is None
    assert policy.classes[0].limits.write_bandwidth == 250e6  # 16 GB/s / 64


# ----------------------------------------------------------------------------- CLI

EXAMPLE_ARGS = ["plan", "--params", "70B", "--ranks", "512", "--nodes", "64",
                "--backend-write", "20GB/s", "--reserve-read", "8GB/s", "--interval", "30m"]


def test_cli_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(EXAMPLE_ARGS) == 0
    out = capsys.readouterr().out
    for line in [
        "qosfs plan: 70B parameters, 512 ranks on 64 mounts, a synchronous checkpoint every "
        "30 min",
        "checkpoint size      420 GB   6 bytes/param (--state simple): bf16 weights + 2 AdamW",
        "per-rank shard       820 MB   420 GB / 512 ranks",
        "full bandwidth        16 GB/s       26.2 s               1.46%",
        "recommended cap      9.6 GB/s       43.8 s               2.43%",
        "training stalls 43.8 s per checkpoint (synchronous)",
        'checkpoints class: write_bandwidth = "150MB/s" per mount (9.6 GB/s over 64 mounts)',
        "dataset reads keep 8 GB/s of the backend's 20 GB/s (--reserve-read)",
    ]:
        assert line in out


def test_cli_json_has_the_figures_of_the_report(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "plan.toml"
    assert main([*EXAMPLE_ARGS, "--json", "--policy-out", str(out_file)]) == 0
    body = json.loads(capsys.readouterr().out)  # nothing but the JSON on stdout
    assert body["summary"] == ("70B parameters, 512 ranks on 64 mounts, a synchronous "
                               "checkpoint every 30 min")
    assert body["inputs"]["params"] == 70e9 and body["inputs"]["reserve_read"] == 8 * GB
    assert body["checkpoint_bytes"] == 420 * GB and body["shard_bytes"] == 420 * GB / 512
    timing = body["timing"]
    assert timing["cap"] == 9.6 * GB and timing["cap_per_mount"] == 150e6
    assert round(timing["cap_seconds"], 1) == 43.8
    assert body["checkpoints_write_bandwidth"] == "150MB/s"
    assert any("--efficiency 0.8" in a for a in body["assumptions"])
    assert body["policy_out"] == str(out_file)
    rule = load_policy(out_file).class_by_name("checkpoints")
    assert rule is not None and rule.limits.write_bandwidth == 150e6


def test_cli_json_without_a_backend_has_sizes_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "7B", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["checkpoint_bytes"] == 42 * GB
    assert body["timing"] is None and body["checkpoints_write_bandwidth"] is None


def test_cli_writes_a_policy_that_loads(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.toml"
    assert main([*EXAMPLE_ARGS, "--async", "--policy-out", str(out)]) == 0
    assert f"policy written to {out}" in capsys.readouterr().out
    policy = load_policy(out)
    checkpoints = policy.class_by_name("checkpoints")
    assert checkpoints is not None and checkpoints.limits.write_bandwidth == 7.3e6
    assert main(["check", str(out)]) == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--reserve-read", "25GB/s"], "qosfs: --reserve-read 25GB/s exceeds the backend's read "
                                   "bandwidth 20GB/s by 5 GB/s"),
    (["--interval", "30"], 'qosfs: --interval: expected a time like "30m", "1.5h" or "60s", '
                           'got "30"'),
    (["--backend-write", "20GB"], 'qosfs: --backend-write: expected a bandwidth like '
                                  '"400MiB/s", got "20GB"'),
    (["--max-stall", "30s"], "qosfs: a synchronous 420 GB checkpoint stalls training for "
                             "43.8 s"),
    (["--params", "70x"], 'qosfs: --params: expected a parameter count like "70B"'),
])
def test_cli_errors_are_one_line_with_the_plan_exit_code(
        args: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never.toml"
    assert main([*EXAMPLE_ARGS, *args, "--policy-out", str(out)]) == EXIT_PLAN == 9
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(message) and captured.err.count("\n") == 1
    assert not out.exists()


def test_cli_unwritable_policy_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "missing" / "plan.toml"
    assert main([*EXAMPLE_ARGS, "--policy-out", str(target)]) == EXIT_PLAN
    assert capsys.readouterr().err == (f"qosfs: --policy-out: cannot write {target}: "
                                       "No such file or directory\n")
