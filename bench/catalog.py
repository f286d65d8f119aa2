"""Every benchmark suite and subcommand, listed once: what ``python -m bench`` offers,
what ``all`` runs, and in which order the report shows the suites.

* A :class:`~bench.core.registry.Suite` of the report (``bench/suites/``): its runner,
  its record, its headline rows, its section and its plots, all from its own module.
  ``python -m bench all`` runs those with ``in_all``, in this order.
* A :class:`~bench.core.registry.Command` (a module of ``bench/`` itself) runs on its own
  terms (its own mounts, its own output): ``demo``, ``machinery``, ``cluster``,
  ``latency-target``, ``coldscale``, ``soak`` and ``merge``. One with ``after_all`` also
  runs at the end of ``python -m bench all``, and the ``<name>.md`` it writes there is
  included in REPORT.md.

Adding a suite is adding its module under ``bench/suites/`` and an entry here; nothing
else lists suites.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.core.registry import Command, Suite, Suites
from bench.core.system import REPO
from bench.suites import (
    caps,
    envelope,
    fairshare,
    isolation,
    loader,
    metadata,
    overhead,
    peer,
    priorities,
    smallfiles,
    storage,
    uncapped,
)
from bench.suites.live_change import live_report, writes
from bench.suites.training import au_report, workload


def _meta_engines(fio: str) -> str | None:
    from bench.core.fio import missing_engines

    missing = missing_engines(fio, metadata.FIO_ENGINES)
    return f"fio lacks the {', '.join(missing)} engine(s)" if missing else None


# In report order.
SUITES: tuple[Suite[Any], ...] = (
    Suite[overhead.OverheadResult](
        "overhead", "native vs qosfs --no-qos vs qosfs with a policy far above demand",
        overhead.run, overhead.OverheadResult, overhead.headline, overhead.section,
        (("overhead", overhead.chart),)),
    Suite[caps.CapsResult](
        "caps", "bandwidth and IOPS caps: achieved vs configured, per 10 s and per 1 s",
        caps.run, caps.CapsResult, caps.headline, caps.section, (("caps", caps.chart),)),
    Suite[isolation.IsolationResult](
        "isolation", "a dataset reader alone / next to a checkpoint storm, without and "
        "with QoS", isolation.run, isolation.IsolationResult, isolation.headline,
        isolation.section,
        (("isolation", isolation.chart), ("isolation-burst", isolation.burst_chart))),
    Suite[live_report.LiveChangeResult](
        "live-change", "how fast a `qosfs ctl set` (or reload) is in force",
        writes.run, live_report.LiveChangeResult, live_report.headline,
        live_report.section, (("live-change", live_report.chart),)),
    Suite[fairshare.FairshareResult](
        "fairshare", "three uids sharing a per_user = \"fair\" class",
        fairshare.run, fairshare.FairshareResult, fairshare.headline, fairshare.section,
        (("fairshare", fairshare.chart),)),
    Suite[metadata.MetadataResult](
        "metadata", "create/stat/open/unlink rates, and under a meta_iops cap",
        metadata.run, metadata.MetadataResult, metadata.headline, metadata.section,
        (("metadata", metadata.chart),), unavailable=_meta_engines),
    Suite[priorities.PrioritiesResult](
        "priorities", "a declared backend shared by priority and min_write_bandwidth",
        priorities.run, priorities.PrioritiesResult, priorities.headline,
        priorities.section, (("priorities", priorities.chart),)),
    Suite[loader.LoaderResult](
        "loader", "a data loader's samples/s (cold, cached) and a cached re-read, native "
        "vs qosfs", loader.run, loader.LoaderResult, loader.headline, loader.section),
    Suite[storage.StorageResult](
        "storage", "the demo's reader and storm sharing a disk: bare, --no-qos, default "
        "policy", storage.run, storage.StorageResult, storage.headline, storage.section),
    Suite[envelope.EnvelopeResult](
        "envelope", "what one mount carries (small/large reads, metadata), and a "
        "do-nothing floor", envelope.run, envelope.EnvelopeResult, envelope.headline,
        envelope.section),
    Suite[peer.PeerResult](
        "peer", "libfuse's passthrough_hp (1 thread, threads, kernel passthrough) beside "
        "native and qosfs: fio and small files on tmpfs, small files on disk",
        peer.run, peer.PeerResult, peer.headline, peer.section),
    Suite[smallfiles.SmallfilesResult](
        "smallfiles", "small files on tmpfs and disk, 1/4/16 threads, cold and warm: bare, "
        "passthrough_hp (3 modes), --no-qos, default policy; ratios, FUSE requests and "
        "daemon CPU per file", smallfiles.run, smallfiles.SmallfilesResult,
        smallfiles.headline, smallfiles.section, (("smallfiles", smallfiles.chart),)),
    Suite[uncapped.UncappedResult](
        "uncapped", "reads no cap limits on tmpfs and disk: fio on a generic name and a "
        "torch.load restore, bare vs qosfs; ctl stats' count of the kernel's reads; the "
        "counting's cost", uncapped.run, uncapped.UncappedResult, uncapped.headline,
        uncapped.section),
    Suite[au_report.TrainingResult](
        "training", "MLPerf Storage's AU: DLIO's emulated training under a PyTorch "
        "checkpoint storm (torch.save, dcp), bare / --no-qos / default policy / latency "
        "target", workload.run, au_report.TrainingResult, au_report.headline,
        au_report.section, (("training", au_report.chart),),
        unavailable=lambda fio: workload.missing()),
)

BY_NAME: Suites = {s.name: s for s in SUITES}


def _demo(args: argparse.Namespace) -> int:
    from bench import demo

    return demo.run()


def _machinery(args: argparse.Namespace) -> int:
    from bench import machinery

    return machinery.run()


def _cluster(args: argparse.Namespace) -> int:
    from bench import cluster

    return cluster.run()


def _latency_target_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="shorter phases (about 40 s)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results",
                   help="directory for latency-target.md and .json (default: bench/results)")


def _latency_target(args: argparse.Namespace) -> int:
    from bench import latency_target

    return latency_target.run(args.out, quick=args.quick)


def _coldscale_options(p: argparse.ArgumentParser) -> None:
    from bench import coldscale

    coldscale.options(p)


def _coldscale(args: argparse.Namespace) -> int:
    from bench import coldscale

    return coldscale.run(args)


def _clones_options(p: argparse.ArgumentParser) -> None:
    from bench import clones

    clones.options(p)


def _clones(args: argparse.Namespace) -> int:
    from bench import clones

    return clones.run_command(args)


def _soak_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--out", type=Path, help="directory for soak.md and soak.json "
                   "(default: bench/results)")


def _soak(args: argparse.Namespace) -> int:
    from bench import soak

    return soak.run(args.out or soak.default_out(), args.minutes)


def _merge_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("part", type=Path, help="the suite's figures, e.g. bench/results/"
                   "training.json")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results",
                   help="directory of REPORT.json and REPORT.md (default: bench/results)")


def _merge(args: argparse.Namespace) -> int:
    from bench.core.session import merge

    print(f"wrote {merge(args.part, args.out, BY_NAME)}")
    return 0


COMMANDS: tuple[Command, ...] = (
    Command("demo", "a one-minute look at what QoS does for a dataset reader: alone, "
            "under a storm, with QoS", _demo, unwinds_on_sigterm=False),
    Command("machinery", "per-request cost of admission and of the metadata and data "
            "handlers, in-process (no mount; about a minute)", _machinery,
            unwinds_on_sigterm=False),
    Command("cluster", "two mounts sharing one cluster cap through Redis, and what the "
            "lease script costs Redis (about a minute)", _cluster, unwinds_on_sigterm=False),
    Command("latency-target", "a reader's latency target held against an uncapped "
            "checkpoint storm", _latency_target, _latency_target_options, after_all=True),
    Command("coldscale", "cold small files on disk at 1/4/16 threads: bare, --no-qos "
            "and the default policy, with ratios; flags a side that gets slower with more "
            "threads", _coldscale, _coldscale_options),
    Command("clones", "one FUSE connection served by 1 and 2 Python processes "
            "(FUSE_DEV_IOC_CLONE), a minimal pass-through filesystem beside bare: what a "
            "second core gives a small-file loader here", _clones, _clones_options),
    Command("soak", "mixed readers, writers, metadata and ctl changes for N minutes, "
            "then checks", _soak, _soak_options),
    Command("merge", "add a suite run on its own (its .json) to REPORT.md, marked with "
            "its own date and commit", _merge, _merge_options),
)

COMMANDS_BY_NAME: dict[str, Command] = {c.name: c for c in COMMANDS}
