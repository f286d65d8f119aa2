"""The suites of the report, one module each (a package for the larger ones): each holds
its runner, the record its figures are kept in, its headline rows, its REPORT.md section
and its plots. They import ``bench.core`` only, never each other; ``bench.catalog`` lists
them.

- ``caps``: bandwidth and IOPS caps, achieved against configured
- ``envelope``: what one mount carries, and a do-nothing pyfuse3 floor
- ``fairshare``: three uids sharing a ``per_user = "fair"`` class
- ``isolation``: a dataset reader alone and next to a checkpoint storm
- ``live_change/``: how fast ``qosfs ctl set`` (or a reload) is in force
- ``loader``: a data loader's samples/s, native against qosfs
- ``metadata``: create/stat/open/unlink rates, under a cap, and their in-process cost
- ``overhead``: native against qosfs ``--no-qos`` against a policy far above demand
- ``peer``: libfuse's passthrough_hp beside native and qosfs
- ``priorities``: a declared backend shared by priority and minimums
- ``smallfiles``: small files through bare, passthrough_hp and qosfs, with FUSE requests
  per file
- ``storage``: the demo's reader and storm on a disk
- ``training/``: MLPerf Storage's AU under a PyTorch checkpoint storm (DLIO)
- ``uncapped``: reads no cap limits (fio, a torch.load restore) passed through and counted
"""
