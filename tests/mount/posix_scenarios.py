"""POSIX scenarios run twice: on a plain directory and through qosfs; the logs must match.

Each scenario takes a root directory and returns a list of observations (results or
errno names, stat fields that do not depend on when the test ran). Run as any uid:
``python -m tests.mount.posix_scenarios ROOT SCENARIO`` prints the JSON log, so the same
code can be replayed as an unprivileged user in a subprocess.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from typing import Any

Obs = list[Any]


def attempt(log: Obs, label: str, fn: Callable[[], Any]) -> Any:
    """Run *fn*, log its result or its errno name under *label*."""
    try:
        result = fn()
    except OSError as exc:
        log.append([label, "error", errno.errorcode.get(exc.errno or 0, str(exc.errno))])
        return None
    log.append([label, "ok", result if isinstance(result, (int, str, bool, list)) else None])
    return result


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def st_fields(path: str, follow: bool = True) -> dict[str, Any]:
    st = os.stat(path, follow_symlinks=follow)
    return {
        "type": stat.S_IFMT(st.st_mode), "mode": oct(stat.S_IMODE(st.st_mode)),
        "nlink": st.st_nlink, "uid": st.st_uid, "gid": st.st_gid,
        "size": st.st_size if not stat.S_ISDIR(st.st_mode) else None,
        "rdev": st.st_rdev,
    }


def s_files(root: str) -> Obs:
    log: Obs = []
    p = os.path.join(root, "f")
    old = os.umask(0o027)
    try:
        fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o666)
    finally:
        os.umask(old)
    os.write(fd, b"hello world")
    os.close(fd)
    log.append(["stat", st_fields(p)])
    attempt(log, "excl", lambda: os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    attempt(log, "missing", lambda: os.open(os.path.join(root, "nope"), os.O_RDONLY))
    attempt(log, "notdir", lambda: os.open(p, os.O_RDONLY | os.O_DIRECTORY))
    attempt(log, "under-file", lambda: os.open(os.path.join(p, "x"), os.O_RDONLY))
    with open(p, "ab") as f:
        f.write(b"!")
    with open(p, "rb") as f:
        log.append(["content", f.read().decode()])
    fd = os.open(p, os.O_RDWR)
    os.pwrite(fd, b"X", 100)  # sparse gap
    log.append(["sparse", os.pread(fd, 200, 0).hex(), os.fstat(fd).st_size])
    os.ftruncate(fd, 5)
    log.append(["ftruncate", os.pread(fd, 100, 0).decode()])
    os.close(fd)
    os.truncate(p, 3)
    log.append(["truncate", _read(p).decode()])
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    log.append(["o_trunc", os.stat(p).st_size])
    os.chmod(p, 0o640)
    log.append(["chmod", st_fields(p)["mode"]])
    os.utime(p, ns=(1_000_000_123, 2_000_000_456))
    st = os.stat(p)
    log.append(["utime", st.st_atime_ns, st.st_mtime_ns])
    subprocess.run(["touch", "-m", "-d", "@5", p], check=True)  # atime untouched (UTIME_OMIT)
    st = os.stat(p)
    log.append(["utime-omit", st.st_atime_ns, st.st_mtime_ns])
    attempt(log, "unlink-dir", lambda: os.unlink(root))
    attempt(log, "rmdir-file", lambda: os.rmdir(p))
    d = os.path.join(root, "d")
    os.mkdir(d, 0o750)
    log.append(["mkdir", st_fields(d)])
    attempt(log, "mkdir-exists", lambda: os.mkdir(d))
    open(os.path.join(d, "inner"), "w").close()
    attempt(log, "rmdir-notempty", lambda: os.rmdir(d))
    log.append(["listdir", sorted(os.listdir(root)), sorted(os.listdir(d))])
    attempt(log, "long-name", lambda: os.open(os.path.join(root, "n" * 300), os.O_CREAT, 0o600))
    os.unlink(os.path.join(d, "inner"))
    os.rmdir(d)
    attempt(log, "statvfs-bsize", lambda: os.statvfs(root).f_bsize)
    return log


def s_rename(root: str) -> Obs:
    from qosfs.core.syscalls import RENAME_EXCHANGE, RENAME_NOREPLACE, renameat2

    log: Obs = []

    def path(name: str) -> str:
        return os.path.join(root, name)

    for name, data in (("a", b"A"), ("b", b"B")):
        with open(path(name), "wb") as f:
            f.write(data)
    os.mkdir(path("dir"))
    os.mkdir(path("full"))
    open(path("full/x"), "w").close()

    def rn(a: str, b: str, flags: int = 0) -> None:
        renameat2(-100, path(a).encode(), -100, path(b).encode(), flags)

    attempt(log, "noreplace", lambda: rn("a", "b", RENAME_NOREPLACE))
    attempt(log, "exchange", lambda: rn("a", "b", RENAME_EXCHANGE))
    log.append(["after-exchange", _read(path("a")).decode(),
                _read(path("b")).decode()])
    attempt(log, "exchange-missing", lambda: rn("a", "zz", RENAME_EXCHANGE))
    attempt(log, "overwrite", lambda: rn("a", "b"))
    log.append(["after-overwrite", sorted(os.listdir(root)), _read(path("b")).decode()])
    attempt(log, "file-over-dir", lambda: rn("b", "dir"))
    attempt(log, "dir-over-full", lambda: rn("dir", "full"))
    attempt(log, "dir-into-itself", lambda: rn("dir", "dir/sub"))
    attempt(log, "missing", lambda: rn("nope", "x"))
    attempt(log, "dir-move", lambda: rn("dir", "full/dir"))
    log.append(["final", sorted(os.listdir(root)), sorted(os.listdir(path("full")))])
    return log


def s_links(root: str) -> Obs:
    log: Obs = []
    f = os.path.join(root, "f")
    with open(f, "w") as fh:
        fh.write("data")
    os.link(f, os.path.join(root, "hard"))
    log.append(["nlink", os.stat(f).st_nlink,
                os.stat(f).st_ino == os.stat(os.path.join(root, "hard")).st_ino])
    attempt(log, "link-exists", lambda: os.link(f, os.path.join(root, "hard")))
    os.symlink("f", os.path.join(root, "sym"))
    os.symlink("missing", os.path.join(root, "dangling"))
    os.symlink("/etc/hostname", os.path.join(root, "abs"))
    log.append(["readlink", os.readlink(os.path.join(root, "sym")),
                os.readlink(os.path.join(root, "abs"))])
    log.append(["lstat", st_fields(os.path.join(root, "sym"), follow=False)["type"]])
    log.append(["stat-through", _read(os.path.join(root, "sym")).decode()])
    attempt(log, "dangling", lambda: os.stat(os.path.join(root, "dangling")))
    attempt(log, "readlink-file", lambda: os.readlink(f))
    os.link(os.path.join(root, "sym"), os.path.join(root, "symhard"), follow_symlinks=False)
    log.append(["symlink-hardlink", os.readlink(os.path.join(root, "symhard")),
                os.lstat(os.path.join(root, "sym")).st_nlink])
    os.unlink(f)
    log.append(["after-unlink", _read(os.path.join(root, "hard")).decode(),
                os.stat(os.path.join(root, "hard")).st_nlink])
    fd = os.open(os.path.join(root, "hard"), os.O_RDWR)
    os.unlink(os.path.join(root, "hard"))
    os.pwrite(fd, b"still", 0)
    log.append(["unlinked-open", os.pread(fd, 10, 0).decode(), os.fstat(fd).st_nlink])
    os.close(fd)
    log.append(["final", sorted(os.listdir(root))])
    return log


def s_xattr(root: str) -> Obs:
    log: Obs = []
    f = os.path.join(root, "f")
    open(f, "w").close()
    os.setxattr(f, "user.one", b"1")
    os.setxattr(f, "user.two", b"\x00binary\xff")
    log.append(["get", os.getxattr(f, "user.two").hex()])
    log.append(["list", sorted(os.listxattr(f))])
    attempt(log, "missing", lambda: os.getxattr(f, "user.none"))
    attempt(log, "create-exists", lambda: os.setxattr(f, "user.one", b"x", os.XATTR_CREATE))
    attempt(log, "replace-missing", lambda: os.setxattr(f, "user.new", b"x", os.XATTR_REPLACE))
    os.removexattr(f, "user.one")
    attempt(log, "remove-missing", lambda: os.removexattr(f, "user.one"))
    log.append(["list-after", sorted(os.listxattr(f))])
    os.symlink("f", os.path.join(root, "sym"))
    attempt(log, "symlink-user-xattr",
            lambda: os.setxattr(os.path.join(root, "sym"), "user.x", b"1", follow_symlinks=False))
    d = os.path.join(root, "d")
    os.mkdir(d)
    os.setxattr(d, "user.dir", b"yes")
    log.append(["dir", os.getxattr(d, "user.dir").decode()])
    attempt(log, "big", lambda: os.setxattr(f, "user.big", b"x" * 70000))
    return log


def s_special(root: str) -> Obs:
    log: Obs = []
    os.mkfifo(os.path.join(root, "fifo"), 0o640)
    log.append(["fifo", st_fields(os.path.join(root, "fifo"))])
    sock = socket.socket(socket.AF_UNIX)
    try:
        attempt(log, "socket", lambda: sock.bind(os.path.join(root, "sock")))
        log.append(["socket-type", stat.S_ISSOCK(os.lstat(os.path.join(root, "sock")).st_mode)])
    finally:
        sock.close()
    if os.geteuid() == 0:
        os.mknod(os.path.join(root, "null"), 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        log.append(["chardev", st_fields(os.path.join(root, "null"))])
        with open(os.path.join(root, "null"), "rb") as f:
            log.append(["read-null", f.read()])
    return log


def s_names(root: str) -> Obs:
    """Names with odd bytes: not UTF-8, control characters, the 255-byte limit."""
    log: Obs = []
    base = os.fsencode(root)
    names = [b"\xff\xfe-not-utf8", b"new\nline", b"tab\there", b"-dash", b" lead space",
             b"back\\slash", b"caf\xc3\xa9", b"\x01ctl", b"n" * 255, b"\xff" * 255,
             b"\xe2\x80\xae-rtl.pt"]
    for name in names:
        path = os.path.join(base, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
        os.write(fd, name)
        os.close(fd)
        log.append(["create", name.hex(), os.stat(path).st_size, _read(path) == name])
    log.append(["listdir", sorted(n.hex() for n in os.listdir(base))])
    attempt(log, "256-bytes", lambda: os.open(os.path.join(base, b"n" * 256), os.O_CREAT, 0o600))
    attempt(log, "256-mkdir", lambda: os.mkdir(os.path.join(base, b"\xff" * 256)))
    odd = os.path.join(base, names[0])
    os.rename(odd, os.path.join(base, names[1] + b".moved"))
    os.link(os.path.join(base, names[2]), os.path.join(base, b"\xfe-hard"))
    os.symlink(names[1] + b".moved", os.path.join(base, b"\xfd-sym"))
    log.append(["symlink", os.readlink(os.path.join(base, b"\xfd-sym")).hex(),
                _read(os.path.join(base, b"\xfd-sym")) == names[0]])
    os.setxattr(os.path.join(base, names[8]), b"user.\xff\n", b"v")
    log.append(["xattr", [n.encode("utf-8", "surrogateescape").hex()
                          for n in os.listxattr(os.path.join(base, names[8]))]])
    d = os.path.join(base, b"dir\n\xff")
    os.mkdir(d)
    os.rename(os.path.join(base, names[9]), os.path.join(d, names[9]))
    log.append(["in-dir", [n.hex() for n in os.listdir(d)]])
    for name in names[2:8]:
        os.unlink(os.path.join(base, name))
    log.append(["final", sorted(n.hex() for n in os.listdir(base))])
    return log


def s_user(root: str) -> Obs:
    """Run as an unprivileged user inside a world-writable sticky directory."""
    log: Obs = []
    me = os.getuid()
    shared = os.path.join(root, "shared")
    f = os.path.join(shared, f"mine-{me}")
    fd = os.open(f, os.O_CREAT | os.O_WRONLY, 0o644)
    os.close(fd)
    st = os.stat(f)
    log.append(["owner", st.st_uid == me, st.st_gid == os.getgid()])
    os.mkdir(os.path.join(shared, f"dir-{me}"))
    log.append(["dir-owner", os.stat(os.path.join(shared, f"dir-{me}")).st_uid == me])
    os.symlink("x", os.path.join(shared, f"sym-{me}"))
    log.append(["sym-owner", os.lstat(os.path.join(shared, f"sym-{me}")).st_uid == me])
    attempt(log, "read-secret", lambda: _read(os.path.join(root, "secret")).decode())
    attempt(log, "write-secret", lambda: os.open(os.path.join(root, "secret"), os.O_WRONLY))
    attempt(log, "chmod-others", lambda: os.chmod(os.path.join(root, "secret"), 0o666))
    attempt(log, "chown-own", lambda: os.chown(f, 0, -1))
    attempt(log, "chown-noop-others", lambda: os.chown(os.path.join(root, "secret"), -1, -1))
    attempt(log, "unlink-sticky-others", lambda: os.unlink(os.path.join(shared, "roots")))
    attempt(log, "rename-sticky-others",
            lambda: os.rename(os.path.join(shared, "roots"), os.path.join(shared, "moved")))
    attempt(log, "create-in-readonly", lambda: open(os.path.join(root, "ro", "x"), "w"))  # noqa: SIM115 (the open is what fails)
    attempt(log, "list-noexec-dir", lambda: os.listdir(os.path.join(root, "noexec")))
    attempt(log, "utime-others", lambda: os.utime(os.path.join(root, "secret"), ns=(1, 1)))
    attempt(log, "touch-now-others", lambda: os.utime(os.path.join(shared, "roots-rw")))
    sg = os.path.join(root, "setgid", f"new-{me}")
    open(sg, "w").close()
    log.append(["setgid-inherit", os.stat(sg).st_gid])
    os.mkdir(sg + "-d")
    log.append(["setgid-dir", os.stat(sg + "-d").st_gid,
                bool(os.stat(sg + "-d").st_mode & stat.S_ISGID)])
    suid = os.path.join(shared, f"suid-{me}")
    fd = os.open(suid, os.O_CREAT | os.O_WRONLY, 0o755)
    os.close(fd)
    os.chmod(suid, 0o4755)
    log.append(["suid-set", oct(stat.S_IMODE(os.stat(suid).st_mode))])
    attempt(log, "hardlink-others", lambda: os.link(os.path.join(root, "secret"),
                                                      os.path.join(shared, f"ln-{me}")))
    attempt(log, "write-others-suid",
            lambda: os.write(os.open(os.path.join(shared, "roots-suid"), os.O_WRONLY), b"x"))
    log.append(["others-suid-after", oct(stat.S_IMODE(os.stat(os.path.join(shared,
                                                                         "roots-suid")).st_mode))])
    secret = os.path.join(root, "secret")
    attempt(log, "truncate-others", lambda: os.truncate(secret, 0))
    attempt(log, "trunc-open-others", lambda: os.open(secret, os.O_WRONLY | os.O_TRUNC))
    attempt(log, "xattr-others", lambda: os.setxattr(os.path.join(shared, "roots"), "user.x",
                                                     b"1"))
    attempt(log, "chgrp-not-member", lambda: os.chown(f, -1, 0))
    # setgid on an own file whose group the caller is not in: dropped, no error
    attempt(log, "chmod-setgid-own", lambda: os.chmod(sg, 0o2755))
    log.append(["setgid-non-member", oct(stat.S_IMODE(os.stat(sg).st_mode))])
    attempt(log, "rmdir-sticky-others", lambda: os.rmdir(os.path.join(shared, "roots-dir")))
    attempt(log, "follow-others-link-sticky",
            lambda: _read(os.path.join(shared, "others-link")).decode())
    attempt(log, "mknod-device", lambda: os.mknod(os.path.join(shared, f"null-{me}"),
                                                  0o666 | stat.S_IFCHR, os.makedev(1, 3)))
    attempt(log, "chmod-others-dir", lambda: os.chmod(os.path.join(shared, "roots-dir"), 0o777))
    attempt(log, "unlink-in-readonly", lambda: os.unlink(os.path.join(root, "ro", "kept")))
    log.append(["listing", sorted(os.listdir(shared))])
    return log


def _after_ctime_of(path: str, scratch: str) -> int:
    """Wait until the filesystem's clock has moved past *path*'s ctime (coarse clocks
    tick every few ms): touch *scratch* until its ctime is later. Returns *path*'s ctime."""
    before = os.stat(path, follow_symlinks=False).st_ctime_ns
    while os.stat(scratch).st_ctime_ns <= before:
        os.utime(scratch)
    return before


