"""The shipped unit passes systemd-analyze verify; make install stages it under DESTDIR.

Running the unit's commands is tests/mount/test_systemd.py; this is the static part.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from qosfs.policy.loading import load_policy
from tests.systemd_units import (
    ROOT,
    UNIT,
    escape_path,
    parse_unit,
    read_environment_file,
    timespan,
    unescape,
)

LAUNCHER = "/usr/local/bin/qosfs"
HAVE_ANALYZE = shutil.which("systemd-analyze") is not None
needs_analyze = pytest.mark.skipif(
    not HAVE_ANALYZE, reason="systemd-analyze missing (make system-deps installs systemd)")


def verify(unit_text: str, directory: Path, instance: str = "mnt-mlfs") -> None:
    """``systemd-analyze verify`` an instance of the template; any message fails.

    verify checks that ExecStart's binary exists, so callers point it at a real one.
    """
    (directory / "qosfs@.service").write_text(unit_text)
    done = subprocess.run(["systemd-analyze", "verify",
                           str(directory / f"qosfs@{instance}.service")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not done.stdout + done.stderr, done.stdout + done.stderr


def console_script() -> str:
    path = Path(sys.executable).parent / "qosfs"
    return str(path) if path.exists() else shutil.which("qosfs") or pytest.skip("no qosfs script")


@needs_analyze
@pytest.mark.parametrize("mountpoint", ["/mnt/mlfs", "/srv/ml-data/shared"])
def test_unit_passes_systemd_analyze_verify(tmp_path: Path, mountpoint: str) -> None:
    text = UNIT.read_text()
    assert text.count(LAUNCHER) == 3  # ExecStart and ExecReload's two: make install rewrites
    verify(text.replace(LAUNCHER, console_script()), tmp_path, escape_path(mountpoint))


def test_unit_contract() -> None:
    """What the deployment relies on, in case someone edits the unit."""
    unit = parse_unit(UNIT)
    service, unit_section = unit["Service"], unit["Unit"]
    assert service["Type"] == ["notify"]
    [start] = service["ExecStart"]
    assert start.startswith(f"{LAUNCHER} mount --foreground %f ")  # systemd tracks this pid
    assert "--policy %E/qosfs/%i.toml" in start
    # reload: the policy file first (a bad one fails the reload before any handover), then
    # the installed code takes the mount over in the unit's cgroup and names itself the
    # main process (MAINPID=, which only NotifyAccess=exec or all accepts from it).
    assert service["ExecReload"] == [f"{LAUNCHER} ctl --socket %f reload",
                                     f"{LAUNCHER} upgrade %f"]
    assert service["NotifyAccess"] == ["exec"]
    assert service["Restart"] == ["on-failure"]
    # A crash: the FUSE descriptor waits in systemd's store for the next start, which
    # comes soon enough to serve again within 3 s (tests/mount/test_systemd_box.py).
    [store] = service["FileDescriptorStoreMax"]
    assert 1 <= int(store) <= 8
    assert timespan(service["RestartSec"][0]) <= 1.0
    assert unit_section["RequiresMountsFor"] == ["%f"]  # after the real mount, stops before
    assert "remote-fs.target" in unit_section["Before"]
    assert service["RuntimeDirectory"] == ["qosfs"]
    # Anything that gives the service its own mount namespace would hide the FUSE mount.
    for key in ("ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices",
                "PrivateMounts", "ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths",
                "ProtectKernelTunables", "ProtectKernelModules", "ProtectControlGroups",
                "ProtectProc", "MountFlags", "DeviceAllow", "DevicePolicy"):
        assert key not in service, key


def test_timespans_read_as_systemd_does() -> None:
    assert timespan("2") == 2.0 and timespan("500ms") == 0.5
    assert timespan("1min 30s") == 90.0 and timespan("100us") == pytest.approx(1e-4)
    with pytest.raises(ValueError):
        timespan("2 fortnights")


def test_escaping_round_trips() -> None:
    for path in ("/mnt/mlfs", "/srv/ml-data/shared", "/data/.hidden/x y"):
        escaped = escape_path(path)
        assert "/" not in escaped and "/" + unescape(escaped) == path
    assert escape_path("/mnt/mlfs") == "mnt-mlfs"
    assert escape_path("/srv/ml-data") == "srv-ml\\x2ddata"


def test_samples_are_valid() -> None:
    policy = load_policy(ROOT / "systemd" / "mnt-mlfs.toml")
    assert [c.name for c in policy.classes] == ["checkpoints", "datasets", "default"]
    # The sample environment file only documents: the unit's defaults stay in force.
    assert read_environment_file(ROOT / "systemd" / "mnt-mlfs.env") == {}


def _make(*args: str) -> None:
    subprocess.run(["make", "-s", "-C", str(ROOT), *args], check=True, capture_output=True,
                   timeout=120)


def test_make_install_files_stages_everything_under_destdir(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    _make("install-files", f"DESTDIR={dest}")
    unit = dest / "usr/local/lib/systemd/system/qosfs@.service"
    assert unit.read_text() == UNIT.read_text()
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    launcher = dest / "usr/local/bin/qosfs"
    assert stat.S_IMODE(launcher.stat().st_mode) == 0o755
    assert 'exec /usr/local/lib/qosfs/bin/python -P -m qosfs "$@"' in launcher.read_text()
    examples = dest / "usr/local/share/doc/qosfs/examples"
    for name in ("mnt-mlfs.toml", "mnt-mlfs.env"):
        assert (examples / name).read_bytes() == (ROOT / "systemd" / name).read_bytes()
    docdir = dest / "usr/local/share/doc/qosfs"
    assert (docdir / "README.md").read_bytes() == (ROOT / "README.md").read_bytes()
    # The README links into docs/, so the reference pages go with it.
    for page in (ROOT / "docs").glob("*.md"):
        assert (docdir / "docs" / page.name).read_bytes() == page.read_bytes(), page.name
    assert (dest / "etc/qosfs").is_dir() and not os.listdir(dest / "etc/qosfs")
    _make("uninstall", f"DESTDIR={dest}")
    assert not launcher.exists() and not unit.exists() and not docdir.exists()
    assert (dest / "etc/qosfs").is_dir()  # the administrator's policies stay


def test_make_install_files_follows_prefix_and_the_launcher_runs(tmp_path: Path) -> None:
    """PREFIX reaches every path in the unit; the launcher runs its virtualenv's python."""
    dest, prefix = tmp_path / "dest", "/opt/qosfs"
    _make("install-files", f"DESTDIR={dest}", f"PREFIX={prefix}")
    unit = (dest / "opt/qosfs/lib/systemd/system/qosfs@.service").read_text()
    assert "/usr/local" not in unit.replace("/usr/local to its PREFIX", "")
    assert f"ExecStart={prefix}/bin/qosfs mount" in unit
    # Stand in for the virtualenv make install-python creates, and run the launcher.
    staged = dest / "opt/qosfs"
    (staged / "lib/qosfs/bin").mkdir(parents=True)
    python = staged / "lib/qosfs/bin/python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    launcher = (staged / "bin/qosfs").read_text().replace(prefix, str(staged))
    (staged / "bin/qosfs").write_text(launcher)
    done = subprocess.run([str(staged / "bin/qosfs"), "policy", "default"], cwd="/",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "[classes.default]" in done.stdout, done.stderr
    if HAVE_ANALYZE:
        verify(unit.replace(f"{prefix}/bin/qosfs", str(staged / "bin/qosfs")), tmp_path)
