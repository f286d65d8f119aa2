"""Daemon: the process, from the command line to a clean unmount. The top layer: it may
import every other. Its modules, in the order a mount meets them:

- ``cli``: the command line (``completion`` marks its path arguments for shell completion).
- ``config``: what ``qosfs mount`` was asked to do (``MountConfig``).
- ``start``: ``qosfs mount`` decided once: fresh, recovered after a crash, or handed over
  by a live daemon; and the fresh path.
- ``daemonize``: the fork, and the parent waiting until the child serves.
- ``preflight``: the checks before anything is mounted, and a stale mount removed.
- ``fs_assembly``: a mount's filesystem assembled from its parts (``build_filesystem``).
- ``topology``: the source and mountpoint layouts that cannot work, refused.
- ``assembly``: the ``Daemon`` built from the configuration, and its services wired.
- ``serve``: the trio loop, signals, the drain, a handover's commit or take-back, unmount.
- ``supervise``: the services on the event loop, restarted when they fail.
- ``logsetup``: logging to stderr, journald/syslog or a file.
- ``notify``: telling systemd the daemon's state, and keeping descriptors in its store
  across a crash (``FDSTORE=1``, ``$LISTEN_FDS``), without libsystemd.
- ``tuning``: the FUSE connection's kernel-side knobs, set through sysfs.
- ``privileges``: root's resource privileges, kept from the users it serves.
- ``pointer``: where a mount's sockets are, said at the derived socket path.
- ``unmount``: ``qosfs umount``, returning once nothing of the mount holds its source.
- ``takeover``: another process serving the live mount: a planned handover
  (``qosfs upgrade``) or a restart after a crash (its package docstring lists its modules).

This file only describes the layer: import names from the module that defines them.
"""
