"""Where an open file's charge goes after its open: streaming writers and renamed files.

A file is classified once, at open (FUSE gives reads and writes no caller). Two things
seen later say the class was wrong, and move the charge (:mod:`qosfs.qos.charge` watches
for them and asks the engine):

* **A streaming writer**: an open of a class that caps nothing writes mostly
  sequentially past the class's threshold: it continues in the policy's streaming class
  (same tenant and uid).
* **A rename**: bytes written under a name that said nothing (a temporary name, an
  uncapped class) are charged, at the rename, to the class of the final name when that
  one caps writes: it goes into debt, which its next writes pay.

The engine (:class:`qosfs.qos.engine.PolicyQos`) counts the moves by class for ``ctl
status``; what moves, and how the levels are charged, is decided here.
"""

from __future__ import annotations

from collections.abc import Mapping

from qosfs.policy.model import ClassRule
from qosfs.qos.backend import ClassPort
from qosfs.qos.flow import ClassState, PolicyFlow
from qosfs.qos.levels import Kind
from qosfs.qos.memo import FlowOf

__all__ = ["move_written", "streaming_flow"]


def streaming_flow(flow: PolicyFlow, target: ClassRule | None,
                   classes: Mapping[str, ClassState], flow_of: FlowOf) -> PolicyFlow | None:
    """The flow an open of *flow* continues in once it is seen streaming: same tenant and
    uid, the streaming class *target*; None when the policy has none."""
    if target is None or target.name not in classes:
        return None
    return flow_of(target.name, flow.tenant_name, flow.uid)


def move_written(to: PolicyFlow, charged: PolicyFlow, nbytes: int) -> bool:
    """Move *nbytes* already written through *charged* (an uncapped class) to *to*, the
    flow of the file's new name, if that one caps writes. Returns whether they moved.

    Class, user and tenant levels move the bytes; the backend saw them already, so only
    its share of them moves (the new class's dispatch tags advance).
    """
    if to.cls is charged.cls or not to.throttled_writes:
        return False
    for level in to.chain():
        level.charge_bytes(Kind.WRITE, nbytes)  # a backend port moves its share only
    for level in charged.chain():
        if not isinstance(level, ClassPort):
            level.refund(Kind.WRITE, nbytes, 0)
    return True
