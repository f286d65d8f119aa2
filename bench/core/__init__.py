"""What every suite shares: one run's session, its report, the machine, fio and the mounts.

- ``context``: a suite's view of the run (``Run``): fio, scratch areas, mounts
- ``epochs``: a small-file data loader's epoch (loader and peer suites, coldscale, opcost)
- ``fuse_trace``: the kernel's FUSE requests to one mount, by opcode (tracepoint hist)
- ``fio``: running a fio job file and reading its figures
- ``floorfs``: the least a pyfuse3 daemon does, by one process or several (smallfiles, clones)
- ``handler_times``: the daemon's CPU in each FUSE handler (opcost --handlers)
- ``libfuse_peer``: libfuse's passthrough_hp: building it and mounting it
- ``plotting``: matplotlib, the helpers plots share, and drawing a run's plots
- ``registry``: what a suite and a subcommand are (``Suite``, ``Command``)
- ``report``: REPORT.md from one run's figures (pure rendering)
- ``sampler``: the daemon's counters sampled over time, and rates from them
- ``session``: one run: checks, scratch areas, suites in order, then figures, plots, report
- ``sides``: a workload on native and qosfs sides, medians and ratios (overhead, metadata)
- ``storm``: a dataset reader next to a checkpoint storm (isolation, storage, demo)
- ``system``: root, scratch tmpfs and disk areas, qosfs mounts, CPU and load figures
- ``tables``: cell formats, markdown tables, verdicts and the targets suites share
- ``typed``: frozen records read from and written to JSON, checked field by field
"""
