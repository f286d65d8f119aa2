"""The kernel passthrough part of ``qosfs ctl status``: whether opens are passed through
here and why not, what joins an inode passed through, and whether the reads the kernel
served are counted (:mod:`qosfs.passthrough.kernel_opens` and
:mod:`qosfs.passthrough.read_counting` give the fields)."""

from __future__ import annotations

from typing import Any

from qosfs.core.units import format_size


def format_passthrough(kp: dict[str, Any] | None) -> list[str]:
    """Kernel passthrough, for ``status``: whether it works here, why not, and its counts."""
    if not kp:
        return []
    opens = sum(kp["opens"].values())
    line = (f"kernel passthrough {kp['state']}: {kp['reason']}; {kp['live_backing_ids']} "
            f"inodes passed through now ({kp.get('idle_backing_ids', 0)} more kept idle), "
            f"{opens} opens since mount, {kp['registered']} registered, "
            f"{kp.get('reused_backing_ids', 0)} reused idle, {kp['refused']} refused, "
            f"{kp['declined']} declined")
    if kp.get("last_refusal"):
        line += f" (last refusal {kp['last_refusal']})"
    lines = [line]
    if kp["state"] == "active" and "joins" in kp:
        lines.append("  opens that join a passed-through inode (writers, capped readers): " +
                     ("served by the daemon with direct_io, caps hold"
                      if kp["joins"] == "served" else f"uncapped: {kp['joins_reason']}"))
    for access in ("read", "write"):
        served = kp.get(f"served_{access}_joins") or {}
        if served:
            lines.append(f"  {access} opens that joined a passed-through inode, served by "
                         "the daemon: " + _by_class(served))
        joined = kp.get(f"uncapped_{access}_opens") or {}
        if joined:
            lines.append(f"  {access} opens that joined a passed-through inode uncapped: " +
                         _by_class(joined))
    escaped = kp.get("capped_uncapped_opens") or {}
    if escaped:
        lines.append("  of those, opens a cap bounded that went uncapped: " +
                     _by_class(escaped))
    return lines + format_read_counting(kp.get("read_counting"))


def format_read_counting(rc: dict[str, Any] | None) -> list[str]:
    """Whether the reads the kernel served are counted (into the classes' read bytes and
    ops), how much so far, and which classes' opens could not be, and why."""
    if not rc:
        return []
    if rc["state"] != "on":
        lines = [f"  reads served by the kernel: NOT COUNTED ({rc['reason']})"]
    else:
        total = sum(rc["read_bytes"].values())
        # Detached, the programs cost the machine's other reads nothing (read_probes).
        attached = "" if rc.get("attached", True) else " (programs detached until one is)"
        lines = [f"  reads served by the kernel: counted, {format_size(total)} in "
                 f"{sum(rc['reads'].values())} reads since mount, {rc['watched']} files "
                 f"watched now{attached}; {rc['reason']}"]
        if rc.get("lost_bytes"):
            lines.append(f"    {format_size(rc['lost_bytes'])} in {rc['lost_reads']} reads "
                         "lost: the kernel's table of counts was full")
    for cls, reasons in sorted(rc["uncounted_opens"].items()):
        for reason, n in sorted(reasons.items()):
            lines.append(f"    class {cls}: {n} opens passed through NOT COUNTED: {reason}")
    return lines


def _by_class(counts: dict[str, int]) -> str:
    return ", ".join(f"{cls} {n}" for cls, n in sorted(counts.items()))
