"""Walking a mount, in place as well as source -> mountpoint: nothing hangs, nothing differs.

Mounted in place, the source's root directory is covered by the mount. The daemon once
stat'ed ``..`` of a listed directory through the backing tree: for a child of the root
that walk stepped onto the mount itself, and the daemon waited for ever on a request to
itself (every later access hung, for every user). So each check here runs the way an
administrator would (``find``, ``du``, ``ls -R``, ``os.walk``, ``cd ..``) in a child
process under a deadline: a hang fails the test instead of hanging the suite.

Mounts use ``--attr-timeout 0`` as well as the default: with no attribute cache every
stat reaches the daemon, so a path walk that lands on the mount cannot hide behind a
cached answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.mount import posix_scenarios
from tests.mounting import ROOT, QosfsMount, as_user, is_mounted

pytestmark = [pytest.mark.mount, pytest.mark.root]

DEADLINE = 60.0  # seconds: generous for a loaded machine; a hang is for ever
TEST_UID = 4243
TEST_GID = 4243


def bounded(cmd: list[str], cwd: str | Path = "/", user: int | None = None) -> str:
    """Run *cmd* and return its stdout; fail the test (not hang it) past DEADLINE."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=None if user is None else as_user(user, user))
    try:
        out, err = proc.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        # A caller stuck on a dead-locked mount may not die before its daemon does (the
        # fixture kills that): do not wait for it here.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=5)
        pytest.fail(f"{' '.join(cmd)} hung for {DEADLINE:g} s (the mount stopped answering)")
    assert proc.returncode == 0, f"{cmd}: {err}"
    return out


def python(script: str, *args: str, cwd: str | Path = "/") -> object:
    """Run a Python snippet in a child process (bounded); it prints JSON, returned parsed."""
    return json.loads(bounded([sys.executable, "-c", script, *args], cwd=cwd))


@dataclass
class Topology:
    """Where a user works (``root``) and where the same tree is seen underneath."""

    root: Path
    backing: Path
    mount: QosfsMount


def build_tree(base: Path) -> None:
    """What administrators and jobs have: top-level directories (the case that hung),
    a deep chain, files, links, names with spaces, one directory past a readdir batch."""
    for d in ("checkpoints/sub", "data/a/b/c/d/e/f", "empty", "with space/inner"):
        (base / d).mkdir(parents=True)
    (base / "data/a/b/f.bin").write_bytes(b"x" * 10_000)
    (base / "data/a/b/c/d/e/f/deep.txt").write_text("deep")
    (base / "checkpoints/sub/model.pt").write_bytes(b"\0" * 70_000)
    (base / "with space/inner/name with space").write_text("s")
    os.symlink("data/a", base / "link-to-a")
    os.link(base / "data/a/b/f.bin", base / "checkpoints/hardlink.bin")
    many = base / "data/many"
    many.mkdir()
    for i in range(300):
        (many / f"sample-{i:04d}.npy").write_bytes(b"n" * 100)
    for d in base.rglob("*"):
        if d.is_dir() and not d.is_symlink():
            os.chmod(d, 0o755)


@pytest.fixture(params=["separate", "inplace", "inplace-cached"])
def topology(request: pytest.FixtureRequest, tmp_tree: Path) -> Iterator[Topology]:
    """The tree mounted source -> mountpoint, or in place (the backing tree then stays
    visible through a bind mount taken before); "-cached": the default attribute cache."""
    kind: str = request.param
    src = tmp_tree / "src"
    src.mkdir(mode=0o755)
    os.chmod(src, 0o755)
    build_tree(src)
    args = [] if kind.endswith("cached") else ["--attr-timeout", "0"]
    view = tmp_tree / "view"
    if kind == "separate":
        mnt = tmp_tree / "mnt"
        mnt.mkdir()
        backing = src
    else:
        mnt = src
        view.mkdir()
        subprocess.run(["mount", "--bind", str(src), str(view)], check=True)
        backing = view
    mount = QosfsMount(src, mnt, *args, log_path=tmp_tree / "qosfs.log")
    try:
        mount.start()
        yield Topology(mnt, backing, mount)
    finally:
        code = mount.stop()
        if backing == view:
            subprocess.run(["umount", str(view)], check=False)
        assert not is_mounted(mnt) and not is_mounted(view)
        assert code == 0, mount.log()
        assert "Traceback" not in mount.log(), mount.log()


def test_find_lists_what_is_underneath(topology: Topology) -> None:
    fmt = "%P %y %s %n\\n"
    through = bounded(["find", str(topology.root), "-printf", fmt])
    native = bounded(["find", str(topology.backing), "-printf", fmt])
    assert sorted(through.splitlines()) == sorted(native.splitlines())
    assert len(through.splitlines()) > 300


def test_du_counts_what_is_underneath(topology: Topology) -> None:
    through = bounded(["du", "-s", "--block-size=1", str(topology.root)]).split()[0]
    native = bounded(["du", "-s", "--block-size=1", str(topology.backing)]).split()[0]
    assert through == native


def test_ls_recursive_matches(topology: Topology) -> None:
    through = bounded(["ls", "-Ral", "--time-style=+%s", "."], cwd=topology.root)
    native = bounded(["ls", "-Ral", "--time-style=+%s", "."], cwd=topology.backing)
    # The root's own line ("..") is the mountpoint's parent against the source's: skip
    # the first block's header lines, compare every listing below it in full.
    assert through.split("\n\n", 1)[1] == native.split("\n\n", 1)[1]


