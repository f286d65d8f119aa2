"""Checkpoints written by real libraries land in the checkpoint class, capped, under the
embedded default policy (issue: classify what real training code writes).

Skipped when torch is not installed (``make test`` installs the ``libs`` extra).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qosfs.control.ctl import Client
from tests.mounting import BOTH_LAYOUTS, QosfsMount

pytest.importorskip("torch")
pytestmark = [pytest.mark.mount, pytest.mark.root]

MiB = 1 << 20
SIZE_MIB = 24
CAP_MIB = 16
BURST_MIB = 4

# Each step saves a 24 MiB tensor the way a training library does, prints its duration
# and waits for a line on stdin (so the test reads the counters between steps).
WRITERS = r"""
import json, os, sys, time, warnings
warnings.simplefilter("ignore")
import torch
# Imported before any step is timed: torch.distributed.checkpoint's import alone takes
# 0.6 s on a quiet machine and more under load, which the upper bound on a step's
# duration counted as the cap's.
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
root, size = sys.argv[1], int(sys.argv[2])
t = torch.ones(size // 4)

def step(name, fn):
    start = time.monotonic()
    fn()
    print(json.dumps({"name": name, "seconds": time.monotonic() - start}), flush=True)
    sys.stdin.readline()

os.makedirs(f"{root}/run1/checkpoints")
step("torch.save", lambda: torch.save(t, f"{root}/run1/checkpoints/step100.pt"))

def tmp_then_rename():
    torch.save(t, f"{root}/run1/model.pt.tmp")
    os.rename(f"{root}/run1/model.pt.tmp", f"{root}/run1/model.pt")
step("torch.save + rename", tmp_then_rename)

def save_pretrained_style():
    os.makedirs(f"{root}/run1/checkpoint-500")
    torch.save({"w": t}, f"{root}/run1/checkpoint-500/pytorch_model.bin")
step("save_pretrained-style", save_pretrained_style)

def distributed_checkpoint():
    dcp.save({"w": t}, checkpoint_id=f"{root}/run1/dcp")
step("dcp.save", distributed_checkpoint)

def orbax_like():
    tmp = f"{root}/ckpt_100.orbax-checkpoint-tmp-1234"
    os.makedirs(f"{tmp}/state/d")
    with open(f"{tmp}/state/d/0a1b2c3d", "wb") as f:
        f.write(t.numpy().tobytes())
    os.rename(tmp, f"{root}/ckpt_100")
step("orbax-like", orbax_like)

def safetensors_file():
    save_file({"w": t}, f"{root}/run1/model.safetensors")
step("safetensors", safetensors_file)
step("torch.save after safetensors",
     lambda: torch.save(t, f"{root}/run1/checkpoints/step200.pt"))
"""


def _writes(sock: Path, cls: str) -> int:
    with Client(str(sock)) as client:
        levels = client.request({"cmd": "status"})["levels"]
    return int(next(lv for lv in levels if lv["level"] == "class" and lv["name"] == cls)[
        "write_bytes"])


@BOTH_LAYOUTS
def test_real_checkpoint_writers_are_charged_to_checkpoints_and_capped(
        tmp_tree: Path, in_place: bool) -> None:
    src, sock = tmp_tree / "src", tmp_tree / "ctl.sock"
    mnt = src if in_place else tmp_tree / "mnt"
    src.mkdir()
    mnt.mkdir(exist_ok=True)
    (src / "data").mkdir()
    (src / "data" / "shard.pt").write_bytes(b"d" * MiB)
    results: dict[str, dict[str, Any]] = {}
    with QosfsMount(src, mnt, "--socket", str(sock)):  # the embedded default policy
        with Client(str(sock)) as client:
            reply = client.request({"cmd": "set", "target": "class", "name": "checkpoints",
                                    "changes": {"write_bandwidth": f"{CAP_MIB}MiB/s",
                                                "burst": f"{BURST_MIB}MiB"}})
        assert reply["ok"], reply
        proc = subprocess.Popen([sys.executable, "-c", WRITERS, str(mnt), str(SIZE_MIB * MiB)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            before = _writes(sock, "checkpoints")
            for line in proc.stdout:
                step = json.loads(line)
                after = _writes(sock, "checkpoints")
                step["checkpoint_mib"] = (after - before) / MiB
                results[step["name"]] = step
                before = after
                proc.stdin.write("\n")
                proc.stdin.flush()
        finally:
            proc.stdin.close()
            code = proc.wait(60)
            proc.stdout.close()
        assert code == 0
        # A .pt shard under data/ is read as a dataset, not as a checkpoint: its bytes
        # are the datasets class's, or, where the kernel reads it (passthrough), its open.
        seen = _dataset_reads(sock)
        assert (mnt / "data" / "shard.pt").read_bytes() == b"d" * MiB
        now = _dataset_reads(sock)
        assert now[0] > seen[0] or now[1] > seen[1], (seen, now)
    print(f"\n{json.dumps(results)}")
    expected_seconds = (SIZE_MIB - BURST_MIB) / CAP_MIB
    # safetensors writes ".tmpXXXXXX", whose final name is known only at the rename,
    # after the bytes: they go at once, are charged to checkpoints at the rename, and the
    # class's next save pays for both (the cap holds over successive saves).
    assert results["safetensors"]["checkpoint_mib"] >= SIZE_MIB, results
    assert results["torch.save after safetensors"]["seconds"] >= (
        2 * SIZE_MIB - BURST_MIB) / CAP_MIB * 0.85, results
    for name in ("torch.save", "torch.save + rename", "save_pretrained-style", "dcp.save",
                 "orbax-like"):
        step = results[name]
        assert step["checkpoint_mib"] >= SIZE_MIB, (name, results)
        # Capped: at least the time the cap allows (the bucket refills between steps).
        assert step["seconds"] >= expected_seconds * 0.85, (name, results)
        assert step["seconds"] <= expected_seconds * 1.15 + 1.0, (name, results)


def _dataset_reads(sock: Path) -> tuple[int, int]:
    """The datasets class's read bytes seen by the daemon, and its opens the kernel
    reads for (kernel passthrough: those bytes never reach the daemon)."""
    with Client(str(sock)) as client:
        status = client.request({"cmd": "status"})
    read_bytes = next(lv for lv in status["levels"] if lv["name"] == "datasets")["read_bytes"]
    return read_bytes, status["passthrough"]["opens"].get("datasets", 0)
