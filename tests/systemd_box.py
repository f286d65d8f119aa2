"""A real systemd for tests: systemd as PID 1 of its own namespaces, on the host's root.

The test machine's PID 1 is not systemd, so the unit's crash path (``Restart=``, the
descriptor store, ``MAINPID=`` on an upgrade) could only be imitated. This starts the
installed systemd (252 on Debian 12) the way a container manager would, without touching
what the host runs:

- new PID, mount, cgroup, UTS, IPC and network namespaces (``unshare``): ``reboot()``,
  ``sethostname()`` and the loopback set-up stay inside; killing its PID 1 ends it all;
- ``container=`` in its environment, so it skips what only a booting machine does
  (loading modules, making ``/`` shared, setting the clock);
- its own tmpfs on /run and /dev (a few device nodes; /dev/console is a file of ours),
  /sys and /proc/sys read-only, its own machine-id, and a cgroup2 tree of its own: a child
  of this process's cgroup, mounted on its /sys/fs/cgroup, removed afterwards;
- units only from the box's directory (``SYSTEMD_UNIT_PATH``): no getty, journald or
  anything of the host's, and stand-ins for the targets services depend on by default.

Mounts in the box are private to it except under :attr:`SystemdBox.share`, a bind mount
made shared before the box starts: a FUSE mount a service makes there appears on the host
too (and an unmount either side reaches the other). That needs the host's mounts to be
private (so the box's own /run, /dev... do not propagate back): :func:`unavailable` checks.

``systemctl`` runs in the box's mount and PID namespaces (``nsenter``) and talks to the
manager over its private socket, as root does without D-Bus. Example::

    with SystemdBox(tmp_path / "box") as box:
        (box.units / "demo.service").write_text(...)
        box.systemctl("daemon-reload")
        box.systemctl("start", "demo.service")
        box.show("demo.service", "MainPID")  # {"MainPID": "12"}: a PID in the box
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from types import TracebackType

from tests.waiting import wait_for

SYSTEMD = "/lib/systemd/systemd"

# PID 1 of the new PID namespace runs this, then execs systemd. $1: the box's directory.
INIT = """\
set -e
B=$1
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
mount -t tmpfs -o mode=0755,nosuid tmpfs /dev
mknod -m 666 /dev/null c 1 3; mknod -m 666 /dev/zero c 1 5; mknod -m 666 /dev/full c 1 7
mknod -m 666 /dev/random c 1 8; mknod -m 666 /dev/urandom c 1 9
mknod -m 666 /dev/tty c 5 0; mknod -m 666 /dev/fuse c 10 229
ln -s /proc/self/fd /dev/fd; ln -s /proc/self/fd/0 /dev/stdin
ln -s /proc/self/fd/1 /dev/stdout; ln -s /proc/self/fd/2 /dev/stderr
touch /dev/console; mount --bind "$B/console.log" /dev/console
mount --bind /proc/sys /proc/sys; mount -o remount,bind,ro /proc/sys
mount -o remount,bind,ro /sys
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup
mount --bind "$B/machine-id" /etc/machine-id
exec env -i container=qosfs-test SYSTEMD_UNIT_PATH="$B/units" \\
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    /lib/systemd/systemd --unit=box.target --log-target=console --log-level=info
"""

# Services depend on these by default (DefaultDependencies=yes); nothing is behind them.
STAND_INS = ("box", "sysinit", "basic", "shutdown")

# Every service's output goes to one file (there is no journald in the box).
SERVICE_DEFAULTS = """\
[Service]
StandardOutput=append:{journal}
StandardError=inherit
"""


def cgroup2_mount() -> Path | None:
    """Where this process's cgroup2 hierarchy is mounted (unified or hybrid), if at all."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if fields[fields.index("-") + 1] == "cgroup2":
                return Path(fields[4])
    return None


