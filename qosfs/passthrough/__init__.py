"""Pass-through: the FUSE filesystem that serves a backing directory tree. Imports ``qos``
(what the filesystem sees of an engine) and ``core``; a sibling of ``control`` and
``plan``, which it does not import.

- ``operations``: the pyfuse3 ``Operations``, a faithful pass-through.
- ``inodes``, ``fdcache``: the inode table, held by ``O_PATH`` descriptors, a bounded set.
- ``handles``: open files and directories, what a FUSE file handle stands for.
- ``paths``: where an inode is in the tree, for classification by path.
- ``backing_io``: the data-path syscalls, without stalling the one event loop.
- ``interrupts``: who sent a parked request, and FUSE INTERRUPT for it.
- ``kernel``: pyfuse3's kernel passthrough API, one backing id per inode.
- ``kernel_opens``: which opens of the mount the kernel serves itself, counted by class.

This file only describes the layer: import names from the module that defines them.
"""
