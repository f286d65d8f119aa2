"""make install, as an administrator runs it: the installed virtualenv gets the libfuse and
the patched pyfuse3 that make deps gives the development one (deploy/libfuse/build.sh,
target "installed"), staged under DESTDIR and working once moved to PREFIX; where they
cannot be built, the install goes on without them and says so in one line.

Then the installed tree is used as a product, with nothing of the work tree or its venv
(no test extras; issue 38: every mount of a plain install failed on an import only the
test extra installed): its launcher mounts, a file reads through the mount, and a
``kill -9`` of the daemon is survived, its holder keeping the connection until
``qosfs mount`` run again takes over, with a descriptor kept open across it reading on
(xxhash of everything it read).

Nothing is installed outside a temporary directory: PREFIX is one too, so "moved into
place" is a rename the test can make. One ``make install`` serves every test of the tree
(about 30 s here with pip's cache and the sources make deps fetched).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xxhash

from tests.mount.held_reader import HeldReader
from tests.mounting import is_mounted, mounted_under, reachable_tmpdir
from tests.systemd_units import ROOT
from tests.waiting import wait_for

# What the installed python reports: the patched pyfuse3, usable as the daemon sees it
# (qosfs.passthrough.kernel.build_support), and the libfuse it loaded.
PROBE = """
import pyfuse3
from qosfs.passthrough.kernel import build_support
print(pyfuse3.PASSTHROUGH_SUPPORTED, build_support())
print(*[line.split()[-1] for line in open("/proc/self/maps") if "/libfuse3.so" in line][:1])
"""
# build.sh's steps that fail only when the Debian source package cannot be fetched.
UNREACHABLE = ("no fuse3 source package reachable", "apt-get update (private deb-src list")


def _make(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-s", "-C", str(ROOT), *args], capture_output=True,
                          text=True, timeout=timeout)


def _system_libfuse_is_new_enough() -> bool:
    """Whether build.sh takes the system's libfuse (>= 3.17.3) instead of a source build."""
    done = subprocess.run(["pkg-config", "--atleast-version=3.17.3", "fuse3"],
                          capture_output=True)
    return done.returncode == 0


def _naming(top: Path, text: str) -> list[str]:
    """The files under *top* whose bytes contain *text* (compiled Python left out)."""
    needle = text.encode()
    return [str(p) for p in top.rglob("*")
            if p.is_file() and p.suffix != ".pyc" and needle in p.read_bytes()]


def test_make_install_wires_the_passthrough_build_into_the_installed_venv() -> None:
    dry = _make("-n", "install", "DESTDIR=/nonexistent", "PREFIX=/opt/q", timeout=60)
    assert dry.returncode == 0, dry.stderr
    lines = [line for line in dry.stdout.splitlines() if "deploy/libfuse/build.sh" in line]
    assert lines == ["DESTDIR='/nonexistent' deploy/libfuse/build.sh /opt/q/lib/qosfs "
                     "build/libfuse installed || true"], dry.stdout


@dataclass(frozen=True)
class Installed:
    """A tree ``make install`` staged under *stage* and then moved to *prefix*."""

    stage: Path
    prefix: Path
    said: str  # what make install printed

    @property
    def venv(self) -> Path:
        return self.prefix / "lib/qosfs"

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """The installed ``qosfs`` launcher, from /, with an environment that names
        nothing of the work tree or its venv."""
        return subprocess.run([str(self.prefix / "bin/qosfs"), *args], capture_output=True,
                              text=True, timeout=timeout, cwd="/", env=PRODUCT_ENV)


# What an administrator's shell would have: no venv, no PYTHONPATH, no LD_LIBRARY_PATH.
PRODUCT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    """A full make install under DESTDIR (a fresh virtualenv from PyPI, libfuse and
    pyfuse3 built), then the tree moved to PREFIX. In a directory of its own (not
    pytest's: another session may clean that up under a test that runs this long)."""
    top = Path(tempfile.mkdtemp(prefix="qosfs-install-"))
    stage, prefix = top / "stage", top / "prefix"
    try:
        done = _make("install", f"DESTDIR={stage}", f"PREFIX={prefix}", timeout=1800)
        assert done.returncode == 0, done.stdout + done.stderr
        said = done.stdout + done.stderr
        if any(reason in said for reason in UNREACHABLE):
            pytest.skip(f"libfuse's source package is unreachable here: {said.strip()}")
        (stage / prefix.relative_to("/")).rename(prefix)
        yield Installed(stage, prefix, said)
    finally:
        if not mounted_under(top):
            shutil.rmtree(top)


