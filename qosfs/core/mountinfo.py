"""The kernel's table of mounts (``/proc/self/mountinfo``), parsed in one place.

The daemon reads it twice: at start, for the backing filesystem's type and options (by
device number), and at exit, for what is mounted on its mountpoint (by path, without a
system call on a mountpoint whose server may be gone).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MountEntry", "mounts"]

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True, slots=True)
class MountEntry:
    """One line of mountinfo: what the daemon needs of it."""

    dev: str  # "major:minor"
    mountpoint: str  # with the kernel's octal escapes (\\040 for a space) decoded
    options: frozenset[str]  # per-mount options: nosuid, nodev, noexec, ro...
    fstype: str


def mounts(path: str = MOUNTINFO) -> list[MountEntry]:
    """Every mount, in the kernel's order (a later one on the same path is on top);
    empty if the table cannot be read."""
    entries = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 6 or " - " not in line:
                    continue
                entries.append(MountEntry(
                    dev=fields[2],
                    mountpoint=fields[4].encode().decode("unicode_escape"),
                    options=frozenset(fields[5].split(",")),
                    fstype=line.split(" - ", 1)[1].split()[0],
                ))
    except OSError:
        return []
    return entries
