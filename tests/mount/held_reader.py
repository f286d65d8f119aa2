"""A descriptor held open under a mount across the death of its daemon, in a process of
its own: the test process must hold nothing open under the mount when it starts the new
daemon (the forked child's exec closes every close-on-exec descriptor it inherited, and
closing a FUSE file waits for the dead daemon's answer to its FLUSH: the exec hung until
the keeper let the connection go, 30 s later).

``python -m tests.mount.held_reader PATH`` opens PATH, reads its first half, says
``{"ready": SIZE}``, waits for a line on standard input, reads the rest through the same
descriptor, and says ``{"digest": XXH3_128}`` of everything it read (or ``{"errno": N}``).
:class:`HeldReader` is the test's side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import xxhash

from tests.mounting import ROOT, abort_connection


def _say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    digest = xxhash.xxh3_128()
    digest.update(os.pread(fd, size // 2, 0))
    _say(ready=size)
    sys.stdin.readline()
    try:
        offset = size // 2
        while offset < size:
            chunk = os.pread(fd, min(1 << 20, size - offset), offset)
            if not chunk:
                break
            digest.update(chunk)
            offset += len(chunk)
    except OSError as exc:
        _say(errno=exc.errno)
        return
    _say(digest=digest.hexdigest())


class HeldReader:
    """The reader process: started with its descriptor open and half read."""

    def __init__(self, path: Path, python: str = sys.executable) -> None:
        self.proc = subprocess.Popen([python, "-m", "tests.mount.held_reader", str(path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=ROOT, text=True)
        first = self._line()
        assert "ready" in first, first

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the reader exited with {self.proc.wait(10)}"
        found: dict[str, Any] = json.loads(line)
        return found

    def finish(self, timeout: float = 60.0) -> dict[str, Any]:
        """Read the rest; the reader's last word (``digest`` or ``errno``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        last = self._line()
        self.proc.wait(timeout)
        return last

    def close(self, mountpoint: Path) -> None:
        """End the reader, whatever state the mount is in."""
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:  # in a request nobody will answer
                abort_connection(mountpoint)
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


if __name__ == "__main__":
    main(sys.argv[1])
