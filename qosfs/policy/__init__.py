"""The policy: its model (frozen dataclasses), the TOML text it is parsed from and
written back to, validation with file, line and reason, and classification of a caller
into a class and a tenant. Knows nothing of token buckets or FUSE."""