def s_ctime(root: str) -> Obs:
    """chown/lchown/fchown to (-1, -1) change nothing but still update ctime (pjdfstest
    chown/00.t); on a setuid file they also clear setuid."""
    log: Obs = []
    scratch = os.path.join(root, "scratch")
    open(scratch, "w").close()
    f, d, sym = (os.path.join(root, name) for name in ("f", "d", "sym"))
    open(f, "w").close()
    os.mkdir(d)
    os.symlink("f", sym)

    def changed(label: str, path: str, chown: Callable[[], None]) -> None:
        before = _after_ctime_of(path, scratch)
        attempt(log, label, chown)
        log.append([label + "-ctime", os.stat(path, follow_symlinks=False).st_ctime_ns > before])

    changed("chown-file", f, lambda: os.chown(f, -1, -1))
    changed("chown-dir", d, lambda: os.chown(d, -1, -1))
    changed("lchown-symlink", sym, lambda: os.lchown(sym, -1, -1))
    fd = os.open(f, os.O_RDWR)
    try:
        changed("fchown", f, lambda: os.fchown(fd, -1, -1))
    finally:
        os.close(fd)
    os.chmod(f, 0o6755)
    changed("chown-setuid", f, lambda: os.chown(f, -1, -1))
    log.append(["setuid-after", oct(stat.S_IMODE(os.stat(f).st_mode))])
    changed("chown-same-owner", f, lambda: os.chown(f, os.getuid(), os.getgid()))
    return log


