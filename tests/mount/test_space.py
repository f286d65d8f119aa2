"""Free space through the mount: a user gets what the filesystem underneath gives them.

The daemon writes as root, and ext4 keeps blocks (``mkfs.ext4 -m``, 5 % by default) for
root: a user writing through the mount must still run out of space where they would on
the filesystem itself, not dip into root's reserve. Measured on a small ext4 made for
the test (64 MiB, 20 % reserved), filled until ENOSPC directly and through the mount.

Quotas are the other half of the same rule: the daemon must not lend CAP_SYS_RESOURCE,
which lifts quota hard limits. Only the dropped capability is checked here: the kernel
these tests were written on has no ``CONFIG_QUOTA`` (``mount -o usrquota`` of an
``-O quota`` ext4 fails), so a limit cannot be set up and hit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounting import QosfsMount, as_user
from tests.systemd_units import UNIT, parse_unit

pytestmark = [pytest.mark.mount, pytest.mark.root]

USER = 4242
MiB = 1 << 20
MARGIN = 2 * MiB  # allocation granularity, journal and metadata blocks: not 13 MiB

# Write 1 MiB blocks to a new file until the filesystem refuses; print bytes and errno.
FILL = r"""
import errno, json, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
block, written, err = b"\xa5" * (1 << 20), 0, None
try:
    while True:
        written += os.write(fd, block)
except OSError as exc:
    err = errno.errorcode[exc.errno]
finally:
    os.close(fd)
os.unlink(sys.argv[1])
print(json.dumps([written, err]))
"""


def fill(path: Path, uid: int | None = None) -> tuple[int, str]:
    """Fill the filesystem through *path* as *uid* (None: root), then free it again."""
    out = subprocess.run(["/usr/bin/python3", "-c", FILL, str(path)], cwd="/",
                         capture_output=True, text=True, check=False,
                         preexec_fn=as_user(uid) if uid is not None else None)
    assert out.returncode == 0, out.stderr
    os.sync()  # blocks freed by the unlink are reusable once the journal commits
    written, err = json.loads(out.stdout)
    return written, err


def _make_ext4(image: Path, mountpoint: Path, *mkfs_args: str) -> None:
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 missing (e2fsprogs; make system-deps installs it)")
    with open(image, "wb") as f:
        f.truncate(64 * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", *mkfs_args, str(image)], check=True,
                   capture_output=True)
    mountpoint.mkdir()
    done = subprocess.run(["mount", "-o", "loop", str(image), str(mountpoint)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot loop-mount an ext4 image here: {done.stderr.strip()}")


@pytest.fixture
def reserved_ext4(tmp_tree: Path) -> Iterator[Path]:
    """A 64 MiB ext4 with 20 % of its blocks reserved for root, loop-mounted; its root
    directory is world-writable and sticky, like /tmp."""
    fs = tmp_tree / "ext4"
    _make_ext4(tmp_tree / "ext4.img", fs, "-m", "20")
    try:
        os.chmod(fs, 0o1777)
        yield fs
    finally:
        if subprocess.run(["umount", str(fs)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(fs)], check=False)


def unit_bounding_set() -> list[str]:
    """setpriv arguments that run the daemon as systemd/qosfs@.service would."""
    caps = [c for line in parse_unit(UNIT)["Service"]["CapabilityBoundingSet"]
            for c in line.split()]
    bounding = ",".join(["-all", *(f"+{c.removeprefix('CAP_').lower()}" for c in caps)])
    return ["setpriv", "--no-new-privs", "--bounding-set", bounding]


@pytest.fixture(params=["root", "unit"])
def over_ext4(request: pytest.FixtureRequest, reserved_ext4: Path,
              tmp_tree: Path) -> Iterator[QosfsMount]:
    """qosfs over the reserved ext4, run as plain root and under the systemd unit's
    capability bounding set (which must allow what the fix needs)."""
    mnt = tmp_tree / "mnt"
    mnt.mkdir()
    wrapper = unit_bounding_set() if request.param == "unit" else []
    mount = QosfsMount(reserved_ext4, mnt, log_path=tmp_tree / "qosfs.log",
                       wrapper=wrapper).start()
    try:
        yield mount
    finally:
        code = mount.stop()
        assert code == 0, mount.log()
        assert "Traceback" not in mount.log(), mount.log()


@pytest.mark.parametrize("name", ["data.bin", "model.pt"])
def test_a_user_runs_out_of_space_where_the_filesystem_says(over_ext4: QosfsMount,
                                                            name: str) -> None:
    """Without the fix the user got root's reserve through the mount: 53 MiB instead of
    the 40 MiB the same user gets on the filesystem itself. ``*.pt`` is in the default
    policy's capped checkpoint class, whose large writes go through worker threads."""
    direct, direct_err = fill(over_ext4.source / "direct", USER)
    through, through_err = fill(over_ext4.mountpoint / name, USER)
    assert direct_err == through_err == "ENOSPC"
    assert abs(through - direct) <= MARGIN, (direct // MiB, through // MiB)


def test_root_keeps_the_blocks_reserved_for_it(over_ext4: QosfsMount) -> None:
    """The choice documented in docs/administration.md: root's writes through the mount use the
    reserve, as they do on the filesystem itself (ext4 reserves by fsuid, root's)."""
    user, _ = fill(over_ext4.source / "user", USER)
    direct, _ = fill(over_ext4.source / "direct")
    through, through_err = fill(over_ext4.mountpoint / "through")
    assert through_err == "ENOSPC"
    assert direct - user > 8 * MiB  # the reserve is there, and root gets it...
    assert abs(through - direct) <= MARGIN, (direct // MiB, through // MiB)  # ...here too


def _caps(pid: str) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v, 16) for k, v in (line.split(":\t", 1) for line in f)
                if k.startswith("Cap")}


def _daemon_pid(mount: QosfsMount) -> int:
    assert mount.proc is not None
    return mount.proc.pid


def test_the_daemon_holds_no_cap_sys_resource(over_ext4: QosfsMount) -> None:
    """CAP_SYS_RESOURCE lifts quota hard limits (and Lustre's quotas): dropped from every
    set once the mount is up, so no write through the mount is exempt."""
    sys_resource = 1 << 24
    if not _caps("self")["CapBnd"] & sys_resource:
        pytest.skip("root has no CAP_SYS_RESOURCE here, so the daemon has none to lend")
    status = _caps(str(_daemon_pid(over_ext4)))
    for field in ("CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"):
        assert not status[field] & sys_resource, field
