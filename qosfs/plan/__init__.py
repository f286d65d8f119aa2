"""Plan: ``qosfs plan``, from a cluster's size and the storage's capacity to per-node caps
and a policy text. Imports only ``policy`` and ``core``.

- ``planner``: the arithmetic of a plan, from model size and checkpoint interval.
- ``report``: the report ``qosfs plan`` prints and the policy it writes.
- ``command``: the ``qosfs plan`` subcommand: its options, and running it.

This file only describes the layer: import names from the module that defines them.
"""
