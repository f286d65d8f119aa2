"""bench/core/fio.py: reading fio's JSON, and the job files' documented defaults."""

from __future__ import annotations

import re
from typing import Any

import pytest

from bench.core.fio import JOBS_DIR, FioError, job_defaults, parse_fio_json


def _ddir(ios: int = 0, bw: float = 0.0, p99_ns: float = 0.0) -> dict[str, Any]:
    return {"total_ios": ios, "bw_bytes": bw, "iops": float(ios), "io_bytes": int(bw),
            "clat_ns": {"mean": p99_ns / 2,
                        "percentile": {"50.000000": p99_ns / 4, "99.000000": p99_ns,
                                       "99.900000": 2 * p99_ns}}}


def _job(name: str, groupid: int, read: dict[str, Any] | None = None,
         write: dict[str, Any] | None = None, error: int = 0) -> dict[str, Any]:
    return {"jobname": name, "groupid": groupid, "error": error, "job_runtime": 1000,
            "usr_cpu": 1.0, "sys_cpu": 2.0, "read": read or _ddir(), "write": write or _ddir(),
            "trim": _ddir()}


MIXED = {"jobs": [_job("dataset", 0, read=_ddir(100, 1e6, 4000)),
                  _job("checkpoint", 1, write=_ddir(10, 5e6, 9000))]}


def test_sums_jobs_and_takes_latency_from_the_busiest_direction() -> None:
    m = parse_fio_json(MIXED)
    assert m.bw_bytes == 6e6
    assert m.total_ios == 110
    assert m.ddirs == ["read", "write"]
    assert m.clat_p99_us == 4.0  # the read direction did more I/Os
    assert m.clat_p999_us == 8.0


def test_one_reporting_group() -> None:
    reader, writer = parse_fio_json(MIXED, 0), parse_fio_json(MIXED, 1)
    assert (reader.bw_bytes, reader.ddirs) == (1e6, ["read"])
    assert (writer.bw_bytes, writer.clat_p99_us) == (5e6, 9.0)


def test_failed_job_and_empty_output_are_errors() -> None:
    with pytest.raises(FioError, match="fio job bad failed with error 5"):
        parse_fio_json({"jobs": [_job("bad", 0, error=5)]})
    with pytest.raises(FioError, match="no jobs"):
        parse_fio_json({"jobs": []})
    with pytest.raises(FioError, match="no jobs"):
        parse_fio_json(MIXED, 7)


@pytest.mark.parametrize("job", sorted(JOBS_DIR.glob("*.fio")), ids=lambda p: p.name)
def test_every_variable_of_a_job_file_has_a_documented_default(job: Any) -> None:
    """fio has no default syntax: a ${VAR} missing from the `# defaults:` line would make
    the file unusable by hand with the documented command."""
    body = "\n".join(line for line in job.read_text().splitlines()
                     if not line.lstrip().startswith(("#", ";")))
    used = set(re.findall(r"\$\{([A-Z_]+)\}", body))
    assert used, "a job file without variables: nothing to check"
    assert used <= set(job_defaults(job)), used - set(job_defaults(job))
