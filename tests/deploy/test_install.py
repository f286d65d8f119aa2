"""make install with kernel passthrough: the installed virtualenv gets the libfuse and the
patched pyfuse3 that make deps gives the development one (deploy/libfuse/build.sh, target
"installed"), staged under DESTDIR and working once moved to PREFIX; where they cannot be
built, the install goes on without them and says so in one line.

Nothing is installed outside a temporary directory: PREFIX is one too, so "moved into
place" is a rename the test can make.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.systemd_units import ROOT

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


@pytest.mark.slow
def test_make_install_stages_kernel_passthrough_that_works_from_prefix(
        tmp_path: Path) -> None:
    """A full make install under DESTDIR (a fresh virtualenv from PyPI, libfuse and
    pyfuse3 built: a minute or two), then the tree moved to PREFIX: its python imports
    the patched pyfuse3, which loads the libfuse under PREFIX through its rpath."""
    stage, prefix = tmp_path / "stage", tmp_path / "prefix"
    done = _make("install", f"DESTDIR={stage}", f"PREFIX={prefix}", timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout + done.stderr
    if any(reason in said for reason in UNREACHABLE):
        pytest.skip(f"libfuse's source package is unreachable here: {said.strip()}")
    assert "kernel passthrough: pyfuse3" in said and "not built" not in said, said
    venv = stage / prefix.relative_to("/") / "lib/qosfs"
    # What the passthrough build installed names PREFIX only: the .pc file, the rpath and
    # the debug info's file names (the rest of the virtualenv is pip's and venv's).
    site = next(venv.glob("lib/python3*/site-packages"))
    passthrough_files = [venv / "opt/libfuse", *site.glob("pyfuse3*")]
    assert not [f for top in passthrough_files for f in _naming(top, str(stage))]
    assert _naming(venv / "opt/libfuse/lib/pkgconfig", f"prefix={prefix}/lib/qosfs/opt")

    (stage / prefix.relative_to("/")).rename(prefix)
    assert not venv.exists()
    done = subprocess.run([str(prefix / "lib/qosfs/bin/python"), "-P", "-c", PROBE],
                          capture_output=True, text=True, timeout=60, cwd="/",
                          env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"})
    assert done.returncode == 0, done.stderr
    supported, library = done.stdout.splitlines()
    assert supported == "True None"
    assert library.startswith(f"{prefix}/lib/qosfs/opt/libfuse/lib/libfuse3.so"), library


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