WALK = """
import json, os, sys
root = sys.argv[1]
out = []
for top_down in (True, False):
    for path, dirs, files in os.walk(root, topdown=top_down):
        out.append([top_down, os.path.relpath(path, root), dirs, files])
print(json.dumps(out))
"""


def test_os_walk_top_down_and_bottom_up(topology: Topology) -> None:
    through = python(WALK, str(topology.root))
    native = python(WALK, str(topology.backing))
    assert through == native


DOTDOT = """
import json, os, sys
root = sys.argv[1]
deep = os.path.join(root, "data/a/b/c/d/e/f")
out = []
# stat through chains of '..' from the deepest directory up to the root
parts = os.path.relpath(deep, root).split(os.sep)
for up in range(1, len(parts) + 1):
    via = os.stat(os.path.join(deep, *[".."] * up))
    real = os.stat(os.path.join(root, *parts[: len(parts) - up]))
    out.append([up, via.st_ino == real.st_ino, via.st_dev == real.st_dev])
# climb with chdir('..') and getcwd, as a shell's `cd ..` does
os.chdir(deep)
while os.getcwd() != root:
    os.chdir("..")
    out.append(os.path.relpath(os.getcwd(), root))
# every directory's '..' entry names its parent (what `ls -ia` shows)
for path, dirs, _ in os.walk(root):
    for d in dirs:
        child = os.path.join(path, d)
        if os.path.islink(child):
            continue  # lists its target, whose parent is elsewhere
        listed = dict(
            (line.split()[1], int(line.split()[0]))
            for line in os.popen(f"ls -ia '{child}'").read().splitlines()
            if line.split()[1:2] in (["."], [".."]))
        out.append([os.path.relpath(child, root),
                    listed["."] == os.stat(child).st_ino,
                    listed[".."] == os.stat(path).st_ino])
print(json.dumps(out))
"""


def test_dotdot_chains_from_deep_directories(topology: Topology) -> None:
    through = python(DOTDOT, str(topology.root))
    native = python(DOTDOT, str(topology.backing))
    assert through == native
    assert [row for row in through if isinstance(row, list) and row[1:] != [True, True]] == []


def test_dotdot_of_a_top_level_directory_after_the_roots_attributes_expired(
        topology: Topology) -> None:
    """The sequence that hung: the root listed, then one of its directories, then the
    second again once nothing is cached any more."""
    for _ in range(3):
        bounded(["ls", "-la", str(topology.root)])
        bounded(["ls", "-la", str(topology.root / "checkpoints")])
        bounded(["stat", str(topology.root / "checkpoints/..")])
    assert bounded(["cat", str(topology.root / "data/a/b/c/d/e/f/deep.txt")]) == "deep"


def _scenario_in_child(root: Path, scenario: str, user: int | None = None) -> object:
    script = Path(posix_scenarios.__file__)
    if user is None:
        return json.loads(bounded([sys.executable, "-m", "tests.mount.posix_scenarios",
                                   str(root), scenario], cwd=ROOT))
    # As another user: the system interpreter and a copy of the script (the venv may be
    # under /root, which that user cannot enter).
    copy = root.parent / f"scenario-{os.getpid()}.py"
    shutil.copy(script, copy)
    os.chmod(copy, 0o644)
    interpreter = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    try:
        return json.loads(bounded([interpreter, str(copy), str(root), scenario], user=user))
    finally:
        copy.unlink()


@pytest.mark.parametrize("scenario", ["files", "rename", "links", "xattr", "special",
                                      "names", "ctime", "user"])
def test_posix_scenarios_at_the_root_of_an_in_place_mount(scenario: str,
                                                           tmp_tree: Path) -> None:
    """Each scenario run at the root of an in-place mount (so every object it makes is a
    child of the covered directory) against the same on a plain directory."""
    src, native, view = tmp_tree / "src", tmp_tree / "native", tmp_tree / "view"
    for d in (src, native, view):
        d.mkdir()
        os.chmod(d, 0o755)
    user = None
    if scenario == "user":
        for d in (src, native):
            posix_scenarios.prepare_user_tree(str(d), gid=TEST_GID + 1)
        user = TEST_UID
    subprocess.run(["mount", "--bind", str(src), str(view)], check=True)
    mount = QosfsMount(src, src, "--attr-timeout", "0", log_path=tmp_tree / "qosfs.log")
    try:
        mount.start()
        expected = _scenario_in_child(native, scenario, user)
        got = _scenario_in_child(src, scenario, user)
        assert got == expected
        # What was done through the mount is what the backing tree holds.
        assert sorted(os.listdir(view)) == sorted(os.listdir(native))
    finally:
        code = mount.stop()
        subprocess.run(["umount", str(view)], check=False)
    assert code == 0, mount.log()
    assert not is_mounted(src)


@pytest.mark.parametrize("what", ["--socket", "--log-file"])
def test_daemon_files_under_the_mountpoint_are_refused(what: str, tmp_tree: Path) -> None:
    """The daemon would reach its own socket or log file through its own mount (the log
    handler stats its file at every record) and wait on itself."""
    src = tmp_tree / "src"
    src.mkdir()
    cmd = [sys.executable, "-m", "qosfs", "mount", "--foreground", str(src), what,
           str(src / "sub" / "qosfs.x")]
    (src / "sub").mkdir()
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE)
    finally:
        if is_mounted(src):  # before the fix it mounted: never leave it behind
            subprocess.run(["fusermount3", "-u", "-z", str(src)], check=False)
    assert out.returncode == 2, out.stderr
    assert "under the mountpoint" in out.stderr
    assert not is_mounted(src)
