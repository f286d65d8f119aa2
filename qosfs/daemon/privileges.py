"""Root's resource privileges stay with root: the daemon does not lend them to users.

The daemon acts on every user's files as root, but two of root's privileges are about
resources, not access, and a user's writes through the mount must not get them:

* ``CAP_SYS_RESOURCE`` lifts quota hard limits (ext4/xfs quotas; the Lustre client
  writes without quota for it) and opens ext4's reserved blocks. Nothing the daemon does
  after starting needs it (raising ``RLIMIT_NOFILE`` up to the hard limit does not, nor
  do the sysfs knobs), so :func:`drop_capability` removes it from every set before the
  mount serves. systemd's unit never grants it (``CapabilityBoundingSet=``).
* ext4 also gives its reserved blocks (``mkfs.ext4 -m``, 5 % by default) to the
  filesystem uid ``resuid``, root by default, with or without the capability. So when
  the backing store reserves blocks, a file opened by a non-root caller is written with
  that caller's fsuid (:func:`qosfs.core.syscalls.setfsuid` around the ``pwrite``, in
  whichever thread issues it): the filesystem sees who writes, as it would natively.
  Root callers keep fsuid 0 and so keep the reserve, as natively. Switching costs two
  system calls per write (~4 us on the test VM, within the noise of a ~100 us 4 KiB
  write round trip), and is done only where a reserve exists.

Only data writes switch: metadata (mkdir, xattrs) still allocates as root, a few blocks
at most. ext4's ``resgid`` reserve is not mirrored (the daemon's groups are its own).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from qosfs.core import syscalls

log = logging.getLogger(__name__)

CAP_SETPCAP = 8
CAP_SYS_RESOURCE = 24

_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_PR_CAPBSET_DROP = 24

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


_CapPair = _CapData * 2  # version 3: capabilities 0-31, then 32-63

_libc.capget.argtypes = [ctypes.POINTER(_CapHeader), ctypes.POINTER(_CapData)]
_libc.capset.argtypes = [ctypes.POINTER(_CapHeader), ctypes.POINTER(_CapData)]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]


def _capget() -> tuple[_CapHeader, ctypes.Array[_CapData]]:
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), _CapPair()
    if _libc.capget(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capget: {os.strerror(err)}")
    return header, data


def has_capability(cap: int) -> bool:
    """Whether *cap* is in this thread's effective set."""
    _, data = _capget()
    return bool(data[cap // 32].effective & (1 << (cap % 32)))


def drop_capability(cap: int) -> None:
    """Remove *cap* from the effective, permitted and inheritable sets (so from the
    ambient set too), and from the bounding set where CAP_SETPCAP allows, so that no
    program the daemon starts gets it back. Raises OSError if capset fails."""
    header, data = _capget()
    mask = ~(1 << (cap % 32)) & 0xFFFFFFFF
    word = data[cap // 32]
    word.effective &= mask
    word.permitted &= mask
    word.inheritable &= mask
    if _libc.capset(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")
    if has_capability(CAP_SETPCAP) and _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_CAPBSET_DROP): {os.strerror(err)}")


def reserves_blocks(fd: int) -> bool:
    """Whether the filesystem of *fd* keeps blocks that only privileged writers get
    (free blocks beyond what unprivileged users may use)."""
    sv = os.fstatvfs(fd)
    return sv.f_bfree > sv.f_bavail


def can_switch_fsuid() -> bool:
    """Whether setfsuid works here (it needs CAP_SETUID, and fails silently)."""
    probe = 65534
    syscalls.setfsuid(probe)
    try:
        return syscalls.setfsuid(0xFFFFFFFF) == probe  # an invalid uid: only reports
    finally:
        syscalls.setfsuid(0)


def shed_resource_privileges(root_fd: int) -> bool:
    """Drop CAP_SYS_RESOURCE, then decide whether writes must run as their caller.

    Returns True if non-root callers' data writes should switch fsuid (see the module
    docstring). Call as root, after everything that could need the capability and
    before serving, from the thread that starts the others.
    """
    try:
        drop_capability(CAP_SYS_RESOURCE)
    except OSError as exc:  # never seen: capset may always lower
        log.warning("could not drop CAP_SYS_RESOURCE: %s", exc.strerror)
    if not reserves_blocks(root_fd):
        return False
    if not can_switch_fsuid():
        log.warning("the backing filesystem reserves blocks for root and setfsuid is not "
                    "permitted (no CAP_SETUID): users' writes may use root's reserve")
        return False
    log.info("the backing filesystem reserves blocks: writes run with the opener's fsuid")
    return True
