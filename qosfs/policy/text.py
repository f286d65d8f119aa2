"""Policy TOML as text: rendering, quoting, finding a key's line, the default policy.

Kept apart from the model and the parser because none of it needs either: it works on
the plain dicts ``tomllib`` produces and on source text.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

_BARE = re.compile(r"[A-Za-z0-9_-]+")
_KEY_PART = re.compile(r'\s*(?:([A-Za-z0-9_-]+)|"((?:[^"\\]|\\.)*)"|\'([^\']*)\')\s*(\.)?')


def quote_key(part: str) -> str:
    return part if _BARE.fullmatch(part) else toml_str(part)




def toml_str(text: str) -> str:
    """A TOML basic string; unlike JSON, TOML forbids raw DEL and surrogate escapes."""
    body = json.dumps(text, ensure_ascii=False)[1:-1].replace("\x7f", "\\u007f")
    return f'"{body}"'


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return toml_str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)  # int, or a finite float (repr keeps the ".0")


def dump_toml(raw: dict[str, Any], source: str) -> str:
    shown = "".join(ch if ch.isprintable() else "?" for ch in source)
    lines = [f"# qosfs policy, resolved from {shown}"]
    sections: list[tuple[str, dict[str, Any]]] = [
        (top, raw[top]) for top in ("backend", "control", "metrics", "cluster") if top in raw]
    sections += [(f"{top}.{name}", table) for top in ("tenants", "classes")
                 for name, table in raw.get(top, {}).items()]
    for header, table in sections:
        lines += ["", f"[{header}]", *(f"{k} = {_toml_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"




def split_key(text: str) -> tuple[str, ...] | None:
    """``a."b.c".d`` -> ``("a", "b.c", "d")``; None if it does not look like a TOML key."""
    parts: list[str] = []
    pos = 0
    while match := _KEY_PART.match(text, pos):
        bare, basic, literal = match[1], match[2], match[3]
        if basic is not None:
            with contextlib.suppress(ValueError):  # TOML's escapes are JSON's, \U and \e aside
                basic = json.loads(f'"{basic}"')
        parts.append(bare if bare is not None else basic if basic is not None else literal)
        pos = match.end()
        if match[4] is None:
            return tuple(parts) if pos == len(text) else None
    return None


def locate_key(text: str, key: str | None, *, within: int = 1) -> int | None:
    """Best-effort line of ``key`` (or of its nearest enclosing table) in the source text;
    an enclosing table counts only if it has at least *within* parts (2 for
    ``classes.NAME.paths``: that class's table, never the first ``[classes.*]``)."""
    target = None if key is None else split_key(key)
    if not target:
        return None
    found: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.split("\n"), 1):  # TOML's newlines, not str's
        stripped = line.strip()
        header = re.fullmatch(r"\[\s*([^\[\]]+?)\s*\]\s*(?:#.*)?", stripped)
        if header:
            table = split_key(header[1]) or ("\0",)
            key_path = table
        elif assignment := re.match(r"((?:[^=\"']|\"[^\"]*\"|'[^']*')+?)\s*=", stripped):
            key_path = table + (split_key(assignment[1]) or ("\0",))
        else:
            continue
        for size in range(1, len(key_path) + 1):  # [a.b] also declares a
            found.setdefault(key_path[:size], number)
    for size in range(len(target), within - 1, -1):
        if target[:size] in found:
            return found[target[:size]]
    return None




