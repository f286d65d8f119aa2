"""Under the embedded default policy, checkpoints that TensorFlow/Keras, NeMo, Lightning and
JAX code writes are charged to ``checkpoints``, even in a dataset's file format, and
reading a dataset file is still charged to ``datasets`` (issue 28, item 3).

Each writer (tests/mount/framework_writers.py) saves a few MiB through one mount; the
test reads which class the bytes were charged to from ``ctl stats --json`` and compares
the backing files with the same save made outside the mount.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from qosfs.daemon import cli
from tests.mount import framework_writers as fw
from tests.mounting import QosfsMount

h5py = pytest.importorskip("h5py")
pytest.importorskip("torch")
pytestmark = [pytest.mark.mount, pytest.mark.root]

SIZE = 3 * fw.MiB


class Mounted:
    """Where jobs write (``mnt``) and where the same tree is seen underneath (``src``)."""

    def __init__(self, src: Path, mnt: Path, sock: Path, ref: Path) -> None:
        self.src, self.mnt, self.sock, self.ref = src, mnt, sock, ref

    def stats(self, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
        assert cli.main(["ctl", "--socket", str(self.sock), "stats", "--json"]) == 0
        stats: dict[str, Any] = json.loads(capsys.readouterr().out)
        return stats


@pytest.fixture(scope="module", params=["separate", "inplace"])
def default_mount(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mounted]:
    """One mount of the embedded default policy for the module, source -> mountpoint or
    in place (as systemd and the DaemonSet run it; the tree underneath is then seen
    through a bind mount taken before): each test writes its own directory and looks
    only at what its writes moved."""
    tmp = tmp_path_factory.mktemp("frameworks")
    source, view = tmp / "src", tmp / "view"
    in_place = request.param == "inplace"
    mnt = source if in_place else tmp / "mnt"
    mounted = Mounted(view if in_place else source, mnt, tmp / "ctl.sock", tmp / "ref")
    for d in {source, mnt, mounted.src, mounted.ref}:
        d.mkdir()
    if in_place:
        subprocess.run(["mount", "--bind", str(source), str(view)], check=True)
    m = QosfsMount(source, mnt, "--socket", str(mounted.sock))
    try:
        m.start()
        yield mounted
    finally:
        code = m.stop()
        if in_place:
            subprocess.run(["umount", str(view)], check=False)
        assert code == 0, f"daemon exited with {code}: {m.log()}"
        assert "Traceback" not in m.log(), m.log()


def _digests(root: Path, rel: str) -> dict[str, str]:
    return {path: xxhash.xxh3_128_hexdigest((root / path).read_bytes())
            for path in fw.files_under(root, rel)}


@pytest.mark.parametrize("name", [*fw.CHECKPOINTS, *fw.BY_NAME])
def test_a_framework_checkpoint_is_charged_to_checkpoints(
        default_mount: Mounted, capsys: pytest.CaptureFixture[str], name: str) -> None:
    writer = {**fw.CHECKPOINTS, **fw.BY_NAME}[name]
    arr = fw.payload(SIZE)
    before = default_mount.stats(capsys)
    rel = writer(default_mount.mnt, arr)
    after = default_mount.stats(capsys)
    written = fw.delta(fw.charged(after, "write"), fw.charged(before, "write"))
    # Every byte in the checkpoint class as it was written: none moved there at a rename
    # (a temporary name is classified by the name it will get).
    assert set(written) == {"checkpoints"} and written["checkpoints"] >= SIZE, written
    assert after.get("rename_charged_bytes", {}) == before.get("rename_charged_bytes", {})
    assert writer(default_mount.ref, arr) == rel
    expected = _digests(default_mount.ref, rel)
    assert expected and _digests(default_mount.src, rel) == expected


def test_a_dataset_format_written_under_no_checkpoint_name_is_not_a_dataset(
        default_mount: Mounted, capsys: pytest.CaptureFixture[str]) -> None:
    """Writes fall through the dataset class (reads only): a .npy that is no checkpoint
    by name is charged to default, where streaming detection still watches it."""
    before = fw.charged(default_mount.stats(capsys), "write")
    rel = fw.numpy_save("scratch/features.npy")(default_mount.mnt, fw.payload(SIZE))
    written = fw.delta(fw.charged(default_mount.stats(capsys), "write"), before)
    assert set(written) == {"default"} and written["default"] >= SIZE, written
    assert (default_mount.src / rel).stat().st_size >= SIZE


@pytest.mark.parametrize("suffix", ["h5", "npy"])
def test_reading_a_dataset_file_is_still_charged_to_datasets(
        default_mount: Mounted, capsys: pytest.CaptureFixture[str], suffix: str) -> None:
    arr = fw.payload(SIZE, seed=7)
    backing = default_mount.src / "shards" / f"train-0.{suffix}"
    backing.parent.mkdir(exist_ok=True)
    if suffix == "h5":
        with h5py.File(backing, "w") as f:
            f.create_dataset("x", data=arr)
    else:
        fw.numpy_save(f"shards/train-0.{suffix}")(default_mount.src, arr)
    stats = default_mount.stats(capsys)
    before, opened_before = fw.charged(stats, "read"), fw.opens(stats)
    path = default_mount.mnt / "shards" / f"train-0.{suffix}"
    if suffix == "h5":
        with h5py.File(path, "r") as f:
            got = f["x"][:]
    else:
        got = np.load(path)
    assert (got == arr).all()
    stats = default_mount.stats(capsys)
    read = fw.delta(fw.charged(stats, "read"), before)
    opened = fw.delta(fw.opens(stats), opened_before)
    # Read by the daemon, or by the kernel for the datasets class (passthrough: its opens
    # are counted, its bytes never reach the daemon); charged to nothing else either way.
    assert set(opened) == {"datasets"}, opened
    assert set(read) <= {"datasets"}, read
    if read:  # served by the daemon: every byte charged to datasets
        assert read["datasets"] >= SIZE, read
