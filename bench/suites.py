"""Every benchmark suite, listed once: what ``python -m bench`` offers, what ``all`` runs,
and how each suite's figures become REPORT.md rows, sections and plots.

Two kinds of entry:

* :class:`Suite`: a suite of the report. Its runner takes the session's :class:`Run`
  (fio, scratch areas, mode) and returns its figures as a typed record
  (:mod:`bench.figures`); the report reads that record back from ``<stem>.json`` and
  renders its headline rows, its section and its plots. ``python -m bench all`` runs
  those with ``in_all``, in this order.
* :class:`Command`: a subcommand that runs on its own terms (its own mounts, its own
  output): ``demo``, ``machinery``, ``cluster``, ``latency-target``, ``coldscale``, ``soak`` and
  ``merge``. One with ``after_all`` also runs at the end of ``python -m bench all``,
  and the ``<name>.md`` it writes there is included in REPORT.md.

Adding a suite is adding an entry here (and its record, headline and section); nothing
else lists suites.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from bench import (
    caps,
    envelope,
    fairshare,
    headlines,
    isolation,
    live_change,
    loader,
    metadata,
    overhead,
    peer,
    plots,
    priorities,
    sections,
    storage,
    training,
    training_report,
)
from bench.context import Run
from bench.figures import (
    CapsResult,
    EnvelopeResult,
    FairshareResult,
    IsolationResult,
    LiveChangeResult,
    LoaderResult,
    MetadataResult,
    OverheadResult,
    PeerResult,
    PrioritiesResult,
    StorageResult,
    TrainingResult,
)
from bench.sections import Plots
from bench.system import REPO
from bench.typed import Record

R = TypeVar("R", bound=Record)
Rows = list[list[str]]


@dataclass(frozen=True)
class Suite(Generic[R]):
    """A suite of the report (see the module docstring)."""

    name: str
    about: str  # one line, for --help
    runner: Callable[[Run], R]
    result: type[R]  # what the runner returns and <stem>.json holds for it
    headline: Callable[[R], Rows]  # (what, figure, target, result) rows
    section: Callable[[Plots, R], list[str]]  # its part of REPORT.md
    plots: tuple[tuple[str, Callable[[Any, R, Path, str], str]], ...] = ()
    in_all: bool = True  # run by `python -m bench all` (make bench, make bench-quick)
    # why this machine cannot run it (given fio's path), or None
    unavailable: Callable[[str], str | None] = lambda fio: None

    def load(self, data: Any, where: str) -> R:
        """The suite's record from JSON; ResultMismatch (naming *where* and the field)
        when the data does not have its shape."""
        return self.result.from_json(data, where)


@dataclass(frozen=True)
class Command:
    """A subcommand that runs on its own (see the module docstring)."""

    name: str
    about: str
    run: Callable[[argparse.Namespace], int]
    options: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    after_all: bool = False  # `all` runs it last; its <name>.md joins REPORT.md
    # SIGTERM unwinds it like Ctrl-C (unmount, write what was measured); the others
    # clean up in their own way and are left the default action
    unwinds_on_sigterm: bool = True


def _meta_engines(fio: str) -> str | None:
    from bench.fio import missing_engines

    missing = missing_engines(fio, metadata.FIO_ENGINES)
    return f"fio lacks the {', '.join(missing)} engine(s)" if missing else None


# In report order.
SUITES: tuple[Suite[Any], ...] = (
    Suite[OverheadResult](
        "overhead", "native vs qosfs --no-qos vs qosfs with a policy far above demand",
        overhead.run, OverheadResult, headlines.overhead, sections.section_overhead,
        (("overhead", plots.overhead),)),
    Suite[CapsResult](
        "caps", "bandwidth and IOPS caps: achieved vs configured, per 10 s and per 1 s",
        caps.run, CapsResult, headlines.caps, sections.section_caps,
        (("caps", plots.caps),)),
    Suite[IsolationResult](
        "isolation", "a dataset reader alone / next to a checkpoint storm, without and "
        "with QoS", isolation.run, IsolationResult, headlines.isolation,
        sections.section_isolation,
        (("isolation", plots.isolation), ("isolation-burst", plots.isolation_burst))),
    Suite[LiveChangeResult](
        "live-change", "how fast a `qosfs ctl set` (or reload) is in force",
        live_change.run, LiveChangeResult, headlines.live_change, sections.section_live,
        (("live-change", plots.live_change),)),
    Suite[FairshareResult](
        "fairshare", "three uids sharing a per_user = \"fair\" class",
        fairshare.run, FairshareResult, headlines.fairshare, sections.section_fair,
        (("fairshare", plots.fairshare),)),
    Suite[MetadataResult](
        "metadata", "create/stat/open/unlink rates, and under a meta_iops cap",
        metadata.run, MetadataResult, headlines.metadata, sections.section_meta,
        (("metadata", plots.metadata),), unavailable=_meta_engines),
    Suite[PrioritiesResult](
        "priorities", "a declared backend shared by priority and min_write_bandwidth",
        priorities.run, PrioritiesResult, headlines.priorities, sections.section_prio,
        (("priorities", plots.priorities),)),
    Suite[LoaderResult](
        "loader", "a data loader's samples/s (cold, cached) and a cached re-read, native "
        "vs qosfs", loader.run, LoaderResult, headlines.loader, sections.section_loader),
    Suite[StorageResult](
        "storage", "the demo's reader and storm sharing a disk: bare, --no-qos, default "
        "policy", storage.run, StorageResult, headlines.storage, sections.section_storage),
    Suite[EnvelopeResult](
        "envelope", "what one mount carries (small/large reads, metadata), and a "
        "do-nothing floor", envelope.run, EnvelopeResult, headlines.envelope,
        sections.section_envelope),
    Suite[PeerResult](
        "peer", "libfuse's passthrough_hp (1 thread, threads, kernel passthrough) beside "
        "native and qosfs: fio and small files on tmpfs, small files on disk",
        peer.run, PeerResult, headlines.peer, sections.section_peer),
    Suite[TrainingResult](
        "training", "MLPerf Storage's AU: DLIO's emulated training under a PyTorch "
        "checkpoint storm (torch.save, dcp), bare / --no-qos / default policy / latency "
        "target", training.run, TrainingResult, training_report.headline,
        training_report.section, (("training", plots.training),),
        unavailable=lambda fio: training.missing()),
)


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
    from bench.session import merge

    print(f"wrote {merge(args.part, args.out)}")
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
    Command("soak", "mixed readers, writers, metadata and ctl changes for N minutes, "
            "then checks", _soak, _soak_options),
    Command("merge", "add a suite run on its own (its .json) to REPORT.md, marked with "
            "its own date and commit", _merge, _merge_options),
)

BY_NAME: dict[str, Suite[Any]] = {s.name: s for s in SUITES}
COMMANDS_BY_NAME: dict[str, Command] = {c.name: c for c in COMMANDS}
