"""``qosfs top`` in a real terminal (tmux): the first frame has rates, keys sort and
filter, idle users fold, ``q`` quits and gives the terminal back as it was; at 80 columns
the table gives way in its stated order and stays readable, at 200 it shows everything."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from qosfs.control.ctl import Client
from tests.mounting import ROOT, QosfsMount, as_user
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux missing")]

POLICY = """
[classes.data]
paths = ["data/**"]
[classes.ckpt]
paths = ["ckpt/**"]
per_user = "fair"
write_bandwidth = "8MiB/s"
burst = "1MiB"
[classes.default]
"""
BUSY = (3001, 3002)
IDLE = (3101, 3102, 3103)


class Terminal:
    """A tmux session of its own (its own server socket: no other session is touched)."""

    def __init__(self, tmp: Path) -> None:
        self.server = f"qosfs-test-{os.getpid()}"
        self.tmp = tmp

    def tmux(self, *args: str) -> str:
        # env: os.environ, not the C environment a child inherits by default, where
        # readline (imported by pytest) has put COLUMNS=80 and LINES=24: tmux would pass
        # them on, and top would take them over the terminal's own size.
        done = subprocess.run(["tmux", "-L", self.server, *args], capture_output=True,
                              text=True, timeout=10, env=dict(os.environ))
        assert done.returncode == 0, done.stderr
        return done.stdout

    def start(self, command: str, width: int = 160, height: int = 50) -> None:
        self.tmux("new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height),
                  command)

    def screen(self) -> str:
        """The pane as shown, lines the terminal wrapped joined again (a line wider than
        the pane comes back wider than the pane)."""
        return self.tmux("capture-pane", "-p", "-J", "-t", "top")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "top", *keys)

    def wait_for_screen(self, what: str, check: re.Pattern[str] | str,
                        timeout: float = 20,
                        holds: Callable[[str], object] = lambda screen: True) -> str:
        """The screen, once a line of it matches *check* and *holds* is true of it. A
        capture can catch top in the middle of drawing a frame (the new status line
        over the last frame's rows, seen once on a loaded machine): what is asserted
        of a frame is waited for, and a frame that never shows it fails."""
        return wait_for(what, self.screen, timeout=timeout, interval=0.1,
                        until=lambda screen: re.search(check, screen, re.MULTILINE)
                        and holds(screen))

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.server, "kill-server"], capture_output=True,
                       timeout=10)
        # The server's socket file outlives it: left, every run would add one.
        tmpdir = os.environ.get("TMUX_TMPDIR") or "/tmp"
        Path(tmpdir, f"tmux-{os.getuid()}", self.server).unlink(missing_ok=True)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Terminal]:
    term = Terminal(tmp_path)
    try:
        yield term
    finally:
        term.close()


def _written(path: Path, timeout: float = 10) -> str:
    """The text of a file another process is writing, once there is some."""
    return wait_for(f"{path} to be written", lambda: path.exists() and path.read_text(),
                    timeout=timeout, interval=0.05)


def _uid_rows(screen: str) -> list[str]:
    return re.findall(r"^ckpt\s+(\d+)\s", screen, re.MULTILINE)


@pytest.fixture
def busy_socket(tmp_tree: Path) -> Iterator[Path]:
    """A mount's control socket while two users write without pause (BUSY) and three wrote
    once (IDLE); the writers are stopped before the mount goes."""
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    for d in (src, mnt, src / "ckpt", src / "data"):
        d.mkdir()
        os.chmod(d, 0o777)
    policy = tmp_tree / "policy.toml"
    policy.write_text(POLICY)
    sock = tmp_tree / "ctl.sock"
    writers: list[subprocess.Popen[bytes]] = []
    with QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock)):
        (mnt / "data" / "shard").write_bytes(b"d" * 4096)
        for uid in IDLE:  # write once, then nothing: idle users
            subprocess.run(["sh", "-c", f"echo once > {uid}"], cwd=mnt / "ckpt",
                           preexec_fn=as_user(uid), check=True)
        try:
            for uid in BUSY:
                writers.append(subprocess.Popen(
                    ["sh", "-c", f"while :; do dd if=/dev/zero of=w{uid} bs=256k count=4 "
                                 "2>/dev/null; done"],
                    cwd=mnt / "ckpt", preexec_fn=as_user(uid), start_new_session=True))
            # The first frame shows the daemon's last sample: both writers must be in
            # one (a daemon up for a second had sampled one of them only, once).
            wait_for("both writers in one of the daemon's samples", lambda: _busy_in_sample(sock),
                     timeout=20, interval=0.1)
            yield sock
        finally:
            for writer in writers:  # the loop and its dd: a dd left keeps the mount busy
                os.killpg(writer.pid, signal.SIGKILL)
                writer.wait()
            for writer in writers:  # a dd killed in a parked write exits after the loop
                _wait_gone(writer.pid)


def _busy_in_sample(sock: Path) -> bool:
    """Whether the daemon's last sample has a write rate for every BUSY writer."""
    with Client(str(sock)) as client:
        accounts = client.request({"cmd": "stats"}).get("accounts", [])
    writing = {acc["uid"] for acc in accounts if acc["rates"].get("write_bytes")}
    return writing >= set(BUSY)


def _wait_gone(pgid: int, timeout: float = 20) -> None:
    """Until no process is left in the process group (an unmount meanwhile is refused)."""
    def gone() -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(f"process group {pgid} to be gone", gone, timeout=timeout, interval=0.05)


def _top(sock: Path, *args: str) -> str:
    return shlex.join([sys.executable, "-m", "qosfs", "top", "--socket", str(sock), *args])


def test_top_in_a_terminal(tmp_tree: Path, busy_socket: Path, terminal: Terminal) -> None:
    top = _top(busy_socket)
    # top twice: the first is left with q, the second (started by a line typed
    # into `read`) with Ctrl-C; after each the terminal's modes are saved.
    terminal.start(f"cd {shlex.quote(str(ROOT))}; stty -g > {tmp_tree}/before; {top}; "
                   f"echo EXIT=$?; stty -g > {tmp_tree}/after; read -r _; {top}; "
                   f"echo SECOND_EXIT=$?; stty -g > {tmp_tree}/after2; sleep 30")
    first = terminal.wait_for_screen("the first frame", r"^CLASS\s")
    # The first frame already has rates: the daemon's own, over its last sample.
    busy = re.findall(r"^ckpt\s+(\d+)\s.*?(\d[\d.]*)(KiB|MiB)/s", first, re.MULTILINE)
    assert {uid for uid, _, _ in busy} >= {str(u) for u in BUSY}, first
    assert "/s: rate over the daemon's last sample; total: since the mount" in first
    # Idle users fold into one row of their class.
    assert re.search(r"^ckpt\s+3 idle users\s", first, re.MULTILINE), first
    assert not set(_uid_rows(first)) & {str(u) for u in IDLE}, first
    # Busiest first: the writers above the idle users.
    assert "sort: IO/s descending" in first
    terminal.keys("i")
    terminal.wait_for_screen(
        "idle users shown", r"idle users: shown",
        holds=lambda screen: set(_uid_rows(screen)) >= {str(u) for u in (*BUSY, *IDLE)}
        and not re.search(r"\d+ idle users?\s", screen))
    # Sort by UID (two columns left of IO/s), A to Z, then reversed: the idle
    # users, below the writers by IO/s, now come first.
    terminal.keys("<", "<")
    terminal.wait_for_screen("sort by UID", r"sort: UID ascending",
                             holds=lambda screen: _uid_rows(screen) == sorted(_uid_rows(screen)))
    terminal.keys("r")
    terminal.wait_for_screen(
        "reversed", r"sort: UID descending",
        holds=lambda screen: _uid_rows(screen) == sorted(_uid_rows(screen), reverse=True)
        and _uid_rows(screen)[:1] == [str(IDLE[-1])])
    # s moves the sort to the next column.
    terminal.keys("s")
    terminal.wait_for_screen("s: next column", r"sort: LIMITS ascending")
    # Filter to one class: the other rows go; Esc brings them back.
    terminal.keys("/", "class=data", "Enter")
    terminal.wait_for_screen(
        "filtered", r"filter: class=data",
        holds=lambda screen: not _uid_rows(screen) and re.search(r"^data\s", screen,
                                                                 re.MULTILINE))
    terminal.keys("Escape")
    terminal.wait_for_screen(
        "filter cleared", r"filter: none",
        holds=lambda screen: set(_uid_rows(screen)) >= {str(u) for u in BUSY})
    terminal.keys("q")
    terminal.wait_for_screen("exit", r"^EXIT=0$", timeout=10)
    # The terminal is back in the mode it was in before top.
    before = _written(tmp_tree / "before")
    assert _written(tmp_tree / "after") == before
    # Ctrl-C also ends it, with the terminal restored.
    terminal.keys("again", "Enter")
    terminal.wait_for_screen("the second top", r"^CLASS\s")
    terminal.keys("C-c")
    terminal.wait_for_screen("exit on Ctrl-C", r"^SECOND_EXIT=0$", timeout=10)
    assert _written(tmp_tree / "after2") == before
    # The options filter too, and --once is plain text for scripts. --all-users: a busy
    # writer with no write in the daemon's last 1 s sample (its dd restarting, on a
    # loaded machine) is folded as "1 idle user", and the filter is what is tested here.
    once = subprocess.run([sys.executable, "-m", "qosfs", "top", "--once", "--socket",
                           str(busy_socket), "--class", "ckpt", "--uid", str(BUSY[0]),
                           "--all-users"],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert once.returncode == 0, once.stderr
    assert _uid_rows(once.stdout) == [str(BUSY[0])], once.stdout
    assert not re.search(r"^data\s", once.stdout, re.MULTILINE), once.stdout


RATE = r"[\d.]+(KiB|MiB)/s"  # a rate cell that is not zero (LIMITS cells start "w:")
# Every header top may show, whole or in its documented short form.
HEADERS = ("CLASS", "TENANT", "UID", "LIMITS", "IO/s", "READ/s", "WRITE/s", "OPS/s",
           "THROTTLED/s", "THR/s", "QUEUE", "READ total", "WRITTEN total", "THROTTLED total")


def _headers(screen: str) -> list[str]:
    """The account table's headers as drawn, sort mark taken off; asserts it has one."""
    lines = [line for line in screen.splitlines() if line.startswith("CLASS")]
    assert len(lines) == 1, screen
    return [re.sub(r" [▼▲]$", "", cell) for cell in re.split(r"\s{2,}", lines[0].strip())]


def _assert_fits(screen: str, width: int) -> None:
    """Nothing wider than the terminal; every header a whole word; at 80 columns what
    ACCOUNT_FIT drops first is gone and class, rates, limits and queue stay; at 200 every
    column is there. The busy users have rows."""
    wide = [line for line in screen.splitlines() if len(line.rstrip()) > width]
    assert not wide, f"wider than {width}:\n{screen}"
    headers = _headers(screen)
    assert set(headers) <= set(HEADERS), screen
    assert headers[0] == "CLASS", screen
    assert {"UID", "LIMITS", "IO/s", "READ/s", "WRITE/s", "QUEUE"} <= set(headers), screen
    if width == 80:
        assert not set(headers) & {"READ total", "WRITTEN total", "THROTTLED total"}, screen
    else:
        assert set(headers) == set(HEADERS) - {"THR/s"}, screen
    for uid in BUSY:
        assert re.search(rf"^ckpt\s+{uid}\s", screen, re.MULTILINE), screen


@pytest.mark.parametrize("width", [80, 200])
def test_top_fits_the_terminal(tmp_tree: Path, busy_socket: Path, terminal: Terminal,
                               width: int) -> None:
    terminal.start(f"cd {shlex.quote(str(ROOT))}; {_top(busy_socket)}; echo EXIT=$?; "
                   f"{_top(busy_socket, '--once')}; echo ONCE_EXIT=$?; sleep 30",
                   width=width, height=30)
    # The live view: a frame in which the writers have rates.
    live = terminal.wait_for_screen("a busy user's rate", rf"^ckpt\s+{BUSY[-1]}\s.*\s{RATE}")
    _assert_fits(live, width)
    assert "sort: IO/s descending" in live  # the status line is whole
    assert "q quit  s/</> sort column" in live  # and the keys
    terminal.keys("q")
    # --once writes to the same terminal (the live view's screen is gone): fitted too.
    once = terminal.wait_for_screen("--once", r"^ONCE_EXIT=0$")
    assert re.search(r"^EXIT=0$", once, re.MULTILINE), once
    _assert_fits(once, width)
