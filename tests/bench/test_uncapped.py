"""bench.suites.uncapped: its headline and section from a stored sample (no mounts)."""

from __future__ import annotations

import dataclasses

from bench.suites.uncapped import FioShape, UncappedResult, headline, section
from tests.bench.test_registry import sample


def stored() -> UncappedResult:
    return UncappedResult.from_json(sample("uncapped"))


def test_the_sample_has_every_shape_on_both_areas_and_a_restore_each() -> None:
    r = stored()
    assert {(s.area, s.shape) for s in r.shapes} == {
        (a, n) for a in ("tmpfs", "disk") for n in ("4k QD1", "4k 4 jobs", "128k",
                                                     "1m direct")}
    assert {(x.area, x.phase) for x in r.restores} == {
        (a, p) for a in ("tmpfs", "disk") for p in ("cold", "warm")}


def test_headline_judges_ratios_counting_and_cost() -> None:
    shape = FioShape(area="disk", shape="4k QD1", bare_iops=100.0, qosfs_iops=95.0,
                     bare_mb_s=1.0, qosfs_mb_s=1.0, counted=1.03)
    r = dataclasses.replace(stored(), shapes=[shape], restores=[],
                            cost_with_iops=[93.0, 94.0], cost_without_iops=[100.0, 100.0])
    rows = {row[0]: row for row in headline(r)}
    assert rows["uncapped fio 4k QD1 (disk): qosfs / bare"][1:] == ["0.95×", "≥ 0.9", "pass"]
    counted = rows["uncapped counted 4k QD1 (disk): ctl stats / fio bytes"]
    assert counted[1] == "1.030×" and counted[3].startswith("**MISS**")
    cost = rows["uncapped: the counting's cost on 4k QD1 reads (disk)"]
    assert cost[1] == "+6.5%" and cost[3].startswith("**MISS**")


def test_section_names_what_could_not_run() -> None:
    r = dataclasses.replace(stored(), errors={"disk": "no disk area in this run"})
    text = "\n".join(section({}, r))
    assert "Not measured, disk: no disk area in this run." in text


def test_an_area_the_counting_cannot_see_shows_why_not_a_zero() -> None:
    tmpfs = FioShape(area="tmpfs", shape="4k QD1", bare_iops=100.0, qosfs_iops=95.0,
                     bare_mb_s=1.0, qosfs_mb_s=1.0, counted=None)
    why = "not counted: tmpfs (device 0:27): its reads are not seen by the tracepoints"
    r = dataclasses.replace(stored(), shapes=[tmpfs], counting={"tmpfs": why})
    text = "\n".join(section({}, r))
    row = next(line for line in text.splitlines() if line.startswith("| tmpfs | 4k QD1"))
    assert row.rstrip(" |").endswith("—") and "0.000" not in row
    assert f"- counting on tmpfs: {why}" in text
    assert not [row for row in headline(r) if "counted" in row[0]]
