"""REPORT.md from one run's figures: pure rendering, no measuring and no I/O.

:func:`render` takes the document ``python -m bench`` writes as REPORT.json (machine,
configuration, each suite's result or error, plot file names) and returns the markdown:
the machine and commit on top, a headline table of every guarantee against its target,
then one section per suite with its table, its plot and how it was measured. A figure
that misses its target says so and by how much; nothing is rounded into a pass.
"""

from __future__ import annotations

from typing import Any

from bench.sections import (
    CAP_1S_PCT,
    CAP_LONG_PCT,
    ISO_P99,
    ISO_THROUGHPUT,
    LIVE_MS,
    MACHINERY_MIN,
    SECTIONS,
    SHARE_PCT,
    Doc,
    _over,
    machinery_share,
    pct,
    ratio,
    table,
    verdict,
)
from bench.training_report import headline as _head_training
from bench.training_report import section as section_training

Rows = list[list[str]]


def _head_overhead(ov: dict[str, Any]) -> Rows:
    rows = [[f"pass-through cost, {s['label']}: no-qos / native",
             ratio(s["ratio_to_native"].get("no-qos")), "—", ""]
            for s in ov["summary"] if s["key"] in ("dataset", "disk-dataset", "checkpoint")]
    mach = [s["machinery"] for s in ov["summary"] if s["machinery"] is not None]
    if mach:
        worst = min(mach)
        rows.append(["QoS machinery: policy (caps far above demand) / no-qos, worst workload",
                     ratio(worst), f"≥ {MACHINERY_MIN}",
                     verdict(worst >= MACHINERY_MIN,
                             f"by {100 * (MACHINERY_MIN - worst):.1f} points")])
    return rows


def _head_caps(caps: dict[str, Any]) -> Rows:
    levels = [lv for w in caps["workloads"] for lv in w["levels"]
              if lv.get("windows") and lv["has_demand"]]
    if not levels:
        return []
    long = max((lv["worst_long_pct"] for lv in levels), key=abs)
    one = max((lv["worst_1s_pct"] for lv in levels), key=abs)
    span = min(lv["long_window_s"] for lv in levels)
    return [[f"cap accuracy, worst {span:.0f} s window ({len(levels)} caps)", pct(long),
             f"±{CAP_LONG_PCT:.0f}% over 10 s", verdict(abs(long) <= CAP_LONG_PCT)],
            ["cap accuracy, worst 1 s window", pct(one), f"±{CAP_1S_PCT:.0f}%",
             verdict(abs(one) <= CAP_1S_PCT)]]


def _head_isolation(iso: dict[str, Any]) -> Rows:
    rows: Rows = []
    head = next((r for r in iso["summary"]
                 if r["scenario"] == f"storm cap {iso['headline_cap']}"), None)
    free = next((r for r in iso["summary"] if r["scenario"] == "storm no-qos"), None)
    if head and head["bw_bytes_ratio"] is not None:
        tp, p99 = head["bw_bytes_ratio"], head["clat_p99_us_ratio"]
        rows.append([f"isolation, checkpoints capped at {iso['headline_cap']}: reader "
                     "throughput vs solo", pct(100 * tp, False), f"≥ {100 * ISO_THROUGHPUT:.0f}%",
                     verdict(tp >= ISO_THROUGHPUT,
                             f"by {100 * (ISO_THROUGHPUT - tp):.0f} points")])
        rows.append(["isolation, same: reader p99 vs solo", ratio(p99), f"≤ {ISO_P99}×",
                     verdict(p99 is not None and p99 <= ISO_P99)])
    if free and free["bw_bytes_ratio"] is not None:
        rows.append(["isolation without QoS (--no-qos): reader throughput, p99",
                     f"{100 * free['bw_bytes_ratio']:.0f}%, "
                     f"{ratio(free['clat_p99_us_ratio'])}", "(contrast)", ""])
    return rows


def _head_live(live: dict[str, Any]) -> Rows:
    rows: Rows = []
    s = live["summary"].get("set")
    if s:
        rows.append(["live change: parked write released after `set`, worst",
                     f"{s['max_delay_ms']:.1f} ms", f"< {LIVE_MS:.0f} ms",
                     verdict(s["max_delay_ms"] < LIVE_MS)])
    settles = [c["settle_ms"] for c in live["step"]["changes"]]
    worst = None if None in settles else max(settles)
    rows.append(["live change: new rate holds (±10% over 0.5 s) after `set`, worst",
                 "never" if worst is None else f"{worst:.0f} ms", f"< {LIVE_MS:.0f} ms",
                 verdict(worst is not None and worst < LIVE_MS)])
    return rows


def _head_fair(fair: dict[str, Any]) -> Rows:
    errs = [p["worst_pct"] for p in fair["phases"] if p["worst_pct"] is not None]
    if not errs:
        return []
    w = max(errs, key=abs)
    return [["fair share, 3 uids: worst per-user error vs equal split", pct(w),
             f"±{SHARE_PCT:.0f}%", verdict(abs(w) <= SHARE_PCT)]]


