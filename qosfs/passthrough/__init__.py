"""Pass-through: the FUSE filesystem that serves a backing directory tree. Imports ``qos``
(what the filesystem sees of an engine) and ``core``; a sibling of ``control`` and
``plan``, which it does not import.

- ``operations``: the pyfuse3 ``Operations``, a faithful pass-through that answers FUSE.
- ``filesystem``: the filesystem as a whole (``Filesystem``): the operations and their
  parts, its status, its journal, its close.
- ``inodes``, ``fdcache``: the inode table, held by ``O_PATH`` descriptors, a bounded set.
- ``cold_inodes``: the inodes nothing uses now, folded into compact arrays.
- ``inode_journal``: the inode table written down in the session journal as it changes.
- ``inode_takeover``: the inode table handed to a successor, or rebuilt after a crash.
- ``handles``: open files and directories, what a FUSE file handle stands for.
- ``handle_table``: the open files and directories by fh, and the one record of an open.
- ``namespace``: name changes (create, mkdir, rename...), each done exactly once.
- ``entries``: what the kernel is told of an inode, and the inodes it learns of.
- ``forgets``: the kernel's FORGETs, thousands at once applied a batch at a time.
- ``meta_calls``: metadata syscalls, never EMFILE for the daemon's own descriptors.
- ``attributes``: what a SETATTR changes on the backing object.
- ``odirect``: O_DIRECT opens, and the buffered twin for what O_DIRECT refuses.
- ``page_cache``: what the kernel is told of its page cache at open.
- ``ownership``: ownership as a native filesystem gives it, although the daemon is root.
- ``paths``: where an inode is in the tree, for classification by path.
- ``backing_io``: the data-path syscalls, without stalling the one event loop.
- ``interrupts``: who sent a parked request, and FUSE INTERRUPT for it.
- ``kernel``: pyfuse3's kernel passthrough API, one backing id per inode.
- ``kernel_opens``: which opens of the mount the kernel serves itself, counted by class.
- ``read_programs``: the BPF programs that count what the kernel reads from backing files.
- ``read_probes``: those programs loaded, and their maps as the daemon reads and writes them.
- ``read_counting``: those reads, added to the classes' read counters per open's flow.
- ``transfer``: the tables a successor process takes over in a planned handover.
- ``journal``: the session journal a successor rebuilds the tables from after a crash.
- ``recovery``: the tables rebuilt from a dead daemon's journal.
- ``intents``: non-idempotent requests recorded by id, so that a resent one is not redone.

This file only describes the layer: import names from the module that defines them.
"""
