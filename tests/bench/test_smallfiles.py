"""bench.suites.smallfiles: its record, ratios, headline and section from a stored sample
(no mounts)."""

from __future__ import annotations

import dataclasses

from bench.suites.smallfiles import (
    SIDES,
    Pass,
    SmallfilesResult,
    files_ratio,
    headline,
    round_trips_table,
    section,
)
from tests.bench.test_registry import sample


def stored() -> SmallfilesResult:
    return SmallfilesResult.from_json(sample("smallfiles"))


def _pass(side: str, phase: str, rate: float, area: str = "disk", threads: int = 1,
          **requests: float) -> Pass:
    return Pass(area=area, side=side, threads=threads, phase=phase, files_s=rate,
                cpu_us=None if side == "bare" else 50.0, requests=requests)


def test_every_side_ran_cold_and_warm_in_the_sample() -> None:
    r = stored()
    for area in ("tmpfs", "disk"):
        for threads in r.threads:
            got = {(p.side, p.phase) for p in r.passes
                   if p.area == area and p.threads == threads}
            assert got == {(s, ph) for s in SIDES for ph in ("cold", "warm")}, (area, threads)


def test_ratios_and_headline_against_bare_and_passthrough_hp() -> None:
    r = dataclasses.replace(stored(), threads=[1], passes=[
        _pass("bare", "cold", 2000.0), _pass("policy", "cold", 1800.0),
        _pass("hp-passthrough", "cold", 900.0, area="tmpfs", threads=16),
        _pass("policy", "cold", 1000.0, area="tmpfs", threads=16),
        _pass("hp-single", "warm", 500.0, area="tmpfs", threads=16),
        _pass("hp-multi", "warm", 800.0, area="tmpfs", threads=16),
        _pass("policy", "warm", 400.0, area="tmpfs", threads=16)])
    assert files_ratio(r, "disk", "policy", 1, "cold") == 0.9
    assert files_ratio(r, "disk", "no-qos", 1, "cold") is None
    rows = headline(r)
    assert rows[0][1:] == ["0.90×", "≥ 0.8", "pass"]
    assert rows[1][1] == "0.50×"  # against the best passthrough_hp mode, hp-multi
    assert rows[2][1] == "1.11×"


def test_round_trips_are_per_file_in_a_files_life_order() -> None:
    r = dataclasses.replace(stored(), passes=[
        _pass("policy", "cold", 1.0, LOOKUP=1.03, RELEASE=1.0, OPEN=1.0, FLUSH=0.002,
              BACKING_OPEN=1.0),
        _pass("policy", "warm", 1.0, OPEN=1.0, RELEASE=1.0)])
    lines = round_trips_table(r, "disk", 1)
    assert lines[0] == "| side, pass | all | LOOKUP | OPEN | BACKING_OPEN | FLUSH | RELEASE |"
    assert lines[2] == "| policy, cold | 4.03 | 1.03 | 1.00 | 1.00 | <0.01 | 1.00 |"
    assert lines[3] == "| policy, warm | 2.00 | · | 1.00 | · | · | 1.00 |"


def test_the_section_says_what_was_not_measured() -> None:
    r = dataclasses.replace(stored(), peer=None, peer_missing="no libfuse source",
                            trace="not available here: no tracefs",
                            errors={"disk hp-single 1": "passthrough_hp not measured"})
    text = "\n".join(section({}, r))
    assert text.startswith("## Small files")
    assert "- passthrough_hp was not measured: no libfuse source." in text
    assert "- FUSE requests: not available here: no tracefs." in text
    assert "- Not measured, disk hp-single 1: passthrough_hp not measured." in text
    assert "### disk (" in text and "### tmpfs (tmpfs)" in text
