"""The policy's key vocabulary: which keys a class, a tenant and ``[cluster]`` take, which
a live ``ctl set`` may change, and the values some of them allow.

Plain tuples and dicts, apart from :mod:`qosfs.policy.model`'s dataclasses: ``qosfs ctl
status`` reads them to show a class's settings and what it matches, and must not pay for
importing the model (issue 38).
"""

from __future__ import annotations

from qosfs.core.limit_kinds import BURST_KEYS, CAP_KEYS

#: Every key of a limits table: the caps of the table of limit kinds, then their bursts.
LIMIT_KEYS = (*CAP_KEYS, *BURST_KEYS)
MATCH_KEYS = ("paths", "uids", "gids", "tenants", "ops", "job_env", "jobs", "cgroups")
CLASS_SETTINGS = ("priority", "min_read_bandwidth", "min_write_bandwidth", "per_user", "scope",
                  "cache", "passthrough",
                  "target_read_latency", "target_read_slowdown", "latency_percentile",
                  "latency_measure", "detect_streaming_writes", "entry_timeout",
                  "attr_timeout")
CLASS_KEYS = (*MATCH_KEYS, *CLASS_SETTINGS, *LIMIT_KEYS)
TENANT_KEYS = ("uids", "gids", "paths", "cgroups", "job_env", "jobs", "scope", *LIMIT_KEYS)
#: Where a level's caps hold: on this mount ("node") or summed over every mount sharing
#: the [cluster] Redis ("cluster").
SCOPES = ("node", "cluster")
CLUSTER_KEYS = ("redis", "password_file", "password_env", "key_prefix", "lease", "fallback")
SETTABLE = {"backend": LIMIT_KEYS, "tenant": LIMIT_KEYS,
            "class": (*LIMIT_KEYS, "min_read_bandwidth", "min_write_bandwidth", "priority",
                      "per_user", "cache", "passthrough", "target_read_latency",
                      "target_read_slowdown",
                      "latency_percentile",
                      "latency_measure", "detect_streaming_writes", "entry_timeout",
                      "attr_timeout")}
PRIORITY_WEIGHTS = {"low": 1, "normal": 10, "high": 100}
OPS = ("read", "write", "meta")
CACHE_MODES = ("auto", "keep", "direct", "direct-writes")
#: ``passthrough``: "auto" (the default) lets the kernel read the backing file itself for
#: read-only opens of a class whose reads nothing keeps in the daemon; "reads" is its older
#: spelling and means the same; "off" keeps every read in the daemon (docs/policy.md,
#: "Kernel passthrough, per class"; :func:`qosfs.policy.model.passthrough_blocker`).
PASSTHROUGH_MODES = ("auto", "reads", "off")
LATENCY_MEASURES = ("request", "backend")
MAX_ID = 2**32 - 1
