"""What every suite of one benchmark run shares: fio, the scratch areas, the mode, and a
way to mount qosfs over a scratch directory with a scenario's policy.

A suite gets a :class:`Run` and returns its figures as a record (defined in its module
under ``bench/suites/``); it never writes the report itself, so ``python -m bench all``
and a single suite render the same way (:mod:`bench.core.report`). Mountpoints, sockets,
policy files and daemon logs live in ``work/`` on the scratch tmpfs, so nothing outlives
the run.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.core.system import QosfsMount

Log = Callable[[str], None]


def stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class Mounted:
    """A running qosfs mount: where it is, its control socket, its policy file."""

    mount: QosfsMount
    path: Path  # the mountpoint
    socket: str
    policy_file: Path | None


@dataclass
class Run:
    """One benchmark run: its settings and its scratch areas (see the module docstring)."""

    fio: str
    quick: bool
    tmpfs: Path  # scratch tmpfs (the memory-speed backing store)
    disk: Path | None  # scratch directory on a disk-backed filesystem, if any
    reps: int | None = None  # overrides every suite's repetitions
    quiet_wait: float = 2.0
    qosfs_args: tuple[str, ...] = ()
    log: Log = stderr_log
    _ids: Iterator[int] = field(default_factory=itertools.count)

    @property
    def work(self) -> Path:
        path = self.tmpfs / "work"
        path.mkdir(exist_ok=True)
        return path

    def pick(self, full: float, quick: float) -> float:
        """A duration or size: *quick* in quick mode, else *full*."""
        return quick if self.quick else full

    def repetitions(self, full: int, quick: int = 1) -> int:
        return self.reps if self.reps is not None else (quick if self.quick else full)

    def scratch(self, name: str, area: str = "tmpfs") -> Path:
        """A fresh, empty directory *name* on the tmpfs or the disk area."""
        top = self.disk if area == "disk" else self.tmpfs
        if top is None:
            raise ValueError("no disk area in this run")
        path = top / f"{name}-{next(self._ids)}"
        path.mkdir(mode=0o755)
        return path

    @contextmanager
    def mount(self, source: Path, policy: str | None = None, *, no_qos: bool = False,
              extra: tuple[str, ...] = ()) -> Iterator[Mounted]:
        """qosfs over *source*: with *policy* (TOML text), ``--no-qos``, or (neither) the
        embedded default policy. Unmounted on the way out, errors included."""
        n = next(self._ids)
        mnt = self.work / f"mnt-{n}"
        mnt.mkdir()
        sock = str(self.work / f"ctl-{n}.sock")
        args = ["--socket", sock, *self.qosfs_args, *extra]
        policy_file = None
        if no_qos:
            args.append("--no-qos")
        elif policy is not None:
            policy_file = self.work / f"policy-{n}.toml"
            policy_file.write_text(policy)
            args += ["--policy", str(policy_file)]
        with QosfsMount(str(source), str(mnt), args, str(self.work / f"qosfs-{n}.log")) as m:
            yield Mounted(m, mnt, sock, policy_file)
        try:
            mnt.rmdir()
        except OSError:
            pass
