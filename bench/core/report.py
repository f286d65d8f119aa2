"""REPORT.md from one run's figures: pure rendering, no measuring and no I/O.

:func:`render` takes the document ``python -m bench`` writes as REPORT.json (machine,
configuration, each suite's result or error, plot file names) and returns the markdown:
the machine and commit on top, a headline table of every guarantee against its target,
then one section per suite with its table, its plot and how it was measured. A figure
that misses its target says so and by how much; nothing is rounded into a pass.

Each suite's result is read back through its record before anything is rendered: the
caller passes the suites by name (``bench.catalog.BY_NAME``), each a
:class:`~bench.core.registry.Suite`. A result that does not have the record's shape (a
file written by another version of bench/) is named, with the field, in one line where
its rows and its section would be; the other suites render as usual.
"""

from __future__ import annotations

from typing import Any

from bench.core.registry import Suite, Suites
from bench.core.tables import Rows, table
from bench.core.typed import ResultMismatch

Doc = dict[str, Any]
Loaded = tuple[Suite[Any], Any]  # the suite and its record, or the ResultMismatch


def loaded(doc: Doc, suites: Suites) -> dict[str, Loaded]:
    """The result of every suite in *doc* that has one, read through its suite's record
    (suites this version does not know, and suites without a result, are left out)."""
    out: dict[str, Loaded] = {}
    for name, entry in doc.get("suites", {}).items():
        suite = suites.get(name)
        if suite is None or entry.get("result") is None:
            continue
        origin = (entry.get("own_run") or {}).get("file") or f"{doc.get('stem', 'REPORT')}.json"
        try:
            out[name] = (suite, suite.load(entry["result"], ""))
        except ResultMismatch as exc:
            field = f"suites.{name}.result" + (f".{exc.where}" if exc.where else "")
            out[name] = (suite, ResultMismatch(f"{origin}: {field}", exc.why))
    return out


def _unreadable(name: str, exc: ResultMismatch) -> str:
    return (f"{name}: figures do not match this version of bench/ ({exc}), not "
            "rendered")


def headline(doc: Doc, suites: Suites, results: dict[str, Loaded] | None = None) -> Rows:
    """Rows (what, figure, target, result) of the headline table, for the suites run."""
    rows: Rows = []
    for name, (suite, result) in (loaded(doc, suites) if results is None else results).items():
        if isinstance(result, ResultMismatch):
            rows.append([_unreadable(name, result), "—", "—", ""])
        else:
            rows += suite.headline(result)
    return rows


def _header(doc: Doc) -> list[str]:
    m, c = doc["machine"], doc["config"]
    lines = [
        f"{m['date']} · `{m['hostname']}` · {m['cpu_model']}, {m['nproc']} CPUs, "
        f"{m['mem_total']} · kernel {m['kernel']} · {m['fio_version']} · Python "
        f"{m['python']}, pyfuse3 {m['pyfuse3']}, trio {m['trio']} · qosfs commit "
        f"**{m['git_commit'] or 'unknown'}** (`{m['qosfs_path']}`)", "",
        f"Mode: **{'quick' if c['quick'] else 'full'}** (`{c['command']}`), "
        f"{doc['elapsed_s']:.0f} s; scratch: tmpfs ({c['tmpfs_size']})"
        + (f" and a directory on {c['disk_fs']} ({c['disk_dir']})" if c.get("disk_dir")
           else ", no disk area") + f"; load average {' '.join(m['loadavg_start'])} at start, "
        f"{' '.join(m.get('loadavg_end', ['?']))} at end.", "",
        "Every figure below was measured in this run, each against a baseline measured in "
        "the same run" + (", except the sections marked as measured in a run of their own "
        "(their baselines are from that run)" if any(
            e.get("own_run") for e in doc.get("suites", {}).values()) else "")
        + ". Raw figures, fio command lines and per-run records: "
        f"`{doc.get('stem', 'REPORT')}.json`.",
    ]
    if not doc.get("complete", True):
        lines += ["", "**INCOMPLETE: the run was interrupted; sections missing below were "
                      "not measured.**"]
    if doc.get("plots_error"):
        lines += ["", f"Plots: not drawn ({doc['plots_error']})."]
    return lines


def _own_run(run: Doc) -> str:
    """The line under a suite measured in a run of its own (``python -m bench merge``)."""
    m, c = run["machine"], run["config"]
    return (f"_Measured in its own run, not the one above: {m['date']}, qosfs commit "
            f"**{m['git_commit'] or 'unknown'}**, {'quick' if c['quick'] else 'full'} mode "
            f"(`{c['command']}`), load average {' '.join(m['loadavg_start'])} at start, "
            f"{' '.join(m.get('loadavg_end', ['?']))} at end; its figures: "
            f"`{run['file']}`._")


def render(doc: Doc, suites: Suites) -> str:
    """The whole REPORT.md (see the module docstring)."""
    results = loaded(doc, suites)
    plots = doc.get("plots") or {}
    title = doc.get("title", "qosfs benchmark report")
    lines = [f"# {title}", "", *_header(doc), "", "## Headline", ""]
    head = headline(doc, suites, results)
    lines += table(["what", "figure", "target", "result"], head, "---|---:|---:|---") \
        if head else ["(no suite produced figures)"]
    misses = [r[0] for r in head if r[3].startswith("**MISS")]
    if misses:
        lines += ["", "Missed targets: " + "; ".join(misses) + "."]
    for name, entry in doc.get("suites", {}).items():
        lines.append("")
        if entry.get("error"):
            lines += [f"## {name}", "", f"**Failed:** {entry['error']}"]
        elif name in results:
            suite, result = results[name]
            if isinstance(result, ResultMismatch):
                body = [f"## {name}", "", f"**Not rendered:** {_unreadable(name, result)}."]
            else:
                body = suite.section(plots, result)
            if entry.get("own_run"):  # under its heading, before any figure
                body[1:1] = ["", _own_run(entry["own_run"])]
            lines += body
            lines.append(f"_{name}: {entry['elapsed_s']:.0f} s._")
    for extra in doc.get("extra_reports", []):
        # another suite's report, included as written, its headings one level down
        body = ["#" + ln if ln.startswith("#") else ln for ln in extra["text"].splitlines()]
        lines += ["", f"## From `{extra['file']}` (same run)", "", *body]
    return "\n".join(lines).rstrip() + "\n"
