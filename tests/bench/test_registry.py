"""bench/catalog.py and the typed results: every suite is complete, every stored sample
loads, round-trips and renders, and a file that does not match names its field.

The samples in tests/bench/data/results are figures measured by the suites themselves
(see each file's "source"), not written by hand.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import build_parser
from bench.catalog import BY_NAME, COMMANDS, SUITES
from bench.core.report import headline, loaded, render
from bench.core.typed import Record, ResultMismatch, from_json, to_json
from bench.suites.caps import CapLevel
from bench.suites.live_change.live_report import StepChange
from tests.bench.test_report import fixture

SAMPLES = Path(__file__).parent / "data" / "results"


def sample(name: str) -> Any:
    return json.loads((SAMPLES / f"{name}.json").read_text())["result"]


def every_sample_doc() -> dict[str, Any]:
    doc = fixture()
    doc["suites"] = {s.name: {"result": sample(s.name), "error": None, "elapsed_s": 1.0}
                     for s in SUITES}
    doc["plots"] = {name: f"report-{name}.png" for s in SUITES for name, _ in s.plots}
    return doc


def test_every_suite_has_a_runner_a_record_a_headline_and_a_section() -> None:
    names = [s.name for s in SUITES] + [c.name for c in COMMANDS]
    assert len(set(names)) == len(names)
    for s in SUITES:
        assert callable(s.runner) and callable(s.headline) and callable(s.section), s.name
        assert dataclasses.is_dataclass(s.result) and issubclass(s.result, Record), s.name
        assert s.result.__dataclass_params__.frozen, s.name  # type: ignore[attr-defined]
        assert all(callable(fn) for _, fn in s.plots), s.name
    plots = [name for s in SUITES for name, _ in s.plots]
    assert len(set(plots)) == len(plots)
    assert all(callable(c.run) for c in COMMANDS)


def test_help_lists_every_suite_and_command_from_the_registry() -> None:
    parser, subparsers = build_parser()
    text = parser.format_help()
    for name in [*BY_NAME, *(c.name for c in COMMANDS)]:
        assert f"\n  {name} " in text, name
        assert name in subparsers
    assert "--quick" in subparsers["latency-target"].format_help()
    assert "--minutes" in subparsers["soak"].format_help()


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_a_stored_sample_loads_and_writes_back_unchanged(suite: Any) -> None:
    data = sample(suite.name)
    result = suite.load(data, "")
    assert isinstance(result, suite.result)
    assert result.to_json() == json.loads(json.dumps(data))


def test_report_renders_every_suite_from_its_stored_sample() -> None:
    doc = every_sample_doc()
    text = render(doc, BY_NAME)
    assert "Not rendered" not in text and "do not match" not in text
    for name, (suite, result) in loaded(doc, BY_NAME).items():
        assert not isinstance(result, ResultMismatch), name
        heading = suite.section(doc["plots"], result)[0]
        assert heading.startswith("## ") and heading in text, name
        assert f"_{name}: 1 s._" in text
        for row in suite.headline(result):
            assert "| " + " | ".join(row) + " |" in text
    for name, _ in (p for s in SUITES for p in s.plots):
        assert f"(report-{name}.png)" in text
    assert len(headline(doc, BY_NAME)) >= 20


def test_plots_are_drawn_from_every_sample(tmp_path: Path) -> None:
    import matplotlib  # noqa: F401 - the test extra: fails, not skips, if missing

    from bench.core import plotting

    jobs = [(name, fn, result) for suite, result in loaded(every_sample_doc(), BY_NAME).values()
            for name, fn in suite.plots]
    files, errors = plotting.draw(jobs, tmp_path)
    assert errors == []
    assert sorted(files) == sorted(name for name, _, _ in jobs)
    assert all((tmp_path / f).stat().st_size > 0 for f in files.values())


def test_a_mismatch_names_the_field_and_what_was_found() -> None:
    good = {"level": "50MiB/s", "cap": 50, "has_demand": True, "fio_rate": 51.5,
            "windows": 0}
    level = from_json(CapLevel, good)
    assert level.cap == 50.0 and isinstance(level.cap, float)  # JSON has no int/float
    assert level.worst_1s_pct is None  # no steady windows: only their number is known
    cases = [({**good, "windows": 1.5}, "levels[2].windows: expected int, found float"),
             ({**good, "has_demand": 1}, "levels[2].has_demand: expected bool, found int"),
             ({**good, "per_second": {"a": 1}}, "levels[2].per_second: expected an array"),
             ({k: v for k, v in good.items() if k != "cap"}, "levels[2].cap: missing"),
             ({**good, "surprise": 1}, "levels[2].surprise: not a field of CapLevel"),
             ([good], "levels[2]: expected an object (CapLevel), found list")]
    for data, message in cases:
        with pytest.raises(ResultMismatch) as info:
            from_json(CapLevel, data, "levels[2]")
        assert str(info.value).startswith(message)


def test_json_keys_that_are_not_python_names_and_pairs_round_trip() -> None:
    change = from_json(StepChange, {"at_s": 1, "from": "50MiB/s", "to": "1GiB/s",
                                    "settle_ms": None})
    assert change.from_ == "50MiB/s"
    assert to_json(change) == {"at_s": 1.0, "from": "50MiB/s", "to": "1GiB/s",
                               "settle_ms": None}
    isolation = BY_NAME["isolation"].load(sample("isolation"), "")
    pairs = isolation.bursts[0].series["datasets"]
    assert all(isinstance(p, tuple) and len(p) == 2 for p in pairs)
