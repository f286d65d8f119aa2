"""Capability and fsuid handling (qosfs.daemon.privileges), in child processes so that the test
process keeps its own privileges."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.mounting import ROOT

pytestmark = pytest.mark.root

CAP_SYS_NICE = 23  # dropped in a child instead of CAP_SYS_RESOURCE, which root may lack


def _in_child(code: str) -> dict[str, int]:
    """Run *code* (with qosfs.daemon.privileges imported as ``p``), then report the capability
    sets and the fsuid of the child's main thread."""
    script = f"""
import json
from qosfs.daemon import privileges as p
{code}
with open("/proc/self/status") as f:
    fields = dict(line.rstrip("\\n").split(":\\t", 1) for line in f)
out = {{k: int(v, 16) for k, v in fields.items() if k.startswith("Cap")}}
out["fsuid"] = int(fields["Uid"].split()[3])
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


def test_drop_capability_removes_it_from_every_set() -> None:
    before = _in_child("")
    bit = 1 << CAP_SYS_NICE
    if not before["CapEff"] & bit:
        pytest.skip("root has no CAP_SYS_NICE here")
    after = _in_child(f"p.drop_capability({CAP_SYS_NICE})")
    for field in ("CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"):
        assert not after[field] & bit, field
        assert after[field] == before[field] & ~bit, field  # nothing else went


def test_fsuid_switch_is_detected_and_restored() -> None:
    after = _in_child("assert p.can_switch_fsuid()")
    assert after["fsuid"] == 0
    assert after["CapEff"] == _in_child("")["CapEff"]  # the fs capabilities came back


def test_without_cap_setuid_the_fsuid_switch_is_known_to_fail() -> None:
    after = _in_child("p.drop_capability(7)\nassert not p.can_switch_fsuid()")  # CAP_SETUID
    assert after["fsuid"] == 0
