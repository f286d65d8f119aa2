"""A successor that fails on purpose, for tests/mount/test_upgrade.py: it connects to a
serving daemon's handover socket (qosfs.daemon.takeover.offer) and stops where it is told to.

    python -m tests.mount.upgrade_peer HANDOVER_SOCKET MODE

MODE: ``wrong-protocol`` (says adopt with another protocol), ``previous-build`` (says
adopt as the build before protocol 2 did: ``protocol`` 1 alone), ``refuse`` (refuses after
receiving the session), ``vanish-at-prepare`` (exits after receiving it),
``vanish-after-ready`` (says ready, then exits without taking anything over: the old
daemon has stopped reading by then and must take its session back). Prints what it was
answered on stdout, one line.
"""

from __future__ import annotations

import os
import socket
import sys

from qosfs.daemon.takeover import fuse_session
from qosfs.daemon.takeover.offer import PROTOCOL, adopt_hello


def main(argv: list[str]) -> int:
    path, mode = argv
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    hello = {**adopt_hello(), "version": "peer"}
    if mode == "wrong-protocol":
        hello["protocol"], hello["protocols"] = PROTOCOL + 1000, [PROTOCOL + 1000]
    elif mode == "previous-build":
        hello = {"protocol": 1, "version": "peer", "pid": os.getpid()}
    fuse_session.send_message(sock, "adopt", hello)
    reply = fuse_session.receive_message(sock)
    for fd in reply.fds:
        os.close(fd)
    print(reply.kind, reply.payload.get("reason", ""), flush=True)
    if mode == "refuse":
        fuse_session.send_message(sock, "refuse", {"reason": "told to"})
    elif mode == "vanish-after-ready":
        fuse_session.send_message(sock, "ready", {})
        fuse_session.receive_message(sock)  # the first message of the commit: then gone
    sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