def prepare_user_tree(root: str, gid: int) -> None:
    """As root: the files s_user expects (owned by root, various modes)."""
    shared = os.path.join(root, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    for name, mode in (("roots", 0o644), ("roots-rw", 0o666), ("roots-suid", 0o4777)):
        p = os.path.join(shared, name)
        open(p, "w").close()
        os.chmod(p, mode)
    secret = os.path.join(root, "secret")
    with open(secret, "w") as f:
        f.write("s")
    os.chmod(secret, 0o600)
    os.mkdir(os.path.join(root, "ro"), 0o555)
    open(os.path.join(root, "ro", "kept"), "w").close()
    os.chmod(os.path.join(root, "ro"), 0o555)
    os.mkdir(os.path.join(shared, "roots-dir"))
    link = os.path.join(shared, "others-link")  # not followed if fs.protected_symlinks
    os.symlink("roots-rw", link)
    os.lchown(link, gid + 1, gid + 1)
    os.mkdir(os.path.join(root, "noexec"))
    os.chmod(os.path.join(root, "noexec"), 0o600)
    sg = os.path.join(root, "setgid")
    os.mkdir(sg)
    os.chown(sg, 0, gid)
    os.chmod(sg, 0o2777)


SCENARIOS: dict[str, Callable[[str], Obs]] = {
    "files": s_files, "rename": s_rename, "links": s_links, "xattr": s_xattr,
    "special": s_special, "names": s_names, "user": s_user, "ctime": s_ctime,
}

if __name__ == "__main__":
    # Scenarios log bytes read back too: shown as their repr on both sides.
    print(json.dumps(SCENARIOS[sys.argv[2]](sys.argv[1]), default=repr))
