"""bench/suites/training/ without DLIO: its configuration writer, the parsing of DLIO's output
(on a saved sample), the storm's records, the planner comparison and the report rows.

tests/bench/data/dlio-sample/ is the output folder of a real one-epoch DLIO 2.0.0 run
(pytorch data loader, 32 npz files of 4 MiB, batch 2, 0.3 s compute per batch, through
a qosfs mount); tests/bench/data/storm/ holds the records of a real 2-rank
bench.suites.training.ckpt_storm run (32 MiB shards, four rounds: torch/dcp, sync/async).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.core.system import BenchError
from bench.suites.training import workload
from bench.suites.training.au_report import TrainingResult, headline, section
from bench.suites.training.ckpt_storm import WAYS, parse_args, read_records, should_stop

DATA = Path(__file__).parent / "data"
MiB = 1 << 20


def test_dlio_summary_and_epoch_stats_are_parsed() -> None:
    fig = workload.parse_dlio_output(DATA / "dlio-sample", 4 * MiB)
    assert fig["au_pct"] == [pytest.approx(98.76665490497386)]
    assert fig["samples_per_s"] == [pytest.approx(6.5286845251408225)]
    # DLIO's own "MB/second" is samples/s x record length / 2^20: the same figure
    summary = json.loads((DATA / "dlio-sample" / "summary.json").read_text())
    assert fig["read_mib_s"] == [pytest.approx(summary["metric"]["train_io_mean_MB_per_second"])]
    assert fig["epoch_s"] == [4.91]
    assert fig["accelerators"] == 1
    assert fig["au_expectation"] == "success"


def test_several_epochs_keep_their_order(tmp_path: Path) -> None:
    summary = json.loads((DATA / "dlio-sample" / "summary.json").read_text())
    summary["metric"]["train_au_percentage"] = [91.0, 85.5, 97.25]
    summary["metric"]["train_throughput_samples_per_second"] = [10.0, 9.0, 11.0]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    stats = {str(e): {"start": "x", "end": "y", "duration": d}
             for e, d in ((10, "3.00"), (2, "2.00"), (1, "1.00"))}
    (tmp_path / "per_epoch_stats.json").write_text(json.dumps(stats))
    fig = workload.parse_dlio_output(tmp_path, MiB)
    assert fig["au_pct"] == [91.0, 85.5, 97.25]
    assert fig["read_mib_s"] == [10.0, 9.0, 11.0]
    assert fig["epoch_s"] == [1.0, 2.0, 3.0]  # epoch 10 after epoch 2


def test_workload_config_is_what_dlio_reads(tmp_path: Path) -> None:
    shape = workload.SHAPES["unet3d"]
    cfg = workload.workload_config(shape, data_folder="/m/data/unet3d",
                                   output_folder="/w/out", files=40, seed=3)
    path = workload.write_workload(tmp_path, "unet3d-x", cfg)
    assert path == tmp_path / "workload" / "unet3d-x.yaml"  # Hydra's group/name.yaml
    loaded = yaml.safe_load(path.read_text())
    assert loaded == cfg
    assert loaded["framework"] == "pytorch"
    assert loaded["workflow"] == {"generate_data": False, "train": True, "checkpoint": False}
    assert loaded["dataset"] == {"data_folder": "/m/data/unet3d", "format": "npz",
                                 "num_files_train": 40, "num_samples_per_file": 1,
                                 "record_length": 16 * MiB}
    assert loaded["reader"]["data_loader"] == "pytorch"
    assert loaded["reader"]["batch_size"] == shape.batch_size
    assert loaded["train"] == {"epochs": 1, "computation_time": shape.computation_time,
                               "seed": 3}
    assert loaded["metric"]["au"] == pytest.approx(0.9)
    assert loaded["output"]["folder"] == "/w/out"
    gen = workload.workload_config(shape, data_folder="d", output_folder="o", files=4,
                                   generate=True)
    assert gen["workflow"] == {"generate_data": True, "train": False, "checkpoint": False}


def test_shapes_fit_the_machine() -> None:
    for shape in workload.SHAPES.values():
        demand = shape.batch_size * shape.record_length / shape.computation_time
        # what one accelerator asks of the mount, bytes/s: a mount on this machine serves
        # about 240 MiB/s of 16 MiB npz samples at 95% AU (measured, bench/ANALYSIS.md)
        assert demand <= 256 * MiB
        assert shape.files_quick <= shape.files
        steps = shape.files_quick // shape.batch_size
        assert steps >= 8  # DLIO's AU leaves out the first step of an epoch


def test_storm_records_make_rounds() -> None:
    records = read_records(DATA / "storm")
    assert [(r["round"], r["rank"]) for r in records] == [(n, k) for n in range(4)
                                                           for k in range(2)]
    rounds = workload.rounds_of(records)
    assert [(r["kind"], r["mode"]) for r in rounds] == list(WAYS)
    first = rounds[0]
    pair = [r for r in records if r["round"] == 0]
    assert first["bytes"] == sum(r["bytes"] for r in pair)
    assert first["duration_s"] == pytest.approx(max(r["end"] for r in pair)
                                                - min(r["start"] for r in pair))
    assert first["blocked_s"] == max(r["blocked_s"] for r in pair)
    assert all(r["ranks"] == 2 and not r["errors"] for r in rounds)
    # an asynchronous save blocks its step for the staging only, and its write time
    # starts after the staging: what the planner's T is compared with
    for r in rounds:
        recs = [x for x in records if x["round"] == r["round"]]
        if r["mode"] == "async":
            assert r["blocked_s"] < r["duration_s"]
            assert r["write_s"] == pytest.approx(
                r["end"] - min(x["start"] + x["blocked_s"] for x in recs))
            assert r["write_s"] < r["duration_s"]
        else:
            assert r["write_s"] == pytest.approx(r["duration_s"])


def test_the_storm_stops_when_the_bench_that_started_it_is_gone(tmp_path: Path) -> None:
    finished = subprocess.Popen(["true"])  # reaped below: its pid names no process
    finished.wait()
    base = [str(tmp_path / "ckpt"), "--records", str(tmp_path), "--stop",
            str(tmp_path / "stop")]
    now = time.monotonic()
    assert not should_stop(parse_args(base), now)
    assert not should_stop(parse_args([*base, "--parent", str(os.getpid())]), now)
    assert should_stop(parse_args([*base, "--parent", str(finished.pid)]), now)
    (tmp_path / "stop").touch()
    assert should_stop(parse_args(base), now)


def test_a_round_a_rank_did_not_finish_is_left_out() -> None:
    recs = [{"round": 0, "rank": 0, "kind": "torch", "mode": "sync", "start": 0.0,
             "end": 1.0, "blocked_s": 1.0, "bytes": 5},
            {"round": 0, "rank": 1, "kind": "torch", "mode": "sync", "start": 0.0,
             "blocked_s": 0.0}]
    assert workload.rounds_of(recs) == []


def test_planner_prediction_is_size_over_cap() -> None:
    cap = 400.0 * MiB
    # the planner rounds caps down to 3 significant digits (419 MB/s): 0.1% slower
    assert workload.planned_seconds(800 * MiB, cap) == pytest.approx(2.0, rel=2e-3)
    assert workload.planned_seconds(800 * MiB, cap, replicas=2) == \
        pytest.approx(4.0, rel=2e-3)
    rounds = [{"round": 0, "kind": "dcp", "mode": "sync", "bytes": 800 * MiB,
               "duration_s": 2.2},
              {"round": 1, "kind": "torch", "mode": "async", "bytes": 400 * MiB,
               "duration_s": 0.9},
              {"round": 2, "kind": "torch", "mode": "sync", "bytes": 0, "duration_s": 0.1}]
    check = workload.plan_check(rounds, cap)
    assert [c["way"] for c in check] == ["dcp/sync", "torch/async"]  # nothing written: out
    assert check[0]["error_pct"] == pytest.approx(10.0, abs=0.3)
    assert check[1]["error_pct"] == pytest.approx(-10.0, abs=0.3)


def test_cap_in_force_is_the_controllers_when_lower() -> None:
    cap = 400.0 * MiB
    assert workload.cap_in_force({"latency_control": None}, cap) == cap  # no targets
    status = {"latency_control": {"throttled": [
        {"class": "default", "read_bandwidth": None, "write_bandwidth": 5.0 * MiB},
        {"class": "checkpoints", "read_bandwidth": None, "write_bandwidth": 50.0 * MiB}]}}
    assert workload.cap_in_force(status, cap) == 50.0 * MiB
    status["latency_control"]["throttled"][1]["write_bandwidth"] = None  # reads only
    assert workload.cap_in_force(status, cap) == cap


def test_mean_cap_weighs_each_sample_until_the_next() -> None:
    samples = [(10.0, 400.0), (12.0, 100.0), (14.0, 200.0)]
    assert workload.mean_cap(samples, 10.0, 12.0) == pytest.approx(400.0)
    assert workload.mean_cap(samples, 11.0, 13.0) == pytest.approx(250.0)
    assert workload.mean_cap(samples, 11.0, 16.0) == pytest.approx(
        (400.0 + 200.0 + 400.0) / 5)  # the last sample holds on
    assert workload.mean_cap(samples, 0.0, 10.0) == pytest.approx(400.0)  # first, before
    assert workload.mean_cap(samples, 12.0, 12.0) is None
    assert workload.mean_cap([], 0.0, 1.0) is None


def test_plan_check_against_the_cap_in_force() -> None:
    cap = 400.0 * MiB
    caps = [(100.0, cap), (101.0, 100.0 * MiB)]  # lowered a second into the round
    rounds = [{"round": 0, "kind": "torch", "mode": "sync", "bytes": 400 * MiB,
               "start": 100.0, "end": 105.0, "duration_s": 5.0}]
    (row,) = workload.plan_check(rounds, cap, caps)
    assert row["planned_s"] == pytest.approx(1.0, rel=2e-3)
    assert row["error_pct"] == pytest.approx(400.0, rel=1e-2)
    assert row["cap_in_force"] == pytest.approx((400 + 4 * 100) / 5 * MiB)
    assert row["planned_in_force_s"] == pytest.approx(2.5, rel=1e-2)  # 3 digits of MB/s
    assert row["error_in_force_pct"] == pytest.approx(100.0, rel=1e-2)
    (plain,) = workload.plan_check(rounds, cap)
    assert "cap_in_force" not in plain
    # an asynchronous round is judged on its write time, from the end of its staging
    staged = [{**rounds[0], "mode": "async", "write_start": 101.0, "write_s": 4.0}]
    (row,) = workload.plan_check(staged, cap, caps)
    assert row["measured_s"] == 4.0
    assert row["cap_in_force"] == pytest.approx(100.0 * MiB)
    assert workload.changes_of([(1.0, 5.0), (2.0, 5.0), (3.0, 7.0), (4.0, 7.0)]) == \
        [(1.0, 5.0), (3.0, 7.0)]


def test_scenario_policies_change_only_what_they_say() -> None:
    from qosfs.policy.loading import default_policy, parse_policy

    default = default_policy()
    latency = parse_policy(workload.policy_for("latency") or "")
    fixed = parse_policy(workload.policy_for("fixed") or "")
    assert workload.policy_for("default") is None and workload.policy_for("bare") is None
    datasets = latency.class_by_name("datasets")
    assert datasets is not None and datasets.target_read_latency == pytest.approx(0.020)
    assert datasets.target_read_slowdown is None
    assert workload.checkpoint_cap(workload.policy_for("latency")) == \
        workload.checkpoint_cap(None) == (400.0 * MiB, 64.0 * MiB)
    assert workload.checkpoint_cap(workload.policy_for("fixed")) == (128.0 * MiB, 64.0 * MiB)
    assert not any(c.latency_protected for c in fixed.classes)  # nothing moves the cap
    assert [c.name for c in fixed.classes] == [c.name for c in default.classes]


def test_skipped_cleanly_without_dlio(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *a: Any) -> Any:
        return None if name == "dlio_benchmark" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    why = workload.missing()
    assert why is not None and "DLIO is not installed" in why
    with pytest.raises(BenchError, match="DLIO is not installed"):
        workload.run(None)  # type: ignore[arg-type]  # refused before touching the Run


def _scenario(label: str, serve: str, storm: bool, au: list[float],
              plan: list[float] = (),  # type: ignore[assignment]
              in_force: list[float] = (),  # type: ignore[assignment]
              cap: float | None = None) -> dict[str, Any]:
    rows = []
    for i, e in enumerate(plan):
        row = {"round": i, "way": "torch/sync", "bytes": 768 * MiB, "measured_s": 2.0,
               "planned_s": 2.0 / (1 + e / 100), "error_pct": e}
        if i < len(in_force):
            row.update(cap_in_force=300.0 * MiB,
                       planned_in_force_s=2.0 / (1 + in_force[i] / 100),
                       error_in_force_pct=in_force[i])
        rows.append(row)
    return {"label": label, "serve": serve, "storm": storm, "au_pct": au,
            "read_mib_s": [100.0] * len(au), "epochs": [], "cap": cap, "burst": None,
            "rounds": [{"round": i, "kind": "torch", "mode": "sync", "ranks": 2,
                        "bytes": 768 * (1 << 20), "start": 10.0 * i, "end": 10.0 * i + 2.0,
                        "duration_s": 2.0, "blocked_s": 2.0}
                       for i in range(len(plan))] if storm else [],
            "plan": rows, "daemon_cpu_pct": None}


def figures() -> dict[str, Any]:
    """A training result as its JSON (what REPORT.json holds)."""
    shape = {"shape": {"name": "unet3d", "record_length": 16 * MiB, "files": 96,
                       "files_quick": 40, "batch_size": 4, "computation_time": 0.6,
                       "read_threads": 2},
             "files": 96, "area": "disk", "config": {"model": "unet3d"},
             "cap": 400.0 * MiB, "burst": 64.0 * MiB, "scenarios": [
                 _scenario("bare", "bare", False, [97.0, 96.0]),
                 _scenario("bare + storm", "bare", True, [60.0, 70.0], [0.0]),
                 _scenario("bare + running storm", "bare", True, [55.0, 68.0], [0.0]),
                 _scenario("no-qos", "no-qos", False, [96.0, 94.0]),
                 _scenario("no-qos + storm", "no-qos", True, [80.0, 82.0], [0.0]),
                 _scenario("default policy", "default", False, [95.0, 94.0]),
                 _scenario("default policy + storm", "default", True, [92.0, 93.0],
                           [-8.0, 40.0], [-8.0, 4.0], 400.0 * MiB),
                 _scenario("default policy + running storm", "default", True, [50.0, 91.0],
                           [0.0], [0.0], 400.0 * MiB),
                 _scenario("latency target + storm", "latency", True, [94.0], [25.0],
                           [25.0], 400.0 * MiB),
                 _scenario("fixed cap 128MiB/s + storm", "fixed", True, [95.0], [-3.0],
                           cap=128.0 * MiB)]}
    return {"shapes": {"unet3d": shape}, "storm": {"ranks": 2, "shard": 384 * MiB,
                                                   "interval": 8.0},
            "epochs": 2, "latency_target": "20ms", "versions": {"dlio_benchmark": "2.0.0"},
            "au_pass_pct": 90.0, "storm_keeps": 0.95, "plan_pct": 10.0}


def result() -> TrainingResult:
    return TrainingResult.from_json(figures())


def test_headline_states_each_figure_against_its_target() -> None:
    rows = {r[0]: r[1:] for r in headline(result())}
    assert rows["unet3d: AU, default policy + storm / --no-qos alone (92.5% / 95.0%)"] == \
        ["0.97×", "≥ 0.95×", "pass"]
    assert rows["unet3d: AU, default policy + storm vs the bare directory + storm"] == \
        ["92.5% vs 65.0%", "≥ bare", "pass"]
    assert rows["unet3d: AU under the storm with the default policy (alone 95.0%)"] == \
        ["92.5%", "≥ 90%", "pass"]
    assert rows["unet3d: AU through the mount alone, default policy / bare alone (94.5% / "
                "96.5%)"] == ["0.98×", "(for the record)", "—"]
    # the first epoch on its own: a mean over epochs would hide its 50% behind the 91%
    assert rows["unet3d: first epoch's AU in a storm already running, default policy vs "
                "the bare directory"] == ["50.0% vs 55.0%", "≥ bare", "**MISS** by 5.0 points"]
    assert rows["unet3d: AU under the storm without QoS (--no-qos)"] == \
        ["81.0%", "(contrast: 90%)", "fails by 9.0 points"]
    assert rows["unet3d: checkpoint duration vs `qosfs plan`, fixed cap, worst round"] \
        == ["-3.0%", "±10%", "pass"]
    # the automatic caps are judged on the cap in force (+40% against the configured one)
    assert rows["unet3d: checkpoint duration vs `qosfs plan`, default policy, for the cap "
                "in force, worst round"] == ["-8.0%", "±10%", "pass"]
    assert rows["unet3d: checkpoint duration vs `qosfs plan`, latency target, for the cap "
                "in force, worst round"] == ["+25.0%", "±10%", "**MISS**"]


def test_section_has_the_tables_and_the_configuration() -> None:
    text = "\n".join(section({"training": "report-training.png"}, result()))
    assert "![DLIO AU per scenario](report-training.png)" in text
    assert "| default policy + storm | 92.0% | 92.0, 93.0 | 92.5% | 100 MiB/s | 2 |" in text
    assert "| default policy + running storm | 50.0% | 50.0, 91.0 | 70.5% |" in text
    assert "| latency target + storm | 0 | torch/sync | 768 MiB | 2.00 s | 400 MiB/s | 1.60 s " \
        "| +25.0% | 300 MiB/s | 1.60 s | +25.0% |" in text
    assert "| fixed cap 128MiB/s + storm | 0 | torch/sync | 768 MiB | 2.00 s | 128 MiB/s " \
        "| 2.06 s | -3.0% | — | — | — |" in text
    assert '"model": "unet3d"' in text
    assert "Versions: dlio_benchmark 2.0.0" in text


def test_merge_puts_a_separate_run_first_and_says_so(tmp_path: Path) -> None:
    from bench.catalog import BY_NAME
    from bench.core.session import merge
    from tests.bench.test_report import fixture

    report = fixture()
    (tmp_path / "REPORT.json").write_text(json.dumps(report))
    machine = {**report["machine"], "date": "2026-02-02T00:00:00+00:00",
               "git_commit": "def5678"}
    part = {"stem": "training", "machine": machine, "elapsed_s": 900.0,
            "config": {**report["config"], "command": "python -m bench training"},
            "suites": {"training": {"result": figures(), "error": None,
                                    "elapsed_s": 880.0}}}
    (tmp_path / "training.json").write_text(json.dumps(part))
    md = merge(tmp_path / "training.json", tmp_path, BY_NAME)
    text = md.read_text()
    merged = json.loads((tmp_path / "REPORT.json").read_text())
    assert next(iter(merged["suites"])) == "training"
    assert set(merged["suites"]) == {"training", *report["suites"]}
    head = text[text.index("## Headline"):text.index("## 1.")]
    assert head.index("unet3d: AU") < head.index("pass-through cost")  # AU leads
    assert "commit **abc1234**" in text  # the report's own run stays on top
    assert "_Measured in its own run, not the one above: 2026-02-02T00:00:00+00:00, " \
        "qosfs commit **def5678**, full mode (`python -m bench training`)" in text
    assert "except the sections marked as measured in a run of their own" in text
    # merging it again replaces it rather than adding a second copy
    merge(tmp_path / "training.json", tmp_path, BY_NAME)
    assert md.read_text().count("## Training I/O") == 1
