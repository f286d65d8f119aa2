"""The QoS engine: token buckets, rate levels and the one way to wait at them, the
engine that binds a classified open file to its chain of levels, sharing of a declared
backend, traffic accounting and the latency controller. Knows nothing of FUSE: the
filesystem reaches it through :mod:`qosfs.qos.interface`."""
