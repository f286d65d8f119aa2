"""A real redis-server for the cluster tests: on a Unix socket in a temporary directory,
no persistence, stopped (by its PID) however the test ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import redis

from tests.waiting import wait_for


class RedisServer:
    """``start()``, ``kill()`` (SIGKILL: a crash, nothing saved) and ``start()`` again on
    the same socket, as a restarted site Redis would come back."""

    def __init__(self, directory: Path, *extra: str) -> None:
        self.directory = directory
        self.extra = list(extra)  # more redis-server options, e.g. --requirepass
        self.socket = str(directory / "redis.sock")
        self.url = f"unix://{self.socket}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is installed by `make deps` (Makefile)"
        self.proc = proc = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", str(self.directory), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def answers() -> bool:
            try:
                return bool(redis.Redis(unix_socket_path=self.socket).ping())
            except redis.AuthenticationError:
                return True  # up, and asking for the password it was given
            except redis.RedisError:
                assert proc.poll() is None, "redis-server exited at start"
                return False

        wait_for("redis-server to answer", answers, timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
        if os.path.exists(self.socket):
            os.unlink(self.socket)

    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=self.socket, decode_responses=True)