DEFAULT_POLICY_TEXT = """\
# qosfs default policy: what `qosfs mount` uses without --policy.
# Print it with `qosfs policy default`, copy it to /etc/qosfs/<name>.toml, edit, then check
# it with `qosfs check FILE`. A request belongs to the first class (in file order) whose
# criteria all match; every request is counted, only capped classes ever wait.

# Declare what the storage delivers to enable guarantees (min_read_bandwidth, ...) and to
# let priorities share a contended backend:
# [backend]
# read_bandwidth = "4GiB/s"
# write_bandwidth = "2GiB/s"

# Tenants group users; their caps hold over all of their traffic:
# [tenants.team-a]
# uids = ["1000-1999"]
# write_bandwidth = "1GiB/s"

# Kernel passthrough, in every class: where no cap covers a class's reads, the kernel
# reads the backing file itself for read-only opens (kernel FUSE passthrough, where the
# kernel and the daemon allow it): native speed for data loaders, for fio on any file
# name, and for restoring a checkpoint (reads of *.pt fall through checkpoints, which
# takes writes only). The daemon sees the opens; the kernel's reads are counted by BPF
# programs where the backing filesystem allows (ctl status says). A read cap (the class's,
# per_user, a tenant's, [backend]'s) or a latency target measured as "backend" keeps the
# opens it covers in the daemon; passthrough = "off" in a class keeps its reads there.

# Checkpoint dumps: hundreds of ranks writing at once starve the data loaders, so writes
# are capped. Reading a checkpoint back is not capped (reads fall through to the classes
# below: a .pt shard under data/ is a dataset). Temporary names of atomic saves
# ("model.pt.tmp", ".metadata.tmp", "ckpt-1.index.tempstate8812",
# "*.orbax-checkpoint-tmp-N/") take the class of the name they will get; writers no name
# reveals are caught by detect_streaming_writes. ("a/**" matches a file "a" too.)
[classes.checkpoints]
paths = [
    # Checkpoint directories (PyTorch Lightning, NeMo, Hugging Face, Flax, yours)
    "**/checkpoints/**", "**/checkpoint/**", "**/ckpt/**", "**/ckpts/**",
    "**/checkpoint-*/**", "**/checkpoint_*/**",
    # PyTorch, safetensors, torch.distributed.checkpoint, Lightning, NeMo
    "**/*.pt", "**/*.pth", "**/*.safetensors", "**/*.distcp", "**/.metadata", "**/*.ckpt",
    "**/*.nemo",
    # TensorFlow (data shards, index, Estimator's model.ckpt-N.*, SavedModel), Keras 3
    "**/*.data-?????-of-?????", "**/ckpt-*.index", "**/*.ckpt-*",
    "**/*_temp/part-?????-of-?????.*", "**/variables/variables.*", "**/*.keras",
    "**/*.weights.h5",
    # JAX: Orbax (written under a temporary name, then renamed) and its OCDBT files
    "**/*.orbax-checkpoint-tmp-*/**", "**/_CHECKPOINT_METADATA", "**/_METADATA",
    "**/_sharding", "**/*.ocdbt", "**/ocdbt.process_*/**",
    "**/d/????????????????????????????????",
]
ops = ["write"]
write_bandwidth = "400MiB/s"
burst = "64MiB"          # bucket depth: a short dump this size goes through at full speed
# A writer of an uncapped class that streams this much, mostly sequentially, moves here:
# checkpoint dumps are the largest sequential writers, whatever their names.
detect_streaming_writes = "256MiB"
# per_user = "fair"      # give each writing uid an equal share of the 400MiB/s
# cache = "auto"         # while capped, write-only opens (torch.save...) bypass the page
                         # cache; "direct-writes" for writers that open read-write

# Training data: never throttled here, and first in line when the backend is contended.
[classes.datasets]
paths = [
    "data/**", "datasets/**", "**/*.parquet", "**/*.arrow", "**/*.tfrecord*", "**/*.tar",
    "**/*.mds", "**/*.npy", "**/*.h5", "**/*.hdf5", "**/*.jsonl",
]
# Reading, and the metadata requests of reading: a file written in a dataset's format is
# not protected while it is written (np.save of an optimizer state, a Keras .weights.h5,
# a dataset being prepared). Such writes fall through to default, where a stream still
# moves to checkpoints. An open for reading and writing (O_RDWR) counts as a write.
ops = ["read", "meta"]
priority = "high"
# A dataset does not change while a job reads it: the kernel may trust its names and
# attributes for a minute, which saves a data loader a lookup and a getattr per sample.
# Changes made through this mount are seen at once, new files within a second, changes
# made underneath (by another node) within the minute.
entry_timeout = "60s"
attr_timeout = "60s"
# Protected against whatever this machine's bottleneck is (the storage, the network, the
# daemon's CPU): while dataset reads take more than 1.3x what they take when the classes
# below are quiet, those classes are capped automatically, under their own caps.
target_read_slowdown = 1.3
# min_read_bandwidth = "1GiB/s"   # a guaranteed share; needs [backend] read_bandwidth

# Everything else: counted, not capped.
[classes.default]
"""
