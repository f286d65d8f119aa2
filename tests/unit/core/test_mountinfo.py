"""/proc/self/mountinfo parsing: the fields the daemon reads, escapes, stacking."""

from __future__ import annotations

from pathlib import Path

from qosfs.core.mountinfo import MountEntry, containing, mounts

TABLE = r"""22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/root rw
35 22 0:31 / /mnt/ml\040fs rw,nosuid,nodev shared:9 - tmpfs tmpfs rw,size=4g
36 35 0:40 / /mnt/ml\040fs rw,nosuid,nodev,relatime shared:10 - fuse.qosfs qosfs rw
garbage line
"""


def test_every_mount_with_its_device_path_options_and_type(tmp_path: Path) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(TABLE)
    found = mounts(str(table))
    assert found[0] == MountEntry("259:1", "/", frozenset({"rw", "relatime"}), "ext4")
    assert [m.mountpoint for m in found[1:]] == ["/mnt/ml fs"] * 2  # \040 is a space
    assert found[-1].fstype == "fuse.qosfs" and "nosuid" in found[-1].options
    assert len(found) == 3  # the line that is not a mount is skipped


def test_an_unreadable_table_is_no_mounts(tmp_path: Path) -> None:
    assert mounts(str(tmp_path / "absent")) == []


def test_this_process_sees_its_root() -> None:
    assert any(m.mountpoint == "/" for m in mounts())


def _entry(mountpoint: str, fstype: str, dev: str = "0:1") -> MountEntry:
    return MountEntry(dev, mountpoint, frozenset(), fstype)


def test_the_mount_a_path_lies_in_is_the_deepest_and_the_topmost() -> None:
    table = [_entry("/", "ext4"), _entry("/mnt", "tmpfs"), _entry("/mnt/ml", "tmpfs"),
             _entry("/mnt/ml", "fuse.qosfs"), _entry("/mnt/mlfs", "nfs")]
    assert containing("/mnt/ml", table) == table[3]  # on top of the tmpfs at that path
    assert containing("/mnt/ml/a/b", table) == table[3]
    assert containing("/mnt/mlx", table) == table[1]  # a prefix of the name is not a parent
    assert containing("/mnt/mlfs/x", table) == table[4]
    assert containing("/srv", table) == table[0]
    assert containing("/srv", []) is None
