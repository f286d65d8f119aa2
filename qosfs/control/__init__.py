"""Control and observability: the control socket and its line protocol, the service
that answers it (status, stats, set, reload), the ``ctl`` and ``top`` clients, snapshots
of the engine, and Prometheus metrics."""
