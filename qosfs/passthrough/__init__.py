"""The FUSE pass-through: the pyfuse3 operations, inodes held by file handle, open
files, paths for classification, and the backing I/O (descriptors opened before the
mount, reads and writes on the loop or on worker threads)."""
