"""Metadata: create / stat / open / unlink rates of many small files (meta.fio), native vs
qosfs (``--no-qos`` and the generous policy of :mod:`bench.overhead`), and under a
``meta_iops`` cap.

Every timed operation is cold: meta.fio sleeps SETTLE s after fio's set-up (which stats
every file) so the kernel's 1 s entry/attribute cache has expired and every stat is a FUSE
LOOKUP, every create a negative LOOKUP + CREATE. Each FUSE metadata request costs one
``meta_iops`` token, so one file operation costs one to three: the capped side shows what
a cap does to each operation's rate. Whether the cap itself holds (admitted metadata
requests per second against ``meta_iops``) is measured with the other caps
(:mod:`bench.caps`), over runs long enough for 1 s windows.
"""

from __future__ import annotations

import os
import shutil

from bench import machinery
from bench.context import Run
from bench.figures import MetadataResult
from bench.overhead import NATIVE, NO_QOS, POLICY, Group, Row, Runner, Side, run_groups

# A second --no-qos mount: the same pass-through twice, so the report shows how far two
# identical mounts differ in one run (on a 2-vCPU VM, metadata rates of two identical
# mounts differed by up to 40% in interleaved runs, so a policy/no-qos ratio alone
# cannot resolve a 5% cost; the in-process figure of bench.machinery can).
NO_QOS_AGAIN = Side("no-qos-2", no_qos=True)
META_CAP = 2000  # FUSE metadata requests/s: below every uncapped rate measured here
META_CAP_POLICY = f"""
[classes.default]
meta_iops = {META_CAP}
"""
SECTIONS = ("create", "stat", "open", "delete")
FIO_ENGINES = ("filecreate", "filestat", "filedelete")  # what meta.fio needs of fio


class MetaRunner(Runner):
    def _kind_meta(self, group: Group, dirs: dict[str, str]) -> None:
        create, *rest = group.rows
        # discarded warm-up on every side (see Runner._run_rows): create and unlink a few
        warm = {**group.env, "NRFILES": "500", "SETTLE": "0"}
        for side, top in self.sides(group, dirs):
            os.mkdir(os.path.join(top, "warm-up"))
            for section in ("create", "delete"):
                self.measure("meta.fio", os.path.join(top, "warm-up"), warm,
                             self.mounts.get(side.name), (f"--section={section}",))
            shutil.rmtree(os.path.join(top, "warm-up"), ignore_errors=True)
        for rep in range(self.run.repetitions(group.reps)):
            sub = f"meta-{rep}"
            for d in dirs.values():
                os.mkdir(os.path.join(d, sub))
            sides = self.sides(group, dirs)
            for side, top in sides:
                self.record(group, create, side, self.measure(
                    "meta.fio", os.path.join(top, sub), group.env, self.mounts.get(side.name),
                    ("--section=create",)))
            # stat, open and delete need files of `filesize`: lay them out (untimed) on the
            # native side and copy them over the empty ones create made (the mounts forget
            # the old ones when caches drop and SETTLE passes).
            self.layout("meta.fio", group.env, dirs["native"], sub, ("--section=stat",))
            for row, section in zip(rest, SECTIONS[1:], strict=False):
                for side, top in sides:
                    self.record(group, row, side, self.measure(
                        "meta.fio", os.path.join(top, sub), group.env,
                        self.mounts.get(side.name), (f"--section={section}",)))
            for d in dirs.values():
                shutil.rmtree(os.path.join(d, sub), ignore_errors=True)


def run(run: Run) -> MetadataResult:
    nrfiles = int(run.pick(5000, 2000))
    capped = Side("meta-cap", META_CAP_POLICY)
    group = Group("meta", "meta", [
        Row("create", f"create {nrfiles} files", "iops"),
        Row("stat", f"stat {nrfiles} files", "iops"),
        Row("open", f"open + read 4 KiB + close {nrfiles} files", "iops"),
        Row("unlink", f"unlink {nrfiles} files", "iops"),
    ], sides=(NATIVE, NO_QOS, NO_QOS_AGAIN, POLICY, capped), reps=3,
        env={"NRFILES": str(nrfiles), "SETTLE": "1.5"})
    result = run_groups(run, [group], MetaRunner)
    result["in_process"] = machinery.measure(run.scratch("machinery"),
                                             POLICY.policy or "").to_json()
    result.update(nrfiles=nrfiles, meta_cap=META_CAP, policy=META_CAP_POLICY.strip())
    return MetadataResult.from_json(result)
