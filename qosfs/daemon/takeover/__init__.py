"""Takeover: another daemon process serves a mount that is already mounted, so that jobs
with files open under it notice nothing (issue 31). Two paths lead there, over the same
native layer (a FUSE session adopted without a new INIT) and the same tables.

The planned path, ``qosfs upgrade`` (or ``qosfs mount`` on a live mount): the serving
daemon *offers* the mount on a socket beside its control socket; a *successor* connects,
is sent the FUSE descriptor, the source's root, the listening sockets, the state
negotiated at INIT, the configuration and the policy, and builds its daemon while the old
one serves on. At commit the old daemon stops reading ``/dev/fuse`` and sends its tables;
the successor adopts the session and serves, and the old daemon exits. A successor that
fails before it serves is killed, and the old daemon takes its session back.

The crash path, ``qosfs mount`` run again after the daemon died: while a mount is served,
a *keeper* (a small holder process, or systemd's descriptor store) holds a copy of the
FUSE descriptor and of the source's root, and the *crash guard* writes the session
journal as the tables change. When the daemon dies the connection lives on in the keeper
and callers wait in the kernel; a new daemon claims the kept descriptors before it
touches the mountpoint, *recovers* the tables from the journal, adopts the session, and
has the kernel send again what the dead one had read and not answered
(FUSE_NOTIFY_RESEND). Which path a ``qosfs mount`` takes is decided once, in
:mod:`qosfs.daemon.start`.

- ``fuse_session``: the native layer over deploy/libfuse's adopt patches: the session's
  export and adoption, FUSE_NOTIFY_RESEND, messages with descriptors (SCM_RIGHTS).
- ``listeners``: the control socket and metrics listener, bound once per mount and handed
  from a daemon to its successor.
- ``offer``: the serving daemon's side of a planned handover: prepare, commit, take back.
- ``upgrade``: the successor's side, ``qosfs upgrade``, and the protocol.
- ``crash_guard``: the serving side of crash recovery: the journal and the keeper's copies.
- ``keeper``: what holds the FUSE connection while no daemon is alive (``python -m
  qosfs.daemon.takeover.keeper``, or systemd's store), and its protocol.
- ``recover``: a restarted daemon taking the kept connection over from the journal.

This file only describes the package: import names from the module that defines them.
"""
