"""A checkpoint storm written by PyTorch itself: rank processes that save their state at a
fixed interval with ``torch.save`` and ``torch.distributed.checkpoint`` (dcp), both
synchronously and asynchronously.

Run as ``python -m bench.suites.training.ckpt_storm DIR --records OUT --stop FILE [options]`` (the
training suite starts it and stops it by creating FILE). ``--ranks`` processes join one
gloo process group (a ``file://`` rendezvous in OUT, no network) and each holds a state
dict of ``--shard`` bytes of float32 tensors under rank-specific names, so every rank
writes its own shard (dcp deduplicates tensors that ranks hold under the same name).

Every ``--interval`` seconds (start to start, as a trainer's checkpoint schedule) the
ranks agree on a round (a barrier, after which all start together) and save it the next
way of four, in turn:

- ``torch/sync``: ``torch.save(state, DIR/round-N-torch-sync/rank{r}.pt)``, the step waits;
- ``dcp/sync``: ``dcp.save(state, checkpoint_id=DIR/round-N-dcp-sync)``, the step waits;
- ``torch/async``: the state is copied (the staging a trainer does so that training may
  change its tensors) and a background thread runs ``torch.save`` of the copy;
- ``dcp/async``: ``dcp.async_save`` (torch's own staging and background thread); its
  future completes when the files are written.

Between rounds a rank "trains": it sleeps in steps of ``--step`` seconds. An asynchronous
save still running when the next round is due is waited for first (a trainer does the
same rather than run two saves of one state at once). Each rank appends one JSON line per
save to OUT/rank{r}.jsonl: round, kind, mode, bytes it wrote, wall-clock start and end,
``duration_s`` (start to files written) and ``blocked_s`` (how long the training loop
waited for it). OUT/ready appears when every rank holds its state and the first round
is --lead seconds away. A round two rounds old is deleted once the newer ones are done, as a
trainer keeping the last checkpoints does, so the storm's footprint stays bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

WAYS = (("torch", "sync"), ("dcp", "sync"), ("torch", "async"), ("dcp", "async"))
TENSOR_BYTES = 16 << 20  # one tensor per 16 MiB: a model's layers, not one blob


def _state(rank: int, shard: int) -> dict[str, Any]:
    import torch

    n, rest = divmod(shard, TENSOR_BYTES)
    sizes = [TENSOR_BYTES] * n + ([rest] if rest else [])
    return {f"rank{rank}.layer{i}": torch.rand(size // 4) for i, size in enumerate(sizes)}


def _bytes_in(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total


class _Pending:
    """An asynchronous save in flight: its record is written when it completes."""

    def __init__(self, record: dict[str, Any], files: list[Path]) -> None:
        self.record = record
        self.files = files
        self.done = threading.Event()
        self.error: str | None = None


def _rank(rank: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    top, out = Path(args.dir), Path(args.records)
    dist.init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank,
                            world_size=args.ranks)
    import torch

    state = _state(rank, args.shard)
    dist.barrier()
    if rank == 0:
        (out / "ready").touch()  # the first round starts --lead seconds from now
    log = open(out / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 (closed below)
    pending: _Pending | None = None
    t_start = time.monotonic()  # after the barrier: the same moment on every rank
    flag = torch.zeros(1)

    def finish(p: _Pending) -> None:
        p.done.wait()
        rec = p.record
        rec["bytes"] = _bytes_in(p.files)
        if p.error:
            rec["error"] = p.error
        log.write(json.dumps(rec) + "\n")

    try:
        for n in range(args.max_rounds):
            due = t_start + args.lead + n * args.interval
            while time.monotonic() < due:  # training steps
                time.sleep(min(args.step, max(0.0, due - time.monotonic())))
            flag[0] = 1.0 if should_stop(args, t_start) else 0.0
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag[0] > 0:
                break
            blocked0 = time.monotonic()
            if pending is not None:  # the previous asynchronous save must be done
                finish(pending)
                pending = None
            waited_prev = time.monotonic() - blocked0
            kind, mode = WAYS[n % len(WAYS)]
            where = top / f"round-{n:04d}-{kind}-{mode}"
            if rank == 0:
                where.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            files = [where / f"rank{rank}.pt"] if kind == "torch" else \
                [where / f"__{rank}_0.distcp"] + ([where / ".metadata"] if rank == 0 else [])
            rec: dict[str, Any] = {"rank": rank, "round": n, "kind": kind, "mode": mode,
                                   "shard_bytes": args.shard, "waited_previous_s": waited_prev}
            t0 = time.monotonic()
            rec["start"] = time.time()
            p = _Pending(rec, files)
            if mode == "sync":
                try:
                    if kind == "torch":
                        torch.save(state, files[0])
                    else:
                        dcp.save(state, checkpoint_id=str(where))
                except Exception as exc:
                    p.error = f"{type(exc).__name__}: {exc}"
                rec["end"] = time.time()
                rec["duration_s"] = rec["blocked_s"] = time.monotonic() - t0
                p.done.set()
                finish(p)
            elif kind == "torch":
                staged = {k: v.clone() for k, v in state.items()}

                def drain(p: _Pending = p, staged: dict[str, Any] = staged,
                          t0: float = t0) -> None:
                    try:
                        torch.save(staged, p.files[0])
                    except Exception as exc:
                        p.error = f"{type(exc).__name__}: {exc}"
                    p.record["end"] = time.time()
                    p.record["duration_s"] = time.monotonic() - t0
                    p.done.set()

                rec["blocked_s"] = time.monotonic() - t0
                threading.Thread(target=drain, daemon=True).start()
                pending = p
            else:
                future = dcp.async_save(state, checkpoint_id=str(where))
                rec["blocked_s"] = time.monotonic() - t0

                def done(fut: Any, p: _Pending = p, t0: float = t0) -> None:
                    exc = fut.exception()
                    if exc is not None:
                        p.error = f"{type(exc).__name__}: {exc}"
                    p.record["end"] = time.time()
                    p.record["duration_s"] = time.monotonic() - t0
                    p.done.set()

                future.add_done_callback(done)
                pending = p
            if rank == 0 and n >= 2:
                for old in top.glob(f"round-{n - 2:04d}-*"):
                    shutil.rmtree(old, ignore_errors=True)  # done: waited for above
        if pending is not None:
            finish(pending)
        dist.barrier()
    finally:
        log.close()
        dist.destroy_process_group()


def should_stop(args: argparse.Namespace, t_start: float) -> bool:
    """Whether the storm ends before its next round: its stop file is there, it ran
    ``--max-seconds``, or the process that started it (``--parent``) is gone. The last:
    a bench interrupted twice (Ctrl-C, then Ctrl-C in its cleanup) never creates the stop
    file, and the ranks went on writing 2 GiB rounds, parented to init, until the hour
    was up."""
    if Path(args.stop).exists() or time.monotonic() - t_start > args.max_seconds:
        return True
    if args.parent:
        try:
            os.kill(args.parent, 0)
        except ProcessLookupError:
            return True
    return False


def _spawned(rank: int, args: argparse.Namespace) -> None:
    _rank(rank, args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.suites.training.ckpt_storm",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="where the checkpoints go (under the mount's checkpoints/)")
    p.add_argument("--records", required=True, help="directory for rank*.jsonl")
    p.add_argument("--stop", required=True, help="the storm stops once this file exists")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--shard", type=int, default=256 << 20, help="bytes of state per rank")
    p.add_argument("--interval", type=float, default=8.0, help="seconds, start to start")
    p.add_argument("--lead", type=float, default=0.0, help="seconds before the first round")
    p.add_argument("--step", type=float, default=0.1, help="one training step, seconds")
    p.add_argument("--max-rounds", type=int, default=10_000)
    p.add_argument("--max-seconds", type=float, default=3600.0,
                   help="stop by itself after this long, stop file or not")
    p.add_argument("--parent", type=int, default=0,
                   help="stop once the process of this pid is gone (the bench's)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.records).mkdir(parents=True, exist_ok=True)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(args,), nprocs=args.ranks, join=True)
    return 0


def read_records(records: Path) -> list[dict[str, Any]]:
    """Every rank's records, in (round, rank) order."""
    out = []
    for path in sorted(records.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return sorted(out, key=lambda r: (r["round"], r["rank"]))


if __name__ == "__main__":
    sys.exit(main())
