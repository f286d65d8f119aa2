"""Vocabulary every layer shares: errors with exit codes, units, Linux syscalls, and what
libfuse says about the caller of the request being served. Imports nothing above it."""
