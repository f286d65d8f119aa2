"""bench/core/report.py: REPORT.md rendered from a fixture document, no measuring."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.catalog import BY_NAME
from bench.core.report import headline, render
from bench.core.session import write
from bench.suites import metadata
from bench.suites.metadata import MetadataResult

MiB = float(1 << 20)


def _side(value: float, **extra: Any) -> dict[str, Any]:
    return {"value": value, "reps": 3, "clat_p50_us": 50.0, "clat_p99_us": 120.0,
            "clat_p999_us": 300.0, "daemon_cpu_pct": 80.0, **extra}


def _row(key: str, label: str, metric: str, values: dict[str, float],
         sides_extra: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    nat = values["native"]
    sides = {k: _side(v, **(sides_extra or {}).get(k, {})) for k, v in values.items()}
    return {"key": key, "label": label, "group": key, "area": "tmpfs", "metric": metric,
            "target": None, "sides": sides, "error": None, "max_other_cpu_pct": 3.0,
            "ratio_to_native": {k: v / nat for k, v in values.items() if k != "native"},
            "machinery": values["policy"] / values["no-qos"]}


def fixture() -> dict[str, Any]:
    overhead = {"summary": [
        _row("dataset", "dataset reads", "bw",
             {"native": 4000 * MiB, "no-qos": 1000 * MiB, "policy": 980 * MiB}),
        _row("checkpoint", "checkpoint dump", "bw",
             {"native": 2000 * MiB, "no-qos": 500 * MiB, "policy": 450 * MiB})],
        "policy": "[classes.default]"}
    caps = {"runtime_s": 13, "policy": "[classes.capped]", "workloads": [{
        "key": "write_bandwidth", "label": "1 MiB writes", "demand": 400 * MiB, "levels": [
            {"level": "50MiB/s", "cap": 50 * MiB, "has_demand": True, "fio_rate": 51 * MiB,
             "windows": 11, "span_s": 11.0, "long_window_s": 10.0, "achieved": 50 * MiB,
             "worst_1s_pct": -3.0, "worst_long_pct": 0.4, "idle_windows": 0,
             "per_second": [50 * MiB] * 11},
            {"level": "800MiB/s", "cap": 800 * MiB, "has_demand": False,
             "fio_rate": 390 * MiB, "windows": 11, "span_s": 11.0, "long_window_s": 10.0,
             "achieved": 390 * MiB, "worst_1s_pct": -52.0, "worst_long_pct": -51.0,
             "idle_windows": 11, "per_second": [390 * MiB] * 11}]}]}
    reader = {"bw_bytes": 500 * MiB, "clat_p99_us": 900.0}

    def iso(scenario: str, tp: float, p99: float) -> dict[str, Any]:
        return {"scenario": scenario, "baseline": "solo", "reps": 2, "storm_bw": 100 * MiB,
                "bw_bytes": tp * 500 * MiB, "bw_bytes_ratio": tp, "clat_p50_us": 100.0,
                "clat_p50_us_ratio": 1.0, "clat_p99_us": p99 * 800, "clat_p99_us_ratio": p99,
                "clat_p999_us": 2000.0, "clat_p999_us_ratio": 1.0}

    isolation = {
        "headline_cap": "100MiB/s", "sweep": ["50MiB/s", "100MiB/s"], "policy": "[x]",
        "reader_env": {"NUMJOBS": "2", "NRFILES": "64", "RUNTIME": "10"},
        "storm_env": {"NUMJOBS": "4"},
        "write_cost": [{"cap": None, "storm_bw": 800 * MiB, "daemon_cpu_pct": 45.0,
                        "daemon_ms_per_mib": 0.55},
                       {"cap": "100MiB/s", "storm_bw": 100 * MiB, "daemon_cpu_pct": 20.0,
                        "daemon_ms_per_mib": 2.0}],
        "summary": [iso("solo no-qos", 1.0, 1.0), iso("storm no-qos", 0.4, 3.5),
                    iso("solo policy", 1.0, 1.0), iso("storm cap 50MiB/s", 0.95, 1.1),
                    iso("storm cap 100MiB/s", 0.85, 1.4)],
        "bursts": [{"cap": None, "reader": reader, "checkpoint": reader,
                    "reader_during": 200 * MiB, "reader_between": 500 * MiB, "series": {
            "datasets": [(0.0, 500 * MiB), (0.5, 200 * MiB), (1.0, 500 * MiB)],
            "checkpoints": [(0.0, 0.0), (0.5, 600 * MiB), (1.0, 0.0)]}}]}
    live = {"low": "1MiB/s", "high": "4GiB/s", "all_parked": True,
            "summary": {"set": {"median_delay_ms": 2.0, "max_delay_ms": 6.5, "n": 5}},
            "step": {"block": 262144, "bin_s": 0.1, "series": [(0.0, 50 * MiB)],
                     "changes": [{"at_s": 0.0, "from": "50MiB/s", "to": "200MiB/s",
                                  "settle_ms": 12.0},
                                 {"at_s": 3.0, "from": "200MiB/s", "to": "50MiB/s",
                                  "settle_ms": 40.0}]}}
    fair = {"cap": "150MiB/s", "phase_s": 4, "idle_after_s": 2.0, "policy": "[y]",
            "series": {}, "phases": [
        {"phase": 1, "active": [60001], "share": 150 * MiB,
         "achieved": {"60001": 149 * MiB}, "worst_pct": -0.7, "total": 149 * MiB},
        {"phase": 2, "active": [60001, 60002], "share": 75 * MiB,
         "achieved": {"60001": 80 * MiB, "60002": 70 * MiB}, "worst_pct": 6.7,
         "total": 150 * MiB}]}
    meta = {"nrfiles": 5000, "meta_cap": 2000, "policy": "[z]", "summary": [
        _row(k, k, "iops", {"native": 100e3, "no-qos": 5e3, "no-qos-2": 5.1e3,
                            "policy": 4.9e3, "meta-cap": 1.0e3})
        for k in ("create", "stat", "open", "unlink")],
        "in_process": {"files": 1000, "rounds": 7, "ops": {
            k: {"no_qos_us": 20.0, "policy_us": 24.0, "added_us": 4.0}
            for k in ("create", "stat", "open", "unlink")}}}
    prio = {"backend": "100MiB/s", "writers": 4, "runtime_s": 10, "policy": "[b]",
            "weights": {"high": 100, "low": 1}, "scenarios": [{"name": "weights only",
                                                               "low_min": None, "classes": [
                {"class": "high", "expected": 99 * MiB, "achieved": 97 * MiB,
                 "error_pct": -2.0, "error_backend_pct": -2.0}]}]}
    machine = {"date": "2026-01-01T00:00:00+00:00", "hostname": "vm", "cpu_model": "EPYC",
               "nproc": 2, "mem_total": "24 GB", "kernel": "6.1", "fio_version": "fio-3.33",
               "python": "3.11.7", "pyfuse3": "3.5.0", "trio": "0.35.0",
               "git_commit": "abc1234", "qosfs_path": "/repo/qosfs",
               "loadavg_start": ["0.1", "0.2", "0.3"], "loadavg_end": ["0.4", "0.5", "0.6"]}
    suites = {"overhead": overhead, "caps": caps, "isolation": isolation,
              "live-change": live, "fairshare": fair, "metadata": meta, "priorities": prio}
    return {"stem": "REPORT", "machine": machine, "complete": True, "elapsed_s": 1500.0,
            "config": {"quick": False, "command": "python -m bench all", "tmpfs_size": "6g",
                       "disk_dir": "/var/tmp", "disk_fs": "ext4"},
            "suites": {k: {"result": v, "error": None, "elapsed_s": 60.0}
                       for k, v in suites.items()},
            "plots": {"overhead": "report-overhead.png"},
            "extra_reports": [{"file": "latency-target.md",
                               "text": "# Latency target\n\nall good\n"}]}


def test_header_names_the_machine_commit_and_mode() -> None:
    text = render(fixture(), BY_NAME)
    assert text.startswith("# qosfs benchmark report\n")
    assert "commit **abc1234**" in text
    assert "Mode: **full** (`python -m bench all`)" in text
    assert "a directory on ext4 (/var/tmp)" in text


def test_headline_shows_each_guarantee_against_its_target() -> None:
    rows = {r[0]: r[1:] for r in headline(fixture(), BY_NAME)}
    machinery = rows["QoS machinery: policy (caps far above demand) / no-qos, worst workload"]
    assert machinery == ["0.90×", "≥ 0.95", "**MISS** by 5.0 points"]
    # the 800 MiB/s level had no demand: it is shown, never counted as accuracy
    assert rows["cap accuracy, worst 10 s window (1 caps)"] == ["+0.4%", "±2% over 10 s",
                                                              "pass"]
    assert rows["cap accuracy, worst 1 s window"] == ["-3.0%", "±10%", "pass"]
    tp = rows["isolation, checkpoints capped at 100MiB/s: reader throughput vs solo"]
    assert tp == ["85%", "≥ 90%", "**MISS** by 5 points"]
    assert rows["isolation, same: reader p99 vs solo"] == ["1.40×", "≤ 1.2×", "**MISS**"]
    assert rows["live change: parked write released after `set`, worst"][0] == "6.5 ms"
    assert rows["metadata, no-qos / native (create, stat, open, unlink)"][0] == \
        "0.05×, 0.05×, 0.05×, 0.05×"
    assert rows["QoS machinery on metadata, mount rates: policy (every request charged to "
                "meta_iops) / no-qos, worst operation (two identical no-qos mounts differ "
                "by up to 2%)"] == ["0.98×", "≥ 0.95", "pass"]
    assert rows["QoS machinery on metadata, in-process: 1 − added handler time × no-qos "
                "rate, worst operation (create)"] == ["0.98×", "≥ 0.95", "pass"]


@pytest.mark.parametrize(("twin", "expected"), [(4.4e3, "inconclusive"), (5.1e3, "**MISS**")])
def test_a_metadata_miss_within_the_spread_of_two_identical_mounts_is_inconclusive(
        twin: float, expected: str) -> None:
    meta = MetadataResult.from_json({
        "summary": [_row("stat", "stat", "iops", {"native": 100e3, "no-qos": 5e3,
                                                  "no-qos-2": twin, "policy": 4.5e3})],
        "nrfiles": 100, "meta_cap": 1000, "policy": "[z]"})
    (*_, mounted), = [r for r in metadata.headline(meta) if "mount rates" in r[0]]
    assert mounted == expected


def test_sections_plots_and_extra_reports() -> None:
    text = render(fixture(), BY_NAME)
    for title in ("## 1. Overhead", "## 2. Cap accuracy", "## 3. Isolation", "## 4. Live",
                  "## 5. Fair share", "## 6. Metadata", "## 7. Priorities"):
        assert title in text
    assert "![overhead ratios](report-overhead.png)" in text
    assert "no demand: uncapped rate < 1.1× cap" in text
    assert "| 100MiB/s | 100 MiB/s | 20% | 2.00 ms |" in text  # a throttled MiB's cost
    assert "| create | 100.0k ops/s | 5,000 ops/s | 4,900 ops/s | 1,000 ops/s | 0.05× | 1.02× " \
        "| 0.98× | 0.98× | 0.20× |" in text
    assert "| create | 20.0 µs | 24.0 µs | +4.0 µs |" in text
    assert "| no cap (classes only) | 500 MiB/s | 200 MiB/s | 40% |" in text
    assert "Missed targets: " in text
    # another suite's report of the same run is included, its headings demoted
    assert "## From `latency-target.md` (same run)" in text
    assert "\n## Latency target\n" in text


def test_failed_suite_missing_plots_and_interruption_are_said() -> None:
    doc = copy.deepcopy(fixture())
    doc["suites"]["caps"] = {"result": None, "error": "fio exited with 1", "elapsed_s": 1.0}
    doc["complete"] = False
    doc["plots"] = {}
    doc["plots_error"] = "matplotlib is not installed"
    text = render(doc, BY_NAME)
    assert "**Failed:** fio exited with 1" in text
    assert "INCOMPLETE" in text
    assert "Plots: not drawn (matplotlib is not installed)." in text
    assert "![" not in text


def test_a_result_this_version_cannot_read_is_named_with_its_field() -> None:
    doc = copy.deepcopy(fixture())
    doc["suites"]["caps"]["result"]["workloads"][0]["levels"][0]["worst_1s_pct"] = "3%"
    del doc["suites"]["fairshare"]["result"]["phase_s"]
    text = render(doc, BY_NAME)
    caps = ("caps: figures do not match this version of bench/ (REPORT.json: suites.caps."
            "result.workloads[0].levels[0].worst_1s_pct: expected float, found str), not "
            "rendered")
    assert f"| {caps} | — | — |  |" in text  # its headline row
    assert f"## caps\n\n**Not rendered:** {caps}.\n" in text  # its section, one line
    assert "(REPORT.json: suites.fairshare.result.phase_s: missing)" in text
    assert "## 2. Cap accuracy" not in text and "## 5. Fair share" not in text
    assert "## 3. Isolation" in text  # the others are all there


def test_a_suite_measured_in_its_own_run_is_named_by_its_own_file() -> None:
    doc = copy.deepcopy(fixture())
    entry = doc["suites"]["priorities"]
    entry["own_run"] = {"machine": doc["machine"], "config": doc["config"],
                        "elapsed_s": 9.0, "file": "priorities.json"}
    entry["result"]["backend"] = 100
    assert "(priorities.json: suites.priorities.result.backend: expected str, found int)" \
        in render(doc, BY_NAME)


def test_without_matplotlib_the_report_is_written_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    md = write(fixture(), tmp_path, "REPORT", BY_NAME)
    text = md.read_text()
    assert "Plots: not drawn (matplotlib is not installed" in text
    assert "![" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["REPORT.json", "REPORT.md"]
