"""Checkpoints and datasets written the way TensorFlow/Keras, NeMo, Lightning and JAX code
writes them: the names, temporary names and renames of each library, with the libraries
that install here (h5py, numpy, torch) doing the writing where they can.

Used by tests/mount/test_framework_checkpoints.py (small files, class charged, bytes
intact) and run as a script to measure what each save costs through a mount of the
embedded default policy with the checkpoint cap lowered::

    python -m tests.mount.framework_writers [--mib 96] [--cap-mib 32]

Each writer takes the root to write under and the array to save, and returns the path
(relative to the root) of what it wrote: a file or a directory.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

Writer = Callable[[Path, np.ndarray], str]
MiB = 1 << 20


def payload(nbytes: int, seed: int = 0) -> np.ndarray:
    """Float32 values that differ from byte to byte, so a misplaced block shows."""
    return np.random.default_rng(seed).random(nbytes // 4, dtype=np.float32)


def _parent(root: Path, rel: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def keras_weights(rel: str) -> Writer:
    """Keras 3 ``model.save_weights("….weights.h5")`` (and ModelCheckpoint with
    ``save_weights_only``): ``h5py.File(path, "w")``, an O_RDWR create, one group per layer."""
    def write(root: Path, arr: np.ndarray) -> str:
        import h5py

        with h5py.File(_parent(root, rel), "w") as f:
            f.attrs["keras_version"] = "3.6.0"
            f.create_group("layers/dense/vars").create_dataset("0", data=arr)
        return rel
    return write


def numpy_save(rel: str) -> Writer:
    """``np.save``: an O_WRONLY create of the final name."""
    def write(root: Path, arr: np.ndarray) -> str:
        np.save(_parent(root, rel), arr)
        return rel
    return write


def tf_checkpoint(prefix: str) -> Writer:
    """``tf.train.Checkpoint.save`` / ``CheckpointManager`` (TF 2): each shard is written by
    a BundleWriter under ``<prefix>_temp/part-00000-of-00001`` to ``….tempstate<random>``
    and renamed when complete; MergeV2Checkpoints then moves the data shard to
    ``<prefix>.data-00000-of-00001``, writes ``<prefix>.index`` and removes the temp
    directory; the manager rewrites the ``checkpoint`` state file atomically
    (``checkpoint.tmp<uuid hex>``, renamed)."""
    def write(root: Path, arr: np.ndarray) -> str:
        final = _parent(root, prefix)
        temp = Path(f"{final}_temp")
        temp.mkdir()
        part = temp / "part-00000-of-00001"
        for suffix, data in ((".data-00000-of-00001", arr.tobytes()),
                             (".index", b"\x00tensor-bundle-index" * 64)):
            tmp = f"{part}{suffix}.tempstate{random.getrandbits(64)}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.rename(tmp, f"{part}{suffix}")
        os.rename(f"{part}.data-00000-of-00001", f"{final}.data-00000-of-00001")
        Path(f"{final}.index").write_bytes(Path(f"{part}.index").read_bytes())
        os.unlink(f"{part}.index")
        temp.rmdir()
        state = final.parent / "checkpoint"
        tmp = f"{state}.tmp{uuid.uuid4().hex}"
        Path(tmp).write_text(f'model_checkpoint_path: "{final.name}"\n'
                             f'all_model_checkpoint_paths: "{final.name}"\n')
        os.rename(tmp, state)
        return str(Path(prefix).parent)
    return write


def nemo_archive(rel: str) -> Writer:
    """NeMo's ``model.save_to("….nemo")``: the config and a ``torch.save`` of the weights in
    a local temporary directory, packed with ``tarfile.open(path, "w:")`` onto the final
    name."""
    def write(root: Path, arr: np.ndarray) -> str:
        import torch

        path = _parent(root, rel)
        with tempfile.TemporaryDirectory() as tmp:
            torch.save({"w": torch.from_numpy(arr)}, f"{tmp}/model_weights.ckpt")
            Path(tmp, "model_config.yaml").write_text("target: nemo.collections.Model\n")
            for name in ("model_weights.ckpt", "model_config.yaml", "."):
                os.utime(Path(tmp, name), (1e9, 1e9))  # the same archive every time
            with tarfile.open(path, "w:") as tar:
                tar.add(tmp, arcname=".")
        return rel
    return write


def lightning_checkpoint(rel: str) -> Writer:
    """Lightning's ModelCheckpoint (``_atomic_save``): ``torch.save`` into a buffer, then
    the buffer written to ``…/checkpoints/epoch=N-step=M.ckpt``."""
    def write(root: Path, arr: np.ndarray) -> str:
        import torch

        buffer = io.BytesIO()
        torch.save({"state_dict": {"w": torch.from_numpy(arr)}, "epoch": 3}, buffer)
        with open(_parent(root, rel), "wb") as f:
            f.write(buffer.getvalue())
        return rel
    return write


def flax_checkpoint(directory: str) -> Writer:
    """Flax's legacy ``checkpoints.save_checkpoint``: msgpack to ``checkpoint_tmp``, renamed
    to ``checkpoint_<step>``."""
    def write(root: Path, arr: np.ndarray) -> str:
        tmp = _parent(root, f"{directory}/checkpoint_tmp")
        tmp.write_bytes(arr.tobytes())
        os.rename(tmp, tmp.with_name("checkpoint_100"))
        return directory
    return write


# What the issue measured (name: writer), then names only a rule of the new policy
# catches (no checkpoint directory in the path).
CHECKPOINTS: dict[str, Writer] = {
    "Keras-style h5py": keras_weights("run1/ckpt/model.weights.h5"),
    "np.save": numpy_save("run1/ckpt/opt_state.npy"),
    "TF-style shard": tf_checkpoint("run1/ckpt/ckpt-100"),
    "NeMo archive": nemo_archive("run1/model.nemo"),
    "Lightning": lightning_checkpoint(
        "run1/lightning_logs/version_0/checkpoints/epoch=3-step=100.ckpt"),
}
BY_NAME: dict[str, Writer] = {
    "Keras ModelCheckpoint in the run directory": keras_weights("run2/model.weights.h5"),
    "tf.train.CheckpointManager in ./tf_ckpts": tf_checkpoint("run2/tf_ckpts/ckpt-7"),
    "Flax save_checkpoint": flax_checkpoint("run2/flax"),
}


def files_under(root: Path, rel: str) -> Iterator[str]:
    """Every file of what a writer wrote (relative paths), sorted."""
    top = root / rel
    if top.is_file():
        yield rel
        return
    for path in sorted(top.rglob("*")):
        if path.is_file():
            yield str(path.relative_to(root))


def charged(stats: dict[str, Any], kind: str) -> dict[str, int]:
    """Bytes of *kind* ("read" or "write") per class, from ``ctl stats --json``."""
    out: dict[str, int] = {}
    for account in stats["accounts"]:
        out[account["class"]] = out.get(account["class"], 0) + account[f"{kind}_bytes"]
    return out


def opens(stats: dict[str, Any]) -> dict[str, int]:
    """Files opened per class, from ``ctl stats --json`` (a class whose reads the kernel
    serves, kernel passthrough, shows its opens there and no read bytes)."""
    out: dict[str, int] = {}
    for account in stats["accounts"]:
        out[account["class"]] = out.get(account["class"], 0) + account["opens"]
    return out


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """The classes whose counters moved, and by how much."""
    return {cls: n - before.get(cls, 0) for cls, n in after.items() if n != before.get(cls, 0)}


def _measure(mib: int, cap_mib: int) -> None:
    from qosfs.control.ctl import Client
    from tests.mounting import QosfsMount

    arr = payload(mib * MiB)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        src, mnt, sock = Path(tmp, "src"), Path(tmp, "mnt"), Path(tmp, "ctl.sock")
        src.mkdir()
        mnt.mkdir()
        with QosfsMount(src, mnt, "--socket", str(sock)), Client(str(sock)) as client:
            reply = client.request({"cmd": "set", "target": "class", "name": "checkpoints",
                                    "changes": {"write_bandwidth": f"{cap_mib}MiB/s",
                                                "burst": "1MiB"}})
            assert reply["ok"], reply
            print(f"| writer | path | charged to | time | ({mib} MiB each, checkpoints "
                  f"capped at {cap_mib} MiB/s, burst 1 MiB)")
            print("|---|---|---|---:|")
            for name, writer in {**CHECKPOINTS, **BY_NAME}.items():
                before = charged(client.request({"cmd": "stats"}), "write")
                start = time.monotonic()
                rel = writer(mnt, arr)
                took = time.monotonic() - start
                moved = delta(charged(client.request({"cmd": "stats"}), "write"), before)
                classes = ", ".join(f"{cls} {n / MiB:.0f} MiB" for cls, n in moved.items())
                print(f"| {name} | `{rel}` | {classes} | {took:.2f} s |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=96, help="size of each save (MiB)")
    parser.add_argument("--cap-mib", type=int, default=32, help="checkpoints cap (MiB/s)")
    args = parser.parse_args(argv)
    _measure(args.mib, args.cap_mib)


if __name__ == "__main__":
    main()
