"""The policy: its model (frozen dataclasses), the TOML text it is parsed from and
written back to, validation with file, line and reason, and classification of a caller
into a class and a tenant. Knows nothing of token buckets or FUSE."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qosfs.core.faces import lazy_face

if TYPE_CHECKING:
    from qosfs.policy.build import build_policy
    from qosfs.policy.classify import (
        CallerKey,
        Classifier,
        GlobError,
        JobCache,
        JobInfo,
        compile_path_globs,
        read_job_info,
    )
    from qosfs.policy.loading import (
        DEFAULT_POLICY_TEXT,
        default_policy,
        load_policy,
        parse_policy,
        policy_notes,
        read_policy_text,
        with_changes,
    )
    from qosfs.policy.model import (
        CLASS_KEYS,
        LIMIT_KEYS,
        PRIORITY_WEIGHTS,
        SETTABLE,
        TENANT_KEYS,
        Backend,
        ClassRule,
        Control,
        Exported,
        IdRange,
        Limits,
        Policy,
        PolicyError,
        Tenant,
        policy_to_raw,
    )

_EXPORTS = {
    "loading": (
        "DEFAULT_POLICY_TEXT", "default_policy", "load_policy", "parse_policy", "policy_notes",
        "read_policy_text", "with_changes"
    ),
    "model": (
        "CLASS_KEYS", "LIMIT_KEYS", "PRIORITY_WEIGHTS", "SETTABLE", "TENANT_KEYS", "Backend",
        "ClassRule", "Control", "Exported", "IdRange", "Limits", "Policy", "PolicyError",
        "Tenant", "policy_to_raw"
    ),
    "build": ("build_policy",),
    "classify": (
        "CallerKey", "Classifier", "GlobError", "JobCache", "JobInfo", "compile_path_globs",
        "read_job_info"
    ),
}
__all__ = [
    "CLASS_KEYS",
    "DEFAULT_POLICY_TEXT",
    "LIMIT_KEYS",
    "PRIORITY_WEIGHTS",
    "SETTABLE",
    "TENANT_KEYS",
    "Backend",
    "CallerKey",
    "ClassRule",
    "Classifier",
    "Control",
    "Exported",
    "GlobError",
    "IdRange",
    "JobCache",
    "JobInfo",
    "Limits",
    "Policy",
    "PolicyError",
    "Tenant",
    "build_policy",
    "compile_path_globs",
    "default_policy",
    "load_policy",
    "parse_policy",
    "policy_notes",
    "policy_to_raw",
    "read_job_info",
    "read_policy_text",
    "with_changes",
]

if not TYPE_CHECKING:  # type checkers read the imports above
    __getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