def unavailable() -> str | None:
    """Why a box cannot start here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("unshare", "nsenter", "systemctl"):
        if shutil.which(tool) is None:
            return f"{tool} missing"
    if not os.access(SYSTEMD, os.X_OK):
        return f"{SYSTEMD} missing"
    if cgroup2_mount() is None:
        return "no cgroup2 hierarchy mounted"
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if fields[4] == "/" and any(o.startswith("shared:") for o in fields[6:]):
                return ("/ has shared propagation: the box's own mounts would reach the "
                        "host (a systemd host; this box is for machines without one)")
    return None


class SystemdBox:
    """systemd as PID 1 of new namespaces; :meth:`close` leaves no process, mount or
    cgroup behind (it kills only the box's own)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.units = root / "units"
        self.share = root / "share"
        self.journal = root / "journal.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0  # systemd's PID on the host
        cgroup2 = cgroup2_mount()
        assert cgroup2 is not None
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            [mine] = [line.strip()[3:] for line in f if line.startswith("0::")]
        self.cgroup = cgroup2 / mine.lstrip("/") / f"qosfs-box-{uuid.uuid4().hex[:12]}"

    def __enter__(self) -> SystemdBox:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self, timeout: float = 30.0) -> None:
        for path in (self.units / "service.d", self.share):
            path.mkdir(parents=True, exist_ok=True)
        for name in STAND_INS:
            (self.units / f"{name}.target").write_text(
                f"[Unit]\nDescription=test box stand-in for {name}.target\n")
        (self.units / "service.d" / "box.conf").write_text(
            SERVICE_DEFAULTS.format(journal=self.journal))
        (self.root / "console.log").touch()
        (self.root / "machine-id").write_text(uuid.uuid4().hex + "\n")
        (self.root / "init.sh").write_text(INIT)
        subprocess.run(["mount", "--bind", str(self.share), str(self.share)], check=True)
        subprocess.run(["mount", "--make-private", str(self.share)], check=True)
        subprocess.run(["mount", "--make-shared", str(self.share)], check=True)
        self.cgroup.mkdir()
        with open(self.root / "unshare.log", "wb") as log:
            # The shell joins the box's cgroup, then becomes unshare (the cgroup
            # namespace's root is the cgroup it is in), whose child becomes PID 1.
            self.proc = subprocess.Popen(
                ["sh", "-c", 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"', "sh",
                 str(self.cgroup), "unshare", "--pid", "--fork", "--mount-proc", "--mount",
                 "--propagation", "unchanged", "--cgroup", "--uts", "--ipc", "--net", "--",
                 "sh", str(self.root / "init.sh"), str(self.root)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/")
        self.pid = wait_for("the box's PID 1", self._child, timeout=timeout)
        wait_for("the box's systemd to come up", self._state, timeout=timeout,
                 until=lambda s: s in ("running", "degraded"), interval=0.05)

    def _child(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the box exited with {self.proc.returncode}: "
                                 f"{(self.root / 'unshare.log').read_text()}")
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                children = f.read().split()
        except FileNotFoundError:
            return 0
        if not children:
            return 0
        with open(f"/proc/{children[0]}/cmdline", "rb") as f:
            return int(children[0]) if f.read().startswith(SYSTEMD.encode()) else 0

    def _state(self) -> str:
        return self.systemctl("is-system-running", check=False).stdout.strip()

    def run(self, *argv: str, check: bool = True,
            timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """*argv* in the box's mount and PID namespaces (its /run, its PIDs)."""
        done = subprocess.run(["nsenter", "-t", str(self.pid), "-m", "-p", "--", *argv],
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode:
            raise AssertionError(f"{argv} failed ({done.returncode}): "
                                 f"{done.stdout}{done.stderr}\njournal:\n{self.log()}")
        return done

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", "--no-pager", *args, check=check)

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in properties)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def host_pid(self, box_pid: int) -> int:
        """The host's PID of the box's process *box_pid*: among the processes of the box's
        cgroups, the one whose innermost PID (``NSpid``'s last) is *box_pid*."""
        for procs in self.cgroup.rglob("cgroup.procs"):
            for pid in procs.read_text().split():
                try:
                    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
                        nspid = next(line for line in f if line.startswith("NSpid:"))
                except (FileNotFoundError, ProcessLookupError):
                    continue  # exited meanwhile
                if int(nspid.split()[-1]) == box_pid:
                    return int(pid)
        raise AssertionError(f"no process {box_pid} in the box")

    def log(self) -> str:
        return self.journal.read_text(errors="replace") if self.journal.exists() else ""

    def close(self) -> None:
        """Stop what runs in the box, kill its PID 1 (which ends its PID namespace), then
        remove its cgroups and whatever mount is left under :attr:`share`."""
        if self.pid and self.proc is not None and self.proc.poll() is None:
            # The services first, so a daemon unmounts what it mounted.
            self.systemctl("stop", "*.service", check=False)
            os.kill(self.pid, signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.cgroup.exists():
            # Anything that escaped the PID namespace's end (nothing should) dies here.
            (self.cgroup / "cgroup.kill").write_text("1")
            wait_for("the box's cgroup to empty", self._cgroup_empty, timeout=20)
            for path in sorted((p for p in self.cgroup.rglob("*") if p.is_dir()),
                               key=lambda p: len(p.parts), reverse=True):
                path.rmdir()
            self.cgroup.rmdir()
        for mountpoint in reversed(self._mounts_under_share()):
            subprocess.run(["umount", "-l", mountpoint], capture_output=True)

    def _cgroup_empty(self) -> bool:
        return "populated 0" in (self.cgroup / "cgroup.events").read_text()

    def _mounts_under_share(self) -> list[str]:
        share = str(self.share)
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            points = [line.split()[4] for line in f]
        return [p for p in points if p == share or p.startswith(share + "/")]


def wait_until_serving(path: Path, timeout: float) -> float:
    """Seconds until a listing of *path* (a mountpoint) answers, polling every 20 ms."""
    start = time.monotonic()

    def serving() -> bool:
        try:
            os.listdir(path)
        except OSError:
            return False
        return True

    wait_for(f"{path} to serve", serving, timeout=timeout)
    return time.monotonic() - start