@pytest.mark.slow
def test_make_install_stages_kernel_passthrough_that_works_from_prefix(
        installed: Installed) -> None:
    """Its python imports the patched pyfuse3, which loads the libfuse under PREFIX
    through its rpath."""
    assert "kernel passthrough: pyfuse3" in installed.said, installed.said
    assert "not built" not in installed.said, installed.said
    venv = installed.venv
    assert not (installed.stage / installed.prefix.relative_to("/")).exists()  # moved
    # What the passthrough build installed names PREFIX only: the .pc file, the rpath and
    # the debug info's file names (the rest of the virtualenv is pip's and venv's).
    site = next(venv.glob("lib/python3*/site-packages"))
    passthrough_files = [venv / "opt/libfuse", *site.glob("pyfuse3*")]
    assert not [f for top in passthrough_files for f in _naming(top, str(installed.stage))]
    assert _naming(venv / "opt/libfuse/lib/pkgconfig",
                   f"prefix={installed.prefix}/lib/qosfs/opt")
    done = subprocess.run([str(venv / "bin/python"), "-P", "-c", PROBE],
                          capture_output=True, text=True, timeout=60, cwd="/", env=PRODUCT_ENV)
    assert done.returncode == 0, done.stderr
    supported, library = done.stdout.splitlines()
    assert supported == "True None"
    assert library.startswith(f"{installed.prefix}/lib/qosfs/opt/libfuse/lib/libfuse3.so"), \
        library


def _exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


@pytest.mark.slow
@pytest.mark.mount
@pytest.mark.root
def test_the_installed_tree_mounts_reads_and_survives_kill_9(installed: Installed) -> None:
    """From the installed launcher alone: mount, read, kill -9 the daemon while a reader
    holds a descriptor open, ``qosfs mount`` again takes over, the reader reads on, and
    ``qosfs umount`` ends it all."""
    top = reachable_tmpdir("installed")
    src, mnt = top / "src", top / "mnt"
    src.mkdir()
    mnt.mkdir()
    data = os.urandom(8 << 20)
    (src / "data.bin").write_bytes(data)
    expected = xxhash.xxh3_128(data).hexdigest()
    # Every read a request to the daemon: a read from the page cache, or one the kernel
    # passes through to the backing file, would not see the crash.
    options = ("--cache", "never", "--no-passthrough")
    processes: list[int] = []  # pidfds of the daemons and the holder, ended at the end
    reader: HeldReader | None = None
    try:
        mounted = installed.run("mount", str(src), str(mnt), *options)
        assert mounted.returncode == 0, mounted.stderr
        status = wait_for("the keeper to hold the connection",
                          lambda: _status(installed, mnt),
                          until=lambda s: s["crash_protection"]["kept"])
        first = status["pid"]
        processes.append(os.pidfd_open(first))
        with open(f"/proc/{first}/cmdline", "rb") as f:  # the installed python serves
            assert f.read().split(b"\0")[0] == os.fsencode(installed.venv / "bin/python")
        assert xxhash.xxh3_128((mnt / "data.bin").read_bytes()).hexdigest() == expected

        reader = HeldReader(mnt / "data.bin")
        signal.pidfd_send_signal(processes[0], signal.SIGKILL)
        wait_for("the daemon to die", lambda: _exited(processes[0]))
        again = installed.run("mount", str(src), str(mnt), *options)
        assert again.returncode == 0, again.stderr
        status = _status(installed, mnt)
        processes.append(os.pidfd_open(status["pid"]))
        assert status["recovered"]["dead_pid"] == first, status.get("recovered")
        assert status["recovered"]["open_files"] == 1
        assert reader.finish() == {"digest": expected}  # read on, by the new daemon

        stopped = installed.run("umount", str(mnt))
        assert stopped.returncode == 0, stopped.stderr
        assert all(_exited(fd) for fd in processes)
    finally:
        if reader is not None:
            reader.close(mnt)
        for command in (["fusermount3", "-u", str(mnt)], ["umount", "-l", str(mnt)]):
            if is_mounted(mnt):
                subprocess.run(command, capture_output=True)
        for fd in processes:
            if not _exited(fd):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        if not is_mounted(mnt):
            shutil.rmtree(top)


def _status(installed: Installed, mnt: Path) -> dict[str, Any]:
    asked = installed.run("ctl", "--socket", str(mnt), "status", "--json", timeout=30)
    assert asked.returncode == 0, asked.stderr
    reply: dict[str, Any] = json.loads(asked.stdout)
    return reply


def test_make_install_without_libfuse_sources_goes_on_and_says_why_in_one_line(
        tmp_path: Path) -> None:
    """The passthrough step of make install against a virtualenv install-python would
    have made, with Debian's mirror unreachable: make succeeds, one line says why, and
    nothing of libfuse is left in the virtualenv (PyPI's pyfuse3 stays)."""
    if _system_libfuse_is_new_enough():
        pytest.skip("the system's libfuse is new enough: no source is fetched")
    stage, prefix = tmp_path / "stage", tmp_path / "prefix"
    venv = stage / prefix.relative_to("/") / "lib/qosfs"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    done = _make("install-passthrough", f"DESTDIR={stage}", f"PREFIX={prefix}",
                 f"LIBFUSE_BUILD={tmp_path / 'build'}", "DEB_MIRROR=http://127.0.0.1:9/debian",
                 timeout=300)
    assert done.returncode == 0, done.stderr
    lines = (done.stdout + done.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith("kernel passthrough not built: "), lines
    assert "without passthrough" in lines[0] and str(tmp_path / "build") in lines[0]
    assert not (venv / "opt").exists()
