"""Which flow a request is charged to: its classification, memoized on the inode.

Classifying (the path, then the rules) is paid on every lookup/getattr/create under a
``meta_iops`` cap and at every open. Requests come in runs on the same object (every
lookup in a directory is charged at that directory), so one memo per inode, of its last
classification, answers most of them. It is valid for the same
:class:`~qosfs.policy.classify.CallerKey` (op, uid, gid, and pid when the policy reads
jobs), under the same policy generation and path epoch (see
:mod:`qosfs.passthrough.paths`), and for as long as the path it was made from is trusted.

A :class:`Classification` is made per policy generation by the engine
(:meth:`qosfs.qos.engine.PolicyQos.swap`), so what it reads per request (does the policy
read jobs, which generation) is fixed when it is made.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from qosfs.policy.classify import CallerKey, Classifier, JobCache
from qosfs.policy.model import Policy
from qosfs.qos.charge import InodeCharge
from qosfs.qos.flow import PolicyFlow
from qosfs.qos.interface import Classified, PathSource

if TYPE_CHECKING:
    import pyfuse3

__all__ = ["Classification", "FlowOf"]

#: The engine's flow of (class, tenant or None, uid), made if need be.
FlowOf = Callable[[str, "str | None", int], PolicyFlow]

_monotonic = time.monotonic
_CALLER_FIELDS = len(CallerKey._fields)


class Classification:
    """The classification of one policy generation, memoized per inode.

    Args:
        policy: The policy in force.
        classifier: Its :class:`~qosfs.policy.classify.Classifier`.
        generation: The engine's generation *policy* is in force as.
        jobs: The engine's cache of callers' jobs (kept across generations).
        flow_of: Where a classified request's flow comes from.
    """

    __slots__ = ("_flow_of", "_job_envs", "_jobs", "_needs_job", "classifier", "generation")

    def __init__(self, policy: Policy, classifier: Classifier, generation: int,
                 jobs: JobCache, flow_of: FlowOf) -> None:
        self.classifier = classifier
        self.generation = generation
        self._needs_job = policy.needs_job_lookup  # read per request: computed once here
        self._job_envs = policy.job_envs
        self._jobs = jobs
        self._flow_of = flow_of

    def __repr__(self) -> str:
        return f"<Classification generation={self.generation} {self.classifier!r}>"

    def caller_key(self, ctx: pyfuse3.RequestContext, op: str) -> CallerKey:
        """What classification reads of this request besides the path (the memo's key)."""
        return CallerKey(op, ctx.uid, ctx.gid, ctx.pid if self._needs_job else 0)

    def classified(self, path: str, caller: CallerKey) -> PolicyFlow:
        """The flow of *caller* acting on *path*, classified now (no memo)."""
        job = self._jobs.get(caller.pid, self._job_envs) if self._needs_job else None
        rule, tenant = self.classifier.resolve(path, caller, job)
        return self._flow_of(rule.name, tenant.name if tenant is not None else None,
                             caller.uid)

    def flow(self, paths: PathSource, node: Classified, ctx: pyfuse3.RequestContext,
             op: str) -> PolicyFlow:
        """The flow for *op* on *node* by this caller, from the inode's memo when valid."""
        # The key is the CallerKey's fields, then the policy generation and path epoch.
        # A flat tuple, and the CallerKey built from it only on a miss: building one per
        # request cost 150 ns (bench/machinery.py); _make() refuses a key that lacks a
        # field CallerKey gained, so the two cannot drift apart.
        key = (op, ctx.uid, ctx.gid, ctx.pid if self._needs_job else 0, self.generation,
               paths.epoch)
        memo: InodeCharge | None = node.qos_memo  # the inode's slot (qosfs.qos.charge)
        if memo is None:  # inlined inode_charge(): this runs on every metadata request
            memo = node.qos_memo = InodeCharge()
        if memo.memo_key == key and _monotonic() < memo.memo_until:
            memoized: PolicyFlow = memo.memo_flow
            return memoized
        path, deadline = paths.relpath_until(node)
        flow = self.classified(path, CallerKey._make(key[:_CALLER_FIELDS]))
        memo.memo_key, memo.memo_until, memo.memo_flow = key, deadline, flow
        return flow
