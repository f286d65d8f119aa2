"""libfuse's own ``passthrough_hp`` as a peer in the bench: building it and mounting it.

``passthrough_hp`` is libfuse's C++ "high-performance" example, built here from the same
source package as the libfuse the project links pyfuse3 to (``deploy/libfuse/build.sh``,
``make passthrough-hp``). Its modes, as the suites name them:

* ``hp-single``: one thread (``--single``), kernel passthrough off (``--nopassthrough``):
  a compiled daemon that serves every request, like qosfs's one Python thread;
* ``hp-multi``: libfuse's worker threads (its default), passthrough off;
* ``hp-passthrough``: one thread with kernel passthrough (its default): reads of an
  open file go from the kernel to the backing file, opens and lookups still reach it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.core.system import REPO, BenchError, unmount_and_reap

BUILD_DIR = REPO / "build" / "libfuse"
PEER_OPTIONS = {"hp-single": ("--single", "--nopassthrough"),
                "hp-multi": ("--nopassthrough",),
                "hp-passthrough": ("--single",)}


def build_peer() -> tuple[str | None, str | None]:
    """(passthrough_hp's path, None), or (None, why not) in one line. deploy/libfuse/build.sh
    builds it from the libfuse source the venv's library came from; it does nothing when
    the binary is up to date."""
    script = REPO / "deploy" / "libfuse" / "build.sh"
    try:
        proc = subprocess.run([str(script), sys.prefix, str(BUILD_DIR), "passthrough_hp"],
                              capture_output=True, text=True, timeout=1800, cwd=str(REPO))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"deploy/libfuse/build.sh passthrough_hp: {exc}"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines and os.access(lines[-1], os.X_OK):
        binary = Path(lines[-1]).resolve()
        # the report names it relative to the checkout, as the Makefile builds it
        return str(binary.relative_to(REPO) if binary.is_relative_to(REPO) else binary), None
    why = (proc.stderr or proc.stdout).strip().splitlines()
    return None, why[-1] if why else f"deploy/libfuse/build.sh exited {proc.returncode}"


@contextmanager
def peer_mount(binary: str, source: Path, mnt: Path, options: tuple[str, ...],
               log: Path) -> Iterator[int]:
    """passthrough_hp serving *source* on *mnt* (in the foreground, so its pid is ours);
    yields its pid, unmounts and waits for it on the way out."""
    mnt.mkdir(exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, "--foreground", *options, str(source), str(mnt)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                last = log.read_text(errors="replace").strip().splitlines()
                raise BenchError(f"passthrough_hp did not mount: "
                                 f"{last[-1] if last else 'no message'}")
            time.sleep(0.05)
        yield proc.pid
    finally:
        unmount_and_reap(mnt, proc, 10)


def refused_passthrough(log: Path) -> bool:
    """passthrough_hp said in its log that the kernel refused a passthrough open."""
    return log.exists() and "passthrough_open failed" in log.read_text(errors="replace")
