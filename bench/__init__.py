"""qosfs benchmarks: fio job files (``bench/jobs/``) and a runner (``python -m bench``).

Every figure is a ratio against a baseline measured in the same run (bench/README.md;
bench/ANALYSIS.md reads the headline). Layers, bottom to top (tests/architecture checks
them): ``core``, then ``suites``, then the modules here: the command line, the catalog
and the subcommands that run on their own terms. No module imports one of a layer above
it; a suite imports no other suite, a subcommand no other subcommand.

- ``__main__``: ``python -m bench SUITE [options]``, the command line
- ``catalog``: every suite and subcommand, listed once, in report order
- ``core/``: what the suites share: the session, the report, the scratch areas, fio
- ``suites/``: one module (or package) per suite: runner, record, headline, section, plots
- ``cluster``: two mounts sharing one cluster cap through Redis (``bench cluster``)
- ``coldscale``: cold small files on disk at 1/4/16 threads (``bench coldscale``)
- ``clones``: one FUSE connection served by 1 and 2 Python processes, a minimal
  pass-through filesystem beside bare (``bench clones``; docs/architecture.md)
- ``demo``: a one-minute look at what QoS does for a dataset reader (``bench demo``)
- ``latency_target``: a reader's latency target against an uncapped storm
- ``machinery``: per-request cost of admission and of the handlers, in-process
- ``opcost``: per-open cost of the small-file loader (``python -m bench.opcost``)
- ``probecost``: per-read cost of the read-counting BPF programs (``python -m bench.probecost``)
- ``soak``: mixed traffic and live changes for N minutes, then checks (``bench soak``)
- ``walkcost``: a `find` over a big tree, per entry (``python -m bench.walkcost``)
"""
