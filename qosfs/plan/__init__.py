"""``qosfs plan``: from a cluster's size and the storage's capacity to per-node caps and a
policy text."""
