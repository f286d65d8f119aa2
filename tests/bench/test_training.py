"""bench/training.py without DLIO: its configuration writer, the parsing of DLIO's output
(on a saved sample), the storm's records, the planner comparison and the report rows.

tests/bench/data/dlio-sample/ is the output folder of a real one-epoch DLIO 2.0.0 run
(pytorch data loader, 32 npz files of 4 MiB, batch 2, 0.3 s compute per batch, through
a qosfs mount); tests/bench/data/storm/ holds the records of a real 2-rank
bench.ckpt_storm run (32 MiB shards, four rounds: torch/dcp, sync/async).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench import training
from bench.ckpt_storm import WAYS, read_records
from bench.system import BenchError
from bench.training_report import headline, section

DATA = Path(__file__).parent / "data"
MiB = 1 << 20


def test_dlio_summary_and_epoch_stats_are_parsed() -> None:
    fig = training.parse_dlio_output(DATA / "dlio-sample", 4 * MiB)
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
    fig = training.parse_dlio_output(tmp_path, MiB)
    assert fig["au_pct"] == [91.0, 85.5, 97.25]
    assert fig["read_mib_s"] == [10.0, 9.0, 11.0]
    assert fig["epoch_s"] == [1.0, 2.0, 3.0]  # epoch 10 after epoch 2


def test_workload_config_is_what_dlio_reads(tmp_path: Path) -> None:
    shape = training.SHAPES["unet3d"]
    cfg = training.workload_config(shape, data_folder="/m/data/unet3d",
                                   output_folder="/w/out", files=40, seed=3)
    path = training.write_workload(tmp_path, "unet3d-x", cfg)
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
    gen = training.workload_config(shape, data_folder="d", output_folder="o", files=4,
                                   generate=True)
    assert gen["workflow"] == {"generate_data": True, "train": False, "checkpoint": False}


def test_shapes_fit_the_machine() -> None:
    for shape in training.SHAPES.values():
        demand = shape.batch_size * shape.record_length / shape.computation_time
        assert demand < 150 * MiB  # what one accelerator asks of the mount, bytes/s
        assert shape.files_quick <= shape.files
        steps = shape.files_quick // shape.batch_size
        assert steps >= 8  # DLIO's AU leaves out the first step of an epoch


def test_storm_records_make_rounds() -> None:
    records = read_records(DATA / "storm")
    assert [(r["round"], r["rank"]) for r in records] == [(n, k) for n in range(4)
                                                           for k in range(2)]
    rounds = training.rounds_of(records)
    assert [(r["kind"], r["mode"]) for r in rounds] == list(WAYS)
    first = rounds[0]
    pair = [r for r in records if r["round"] == 0]
    assert first["bytes"] == sum(r["bytes"] for r in pair)
    assert first["duration_s"] == pytest.approx(max(r["end"] for r in pair)
                                                - min(r["start"] for r in pair))
    assert first["blocked_s"] == max(r["blocked_s"] for r in pair)
    assert all(r["ranks"] == 2 and not r["errors"] for r in rounds)
    # an asynchronous save blocks its step for the staging only
    assert all(r["blocked_s"] < r["duration_s"] for r in rounds if r["mode"] == "async")


def test_a_round_a_rank_did_not_finish_is_left_out() -> None:
    recs = [{"round": 0, "rank": 0, "kind": "torch", "mode": "sync", "start": 0.0,
             "end": 1.0, "blocked_s": 1.0, "bytes": 5},
            {"round": 0, "rank": 1, "kind": "torch", "mode": "sync", "start": 0.0,
             "blocked_s": 0.0}]
    assert training.rounds_of(recs) == []


def test_planner_prediction_is_size_over_cap() -> None:
    cap = 400.0 * MiB
    # the planner rounds caps down to 3 significant digits (419 MB/s): 0.1% slower
    assert training.planned_seconds(800 * MiB, cap) == pytest.approx(2.0, rel=2e-3)
    assert training.planned_seconds(800 * MiB, cap, replicas=2) == \
        pytest.approx(4.0, rel=2e-3)
    rounds = [{"round": 0, "kind": "dcp", "mode": "sync", "bytes": 800 * MiB,
               "duration_s": 2.2},
              {"round": 1, "kind": "torch", "mode": "async", "bytes": 400 * MiB,
               "duration_s": 0.9},
              {"round": 2, "kind": "torch", "mode": "sync", "bytes": 0, "duration_s": 0.1}]
    check = training.plan_check(rounds, cap)
    assert [c["way"] for c in check] == ["dcp/sync", "torch/async"]  # nothing written: out
    assert check[0]["error_pct"] == pytest.approx(10.0, abs=0.3)
    assert check[1]["error_pct"] == pytest.approx(-10.0, abs=0.3)


def test_skipped_cleanly_without_dlio(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *a: Any) -> Any:
        return None if name == "dlio_benchmark" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    why = training.missing()
    assert why is not None and "DLIO is not installed" in why
    with pytest.raises(BenchError, match="DLIO is not installed"):
        training.run(None)  # type: ignore[arg-type]  # refused before touching the Run


def _scenario(label: str, serve: str, storm: bool, au: list[float],
              plan: list[float] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    return {"label": label, "serve": serve, "storm": storm, "au_pct": au,
            "read_mib_s": [100.0] * len(au), "epochs": [],
            "rounds": [{"round": i, "duration_s": 2.0, "blocked_s": 2.0}
                       for i in range(len(plan))] if storm else [],
            "plan": [{"round": i, "way": "torch/sync", "bytes": 768 * MiB,
                      "measured_s": 2.0, "planned_s": 2.0 / (1 + e / 100), "error_pct": e}
                     for i, e in enumerate(plan)]}


def result() -> dict[str, Any]:
    shape = {"shape": {"name": "unet3d", "record_length": 16 * MiB, "files": 96,
                       "files_quick": 40, "batch_size": 4, "computation_time": 0.6,
                       "read_threads": 2},
             "files": 96, "area": "disk", "config": {"model": "unet3d"},
             "cap": 400.0 * MiB, "burst": 64.0 * MiB, "scenarios": [
                 _scenario("bare", "bare", False, [97.0, 96.0]),
                 _scenario("bare + storm", "bare", True, [60.0, 70.0], [0.0]),
                 _scenario("no-qos", "no-qos", False, [96.0, 94.0]),
                 _scenario("no-qos + storm", "no-qos", True, [80.0, 82.0], [0.0]),
                 _scenario("default policy + storm", "default", True, [92.0, 93.0],
                           [-8.0, 4.0]),
                 _scenario("latency target + storm", "latency", True, [94.0], [25.0])]}
    return {"shapes": {"unet3d": shape}, "storm": {"ranks": 2, "shard": 384 * MiB,
                                                   "interval": 8.0},
            "epochs": 2, "latency_target": "20ms", "versions": {"dlio_benchmark": "2.0.0"},
            "au_pass_pct": 90.0, "storm_keeps": 0.95, "plan_pct": 10.0}


def test_headline_states_each_figure_against_its_target() -> None:
    rows = {r[0]: r[1:] for r in headline(result())}
    assert rows["unet3d: AU, default policy + storm / --no-qos alone (92.5% / 95.0%)"] == \
        ["0.97×", "≥ 0.95×", "pass"]
    assert rows["unet3d: AU, default policy + storm vs the bare directory + storm"] == \
        ["92.5% vs 65.0%", "≥ bare", "pass"]
    assert rows["unet3d: AU under the storm with the default policy (alone 95.0%)"] == \
        ["92.5%", "≥ 90%", "pass"]
    assert rows["unet3d: AU under the storm without QoS (--no-qos)"] == \
        ["81.0%", "(contrast: 90%)", "fails by 9.0 points"]
    assert rows["unet3d: checkpoint duration vs `qosfs plan`, default policy, worst round"] \
        == ["-8.0%", "±10%", "pass"]
    assert rows["unet3d: checkpoint duration vs `qosfs plan`, latency target, worst round"] \
        == ["+25.0%", "±10%", "**MISS**"]


def test_section_has_the_tables_and_the_configuration() -> None:
    doc = {"plots": {"training": "report-training.png"}}
    text = "\n".join(section(doc, result()))
    assert "![DLIO AU per scenario](report-training.png)" in text
    assert "| default policy + storm | 92.0, 93.0 | 92.5% | 100 MiB/s | 2 |" in text
    assert "| latency target + storm | 0 | torch/sync | 768 MiB | 2.00 s | 1.60 s | +25.0% " \
        "| 1.76 s |" in text
    assert '"model": "unet3d"' in text
    assert "Versions: dlio_benchmark 2.0.0" in text
