"""Policy: what the administrator wrote, validated. Imports only ``core``; knows nothing
of token buckets or FUSE.

- ``model``: the policy as frozen dataclasses and :class:`PolicyError`.
- ``keys``: its key vocabulary, plain tuples (``qosfs ctl`` reads them without the model).
- ``loading``: the entry points: parse, load and read a policy file, the default policy,
  live changes (``with_changes``), notes on what a policy does.
- ``build``: from ``tomllib``'s dicts to a validated model, with file, line and reason.
- ``text``: policy TOML as text: rendering, quoting, a key's line, the default policy.
- ``lint``: what ``qosfs check`` warns about in a valid policy.
- ``globs``: path globs, compiled for matching and compared for proofs.
- ``classify``: which class and tenant a caller's request belongs to.

This file only describes the layer: import names from the module that defines them.
"""
