"""Daemon: the process, from the command line to a clean unmount. The top layer: it may
import every other.

- ``cli``: the command line (``completion`` marks its path arguments for shell completion).
- ``mount``: the mount's lifecycle: checks, daemonizing, the trio loop, signals, unmount.
- ``filesystem``: the FUSE operations assembled from their parts (``build_filesystem``).
- ``topology``: the source and mountpoint layouts that cannot work, refused.
- ``supervise``: the services on the event loop, restarted when they fail.
- ``logsetup``: logging to stderr, journald/syslog or a file.
- ``notify``: telling systemd the daemon's state, and keeping descriptors in its store
  across a crash (``FDSTORE=1``, ``$LISTEN_FDS``), without libsystemd.
- ``tuning``: the FUSE connection's kernel-side knobs, set through sysfs.
- ``privileges``: root's resource privileges, kept from the users it serves.
- ``handover``: a successor process serving the live mount (the FUSE descriptor, the
  state negotiated at INIT, FUSE_NOTIFY_RESEND), over deploy/libfuse's adopt patches.

This file only describes the layer: import names from the module that defines them.
"""
