"""Control: observing and steering a running mount. Imports ``qos``, ``policy`` and
``core``; a sibling of ``passthrough`` and ``plan``, which it does not import.

- ``server``: the control socket, served on the daemon's trio loop.
- ``accepting``: the accept loop of the control socket and of the metrics listener, one a
  planned handover can stop and wait out.
- ``protocol``: its JSON-lines protocol, parsed and validated.
- ``address``: where a mount's control socket is (and the files beside it).
- ``service``: what the daemon does for each request: status, stats, set, reload.
- ``snapshot``: a frozen picture of a running engine, its rates and its JSON form.
- ``metrics``, ``exporter``: Prometheus metrics, and ``/metrics`` served over HTTP.
- ``ctl``, ``top``, ``explain``: the clients behind ``qosfs ctl``, ``qosfs top`` and
  ``qosfs explain`` (``columns`` fits ``top``'s table to the terminal; ``kernel_status``
  is ``ctl status``'s kernel passthrough part).

This file only describes the layer: import names from the module that defines them.
"""
