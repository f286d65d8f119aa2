"""One benchmark session: check the machine, prepare the scratch areas, run suites in
order, then write the figures (``<stem>.json``), the plots and the report (``<stem>.md``).

A suite that fails is recorded with its one-line error and the session goes on; Ctrl-C or
SIGTERM stops it, and whatever was measured is still written. Every mount and the scratch
tmpfs are context managers, so nothing is left mounted on any exit path.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import qosfs
from bench.core import plotting, report
from bench.core.context import Run, stderr_log
from bench.core.fio import FioError, find_fio, fio_version
from bench.core.registry import Suite, Suites
from bench.core.system import (
    REPO,
    BenchError,
    disk_area,
    filesystem_type,
    machine_info,
    require_root,
    tmpfs_area,
)
from bench.core.typed import ResultMismatch
from qosfs.core.errors import QosfsError


@dataclass(frozen=True)
class Options:
    quick: bool
    out: Path
    command: str  # as typed, for the report
    tmpfs_size: str = "6g"
    disk_dir: str | None = "/var/tmp"
    reps: int | None = None
    quiet_wait: float = 2.0
    qosfs_args: tuple[str, ...] = ()


def _checks(names: list[str], suites: Suites) -> tuple[str, dict[str, str]]:
    """fio's path and the suites this machine cannot run (name -> why); raises BenchError
    or FioError when nothing can run."""
    require_root("python -m bench")
    here = Path(qosfs.__file__).resolve().parent
    if here != REPO / "qosfs":
        raise BenchError(f"qosfs is imported from {here}, not this tree ({REPO}): run "
                         "`python -m bench` from the repository root")
    fio = find_fio()
    skip = {name: why for name in names if (why := suites[name].unavailable(fio))}
    return fio, skip


def _extra_reports(out: Path, stem: str, since: float) -> list[dict[str, str]]:
    """Markdown reports other suites wrote into *out* during this session (e.g. a
    ``latency-target`` suite run by ``all``): the report includes them as they are."""
    found = []
    for path in sorted(out.glob("*.md")):
        if path.stem in (stem, "README") or path.stat().st_mtime < since:
            continue
        found.append({"file": path.name, "text": path.read_text()})
    return found


def write(doc: dict[str, Any], out: Path, stem: str, suites: Suites) -> Path:
    """Plots (when matplotlib is there), then ``<stem>.json`` and ``<stem>.md``."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        # REPORT's plots are report-*.png, so a single suite run later (its plots are
        # <name>.png) never replaces a plot REPORT.md shows
        jobs = [(name, fn, result) for suite, result in report.loaded(doc, suites).values()
                if not isinstance(result, ResultMismatch) for name, fn in suite.plots]
        doc["plots"], errors = plotting.draw(jobs, out, "report-" if stem == "REPORT" else "")
        if errors:
            doc["plots_error"] = "; ".join(errors)
    except ImportError:
        doc["plots"] = {}
        doc["plots_error"] = ("matplotlib is not installed: `pip install '.[bench]'` and "
                              "run again")
    except Exception as exc:
        doc["plots"] = {}
        doc["plots_error"] = f"plotting failed: {type(exc).__name__}: {exc}"
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = out / f"{stem}.md"
    md.write_text(report.render(doc, suites))
    return md


def merge(part: Path, out: Path, suites: Suites, stem: str = "REPORT") -> Path:
    """Add the suites of a single-suite run (*part*, its ``<name>.json``) to the report
    ``<out>/<stem>.json`` and render it again, each added suite marked with its own run
    (date, commit, command) and placed first. A long suite (``training``) measured on
    its own then joins the report without re-measuring every other suite; the report
    says which figures came from which run."""
    doc = json.loads((out / f"{stem}.json").read_text())
    added = json.loads(part.read_text())
    own_run = {"machine": added["machine"], "config": added["config"],
               "elapsed_s": added.get("elapsed_s"), "file": part.name}
    joined = {name: {**entry, "own_run": own_run} for name, entry in added["suites"].items()}
    doc["suites"] = {**joined, **{k: v for k, v in doc["suites"].items() if k not in joined}}
    return write(doc, out, stem, suites)


