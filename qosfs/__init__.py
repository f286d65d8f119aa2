"""qosfs: a FUSE pass-through filesystem that gives shared storage I/O quality of service."""

from __future__ import annotations

__version__ = "0.1.0"
