"""The mount's session keyring: what tells its passed-through reads from any other's.

A read passed through to the kernel runs with the credentials the daemon had when it
registered the file's backing id (``fuse_backing_open`` keeps ``prepare_creds()`` of the
registering thread, and ``backing_file_read_iter`` puts them in force for the read). Two
mounts of one source that both have a file open, or overlayfs over the same disk, read
the same backing inode; the read counting (:mod:`qosfs.passthrough.read_programs`) sees
only that inode, so without more each mount counted the other's reads as its own.

What the credentials carry and a read's program can compare cheaply is the session
keyring: a pointer in ``struct cred``, whose key has a serial number user space knows.
So the daemon joins a session keyring of its own, named after its mountpoint, before it
registers any backing id, and the programs count a read only if the credentials in force
hold that keyring. A successor (a handover, a restart after a crash) joins the same one
by name, so the backing ids it inherits and those it registers count alike.

Keys the daemon looked up before (a network filesystem's credentials, say) stay
reachable: the session keyring it had is linked into the new one. Nothing else changes:
a keyring plays no part in file permissions. Only the calling thread's credentials
change (threads started later inherit them): call it on the thread that registers
backing ids, before it starts others.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long

_SYS_KEYCTL = 250  # x86_64
_GET_KEYRING_ID, _JOIN_SESSION_KEYRING, _SETPERM, _LINK = 0, 1, 5, 8
_SPEC_SESSION_KEYRING = -3
# Possessor: everything; same uid: view, read, search, link. Search is what lets a
# successor, which does not possess it yet, find it by name.
_PERM = 0x3F1B0000

PREFIX = "qosfs:"


def _keyctl(*args: int | bytes) -> int:
    ret = int(_libc.syscall(ctypes.c_long(_SYS_KEYCTL),
                            *(a if isinstance(a, bytes) else ctypes.c_long(a) for a in args)))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def join_mount_keyring(mountpoint: str) -> tuple[int | None, str]:
    """Join (made if need be) the session keyring of *mountpoint*: (its serial, "") or
    (None, why not: keyctl refused, as by a container's seccomp profile)."""
    if os.uname().machine != "x86_64":
        return None, f"keyctl not wired for {os.uname().machine}"
    try:
        before = _keyctl(_GET_KEYRING_ID, _SPEC_SESSION_KEYRING, 0)
        serial = _keyctl(_JOIN_SESSION_KEYRING, (PREFIX + mountpoint).encode())
        _keyctl(_SETPERM, serial, _PERM)
    except OSError as exc:
        return None, f"session keyring: {exc.strerror}"
    if before != serial:
        try:
            _keyctl(_LINK, before, serial)
        except OSError as exc:  # nothing of qosfs's own needs them
            log.warning("the keys of the session keyring before %s are not reachable "
                        "from it: %s", PREFIX + mountpoint, exc.strerror)
    return serial, ""