def execute(names: list[str], opts: Options, stem: str, suites: Suites,
            extra: Callable[[str], int] | None = None, extra_names: tuple[str, ...] = ()
            ) -> int:
    """Run suites *names* (then *extra_names* through *extra*, each writing its own
    ``<out>/<name>.md``); write ``<stem>.md``/``.json``. Returns the exit code."""
    log = stderr_log
    try:
        fio, skip = _checks(names, suites)
    except (BenchError, FioError) as exc:
        log(f"bench: {exc}")
        return 2
    info = machine_info(fio_version(fio))
    since, t0 = time.time(), time.monotonic()
    doc: dict[str, Any] = {
        "title": "qosfs benchmark report" if stem == "REPORT" else f"qosfs benchmark: {stem}",
        "stem": stem, "machine": info, "complete": False, "suites": {},
        "config": {"quick": opts.quick, "command": opts.command, "tmpfs_size": opts.tmpfs_size,
                   "disk_dir": opts.disk_dir, "reps": opts.reps,
                   "qosfs_args": list(opts.qosfs_args), "suites": names},
    }
    try:
        with ExitStack() as stack:
            tmp = stack.enter_context(tmpfs_area(opts.tmpfs_size, []))
            disk = None
            if opts.disk_dir:
                disk = stack.enter_context(disk_area(opts.disk_dir, []))
                doc["config"]["disk_fs"] = filesystem_type(str(disk))
            run = Run(fio=fio, quick=opts.quick, tmpfs=tmp, disk=disk, reps=opts.reps,
                      quiet_wait=opts.quiet_wait, qosfs_args=opts.qosfs_args, log=log)
            for name in names:
                # stays so if Ctrl-C or SIGTERM stops the suite
                doc["suites"][name] = {"result": None, "error": "interrupted",
                                       "elapsed_s": 0.0}
                doc["suites"][name] = _one(run, suites[name], skip.get(name))
        for name in extra_names:
            assert extra is not None
            log(f"== {name}")
            code = extra(name)
            doc.setdefault("extra_suites", {})[name] = code
        doc["complete"] = True
    except KeyboardInterrupt:
        log("bench: interrupted; writing what was measured")
    finally:
        info["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
        doc["elapsed_s"] = round(time.monotonic() - t0, 1)
        doc["extra_reports"] = _extra_reports(opts.out, stem, since)
        md = write(doc, opts.out, stem, suites)
    log(f"wrote {md} and {md.with_suffix('.json')} ({doc['elapsed_s']:.0f} s)")
    failed = [n for n, e in doc["suites"].items() if e.get("error")]
    return 0 if doc["complete"] and not failed else 1


def _one(run: Run, suite: Suite[Any], skip: str | None) -> dict[str, Any]:
    name = suite.name
    run.log(f"== {name}")
    if skip:
        run.log(f"  skipped: {skip}")
        return {"error": f"skipped: {skip}", "result": None, "elapsed_s": 0.0}
    t0 = time.monotonic()
    try:
        result = suite.runner(run).to_json()
        error = None
    except ResultMismatch as exc:  # a runner whose figures its own record does not hold
        result, error = None, f"figures do not match {suite.result.__name__}: {exc}"
        run.log(f"  {name} failed: {error}")
    except (BenchError, FioError, QosfsError, OSError) as exc:
        result, error = None, str(exc).splitlines()[0][:300] or type(exc).__name__
        run.log(f"  {name} failed: {error}")
        _log_tail(run)
    finally:
        _clear(run)
    return {"result": result, "error": error, "elapsed_s": round(time.monotonic() - t0, 1)}


def _clear(run: Run) -> None:
    """Empty the scratch areas between suites (the daemon logs in work/ stay)."""
    for top in (run.tmpfs, run.disk):
        if top is None:
            continue
        for entry in top.iterdir():
            if entry.name != "work":
                shutil.rmtree(entry, ignore_errors=True)


def _log_tail(run: Run) -> None:
    """The last lines of the newest daemon log: why a mount went away, if it did."""
    logs = sorted(run.work.glob("qosfs-*.log"), key=os.path.getmtime)
    if logs:
        for line in logs[-1].read_text(errors="replace").splitlines()[-5:]:
            run.log(f"    {logs[-1].name}: {line}")
