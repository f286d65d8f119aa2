"""QoS: the engine that decides when a request may proceed. Imports only ``policy`` and
``core``; knows nothing of FUSE (the filesystem reaches it through ``interface``).

- ``interface``: what the filesystem sees of an engine.
- ``engine``: the engine of a policy, binding a classified open file to its chain of levels.
- ``flow``: a flow's chain of levels (class, tenant, uid), and admission through it.
- ``memo``: which flow a request gets: its classification, memoized on the inode.
- ``swap``: a policy put in force whole: levels kept or built, open files rebound.
- ``moves``: a charge moved after open: streaming writers, renamed files.
- ``balances``: bucket balances handed to a process that takes the mount over.
- ``charge``: the QoS bookkeeping of one open file, which the filesystem reports to.
- ``stats``: what an engine reports of itself, typed, for status, stats and metrics.
- ``levels``: rate levels and admission: FIFO waiting, live limit changes.
- ``store``: where levels come from (the in-process store) and the per-user split.
- ``bucket``: token-bucket arithmetic and the limit values buckets are built from.
- ``waiting``: the one way a request waits for tokens.
- ``bounds``: how many requests may wait at once, per uid, per class and in all.
- ``backend``: the declared ``[backend]``, shared out by minimums and priority.
- ``cluster``: caps over every mount, leased through Redis.
- ``accounting``: per-flow traffic counters and latency histograms.
- ``latency``: latency targets: the decider, its loop, and the canary that measures them.
- ``explanation``: what a request would get, and why (``qosfs explain`` asks it).

This file only describes the layer: import names from the module that defines them.
"""
