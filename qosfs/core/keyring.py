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

A name is found by anyone the keyring lets search it, so another user could make one
of the same name first and have the daemon join it (and with it possess the keys the
daemon links in). So the name carries a keyed hash of the mountpoint, the key a secret
only root reads (``/run/qosfs/keyring.secret``, made by the first daemon of the boot),
and a keyring found under it that is not the daemon's own user's is left at once for
an anonymous one (counted right, but not by a successor).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from pathlib import Path

from qosfs.core.syscalls import keyctl as _keyctl

log = logging.getLogger(__name__)

_GET_KEYRING_ID, _JOIN_SESSION_KEYRING, _SETPERM, _DESCRIBE, _LINK = 0, 1, 5, 6, 8
_SPEC_SESSION_KEYRING = -3
# Possessor: everything; same uid: view, read, search, link. Search is what lets a
# successor, which does not possess it yet, find it by name.
_PERM = 0x3F1B0000

PREFIX = "qosfs:"
SECRET = Path("/run/qosfs/keyring.secret")


def _owner(serial: int) -> int:
    """The uid that owns key *serial* (its description: type;uid;gid;perm;name)."""
    buf = ctypes.create_string_buffer(4096)
    _keyctl(_DESCRIBE, serial, ctypes.addressof(buf), len(buf))
    return int(buf.value.split(b";")[1])


def _secret(path: Path) -> bytes | None:
    """The boot's secret for keyring names, made if need be; None if it cannot be had
    (no /run/qosfs of ours: not root)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        try:
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, os.urandom(32))
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # whole or not at all; a daemon starting beside us wins
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
            st = path.stat()
        except OSError:
            return None
    except OSError:
        return None
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None  # not made by a daemon of ours
    try:
        return path.read_bytes()
    except OSError:
        return None


def keyring_name(mountpoint: str, secret_path: Path = SECRET) -> str:
    """The session keyring's name for *mountpoint*: a keyed hash with the boot's secret
    where there is one (no one else can know it), else the mountpoint alone."""
    secret = _secret(secret_path)
    if secret is None:
        return PREFIX + mountpoint
    tag = hashlib.blake2b(mountpoint.encode(), key=secret[:64], digest_size=12).hexdigest()
    return f"{PREFIX}{mountpoint}:{tag}"


def join_mount_keyring(mountpoint: str, secret_path: Path = SECRET) -> tuple[int | None, str]:
    """Join (made if need be) the session keyring of *mountpoint*: (its serial, "") or
    (None, why not: keyctl refused, as by a container's seccomp profile)."""
    if os.uname().machine != "x86_64":
        return None, f"keyctl not wired for {os.uname().machine}"
    name = keyring_name(mountpoint, secret_path)
    try:
        before = _keyctl(_GET_KEYRING_ID, _SPEC_SESSION_KEYRING, 0)
        serial = _keyctl(_JOIN_SESSION_KEYRING, name.encode())
        owner = _owner(serial)
        if owner != os.geteuid():
            log.warning("a keyring named %s belongs to uid %d: joining an anonymous one "
                        "(a successor will not count the reads of the backing ids it "
                        "inherits from this daemon)", name, owner)
            serial = _keyctl(_JOIN_SESSION_KEYRING, 0)
        _keyctl(_SETPERM, serial, _PERM)
    except OSError as exc:
        return None, f"session keyring: {exc.strerror}"
    if before != serial:
        try:
            _keyctl(_LINK, before, serial)
        except OSError as exc:  # nothing of qosfs's own needs them
            log.warning("the keys of the session keyring before %s are not reachable "
                        "from it: %s", name, exc.strerror)
    return serial, ""
