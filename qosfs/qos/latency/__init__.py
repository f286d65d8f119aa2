"""Latency targets: a protected class's read latency kept under its target by capping the
classes below it automatically. Part of ``qos``.

- ``decider``: the decisions, one window at a time, pure (no trio, no I/O).
- ``loop``: the daemon task that measures every window, asks the decider, applies its caps.
- ``probe``: the canary process that times requests through the mount.

This file only describes the package: import names from the module that defines them.
"""