def _head_meta(meta: dict[str, Any]) -> Rows:
    nat = {s["key"]: s["ratio_to_native"].get("no-qos") for s in meta["summary"]}
    rows = [["metadata, no-qos / native (create, stat, open, unlink)",
             ", ".join(ratio(nat.get(k)) for k in ("create", "stat", "open", "unlink")),
             "—", ""]]
    mach = [s["machinery"] for s in meta["summary"] if s["machinery"] is not None]
    twins = [_over(s["sides"], "no-qos-2", "no-qos") for s in meta["summary"]]
    spread = max((abs(t - 1.0) for t in twins if t is not None), default=None)
    if mach:
        worst = min(mach)
        ok: bool | None = worst >= MACHINERY_MIN
        if not ok and spread is not None and spread > 1.0 - MACHINERY_MIN:
            ok = None  # two identical mounts differ by more than the margin
        rows.append(["QoS machinery on metadata, mount rates: policy (every request "
                     "charged to meta_iops) / no-qos, worst operation"
                     + (f" (two identical no-qos mounts differ by up to "
                        f"{100 * spread:.0f}%)" if spread is not None else ""),
                     ratio(worst), f"≥ {MACHINERY_MIN}",
                     verdict(ok) if ok is not None else "inconclusive"])
    share = machinery_share(meta)
    if share:
        worst_op = min(share, key=lambda k: share[k])
        rows.append(["QoS machinery on metadata, in-process: 1 − added handler time × "
                     f"no-qos rate, worst operation ({worst_op})", ratio(share[worst_op]),
                     f"≥ {MACHINERY_MIN}", verdict(share[worst_op] >= MACHINERY_MIN)])
    return rows


def _head_prio(prio: dict[str, Any]) -> Rows:
    errs = [c["error_backend_pct"] for sc in prio["scenarios"] for c in sc["classes"]
            if c["error_backend_pct"] is not None]
    if not errs:
        return []
    w = max(errs, key=abs)
    return [[f"priorities/minimums, backend {prio['backend']}: worst error vs expected "
             "share, in % of the backend", pct(w), f"±{SHARE_PCT:.0f}%",
             verdict(abs(w) <= SHARE_PCT)]]


LOADER_GAIN = 2.0  # issue targets against the figures before keep_cache / timeouts
RE_READ_MIN = 0.9


def _head_loader(r: dict[str, Any]) -> Rows:
    sm = r["summary"]
    rows = []
    for kind in ("cold", "cached"):
        got = sm["policy"][kind]["samples_per_s"]
        rows.append([f"data loader {kind}, default policy: samples/s (native "
                     f"{sm['native'][kind]['samples_per_s']:,.0f})", f"{got:,.0f}",
                     "—", ""])
    re_read = sm["policy"]["reread"]["mb_per_s"] / sm["native"]["reread"]["mb_per_s"]
    rows.append(["cached re-read, default policy / native", ratio(re_read),
                 f"≥ {RE_READ_MIN}", verdict(re_read >= RE_READ_MIN)])
    return rows


HEADLINES = {"overhead": _head_overhead, "caps": _head_caps, "isolation": _head_isolation,
             "live-change": _head_live, "fairshare": _head_fair, "metadata": _head_meta,
             "priorities": _head_prio, "loader": _head_loader, "training": _head_training}
# the training suite's section lives with its headline (bench/training_report.py)
ALL_SECTIONS = {**SECTIONS, "training": section_training}
# a result this code cannot read (another version's REPORT.json) spoils only its rows
_UNREADABLE = (KeyError, TypeError, ValueError, IndexError)


def headline(doc: Doc) -> Rows:
    """Rows (what, figure, target, result) of the headline table, for the suites run."""
    rows: Rows = []
    for name, entry in doc.get("suites", {}).items():
        if name in HEADLINES and entry.get("result") is not None:
            try:
                rows += HEADLINES[name](entry["result"])
            except _UNREADABLE as exc:
                rows.append([f"{name}: figures unreadable ({type(exc).__name__}: {exc})",
                             "—", "—", ""])
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


def render(doc: Doc) -> str:
    """The whole REPORT.md (see the module docstring)."""
    title = doc.get("title", "qosfs benchmark report")
    lines = [f"# {title}", "", *_header(doc), "", "## Headline", ""]
    head = headline(doc)
    lines += table(["what", "figure", "target", "result"], head, "---|---:|---:|---") \
        if head else ["(no suite produced figures)"]
    misses = [r[0] for r in head if r[3].startswith("**MISS")]
    if misses:
        lines += ["", "Missed targets: " + "; ".join(misses) + "."]
    for name, entry in doc.get("suites", {}).items():
        lines.append("")
        if entry.get("error"):
            lines += [f"## {name}", "", f"**Failed:** {entry['error']}"]
        elif name in ALL_SECTIONS and entry.get("result") is not None:
            try:
                body = ALL_SECTIONS[name](doc, entry["result"])
            except _UNREADABLE as exc:
                body = [f"## {name}", "", f"**Figures unreadable:** {type(exc).__name__}: "
                        f"{exc} (written by another version of bench/?)"]
            if entry.get("own_run"):  # under its heading, before any figure
                body[1:1] = ["", _own_run(entry["own_run"])]
            lines += body
            lines.append(f"_{name}: {entry['elapsed_s']:.0f} s._")
    for extra in doc.get("extra_reports", []):
        # another suite's report, included as written, its headings one level down
        body = ["#" + ln if ln.startswith("#") else ln for ln in extra["text"].splitlines()]
        lines += ["", f"## From `{extra['file']}` (same run)", "", *body]
    return "\n".join(lines).rstrip() + "\n"
