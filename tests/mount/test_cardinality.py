"""Per-uid series stay bounded: idle uids leave /metrics, a class labels at most N uids,
and the class totals never go backwards (the policy's ``[metrics]`` table)."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qosfs.control.ctl import Client
from tests.mounting import QosfsMount
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root]

KiB = 1 << 10

# One process writes a 4 KiB file as each of many uids: setfsuid(2) changes the uid FUSE
# sees for the next request, without a process per uid.
WRITER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
top, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for uid in range(first, first + count):
    libc.setfsuid(uid)
    with open(os.path.join(top, f"f{uid}"), "wb") as f:
        f.write(b"u" * 4096)
libc.setfsuid(0)
"""


class Mount:
    def __init__(self, tmp: Path, metrics_table: str) -> None:
        self.src, self.mnt, self.sock = tmp / "src", tmp / "mnt", tmp / "ctl.sock"
        (self.src / "users").mkdir(parents=True, mode=0o777)
        self.src.joinpath("users").chmod(0o777)
        self.mnt.mkdir()
        policy = tmp / "policy.toml"
        policy.write_text(f'{metrics_table}\n[classes.scratch]\npaths = ["users/**"]\n'
                          'per_user = "fair"\n')
        self.mount = QosfsMount(self.src, self.mnt, "--policy", str(policy),
                                "--socket", str(self.sock), "--metrics", "127.0.0.1:0")

    def write_as(self, first: int, count: int) -> None:
        subprocess.run([sys.executable, "-c", WRITER, str(self.mnt / "users"), str(first),
                        str(count)], check=True, timeout=300)

    def status(self) -> dict[str, Any]:
        with Client(str(self.sock)) as client:
            return client.request({"cmd": "status"})

    def metrics(self) -> str:
        found = re.search(r"serving metrics on (http://\S+)", self.mount.log())
        assert found, self.mount.log()
        with urllib.request.urlopen(found[1], timeout=30) as response:
            return response.read().decode()


@pytest.fixture
def mounted(tmp_tree: Path, request: pytest.FixtureRequest) -> Iterator[Mount]:
    m = Mount(tmp_tree, request.param)
    with m.mount:
        yield m


def uid_series(text: str) -> int:
    return len(re.findall(r'^qosfs_\w+\{[^}]*uid="\d+"', text, re.MULTILINE))


def class_written(text: str) -> float:
    return sum(float(v) for v in re.findall(
        r'^qosfs_write_bytes_total\{class="scratch"[^}]*\} (\S+)$', text, re.MULTILINE))


@pytest.mark.parametrize("mounted", ['[metrics]\nuser_series = 2000\nuser_series_idle = "3s"'],
                         indirect=True)
def test_idle_uids_leave_the_series_and_their_totals_stay(mounted: Mount) -> None:
    before = uid_series(mounted.metrics())
    mounted.write_as(10_000, 1000)
    busy = mounted.metrics()
    # Writing 1,000 uids can take longer than user_series_idle on a loaded machine, so
    # the first may have left already: count per uid present, and every uid either has
    # its account still or was expired (one snapshot), never lost.
    present = len(set(re.findall(r'uid="(\d+)"', busy)))
    assert present > 0, busy
    per_uid = (uid_series(busy) - before) / present
    status = mounted.status()
    assert status["user_accounts"] + status["users_expired"] == 1000, status
    assert class_written(busy) == 1000 * 4 * KiB
    print(f"\nseries per uid of a per_user class: {per_uid:.0f}; "
          f"/metrics with 1,000 uids: {len(busy.splitlines())} lines")
    assert per_uid > 50  # the cost this bounds

    wait_for("idle uids to leave", lambda: mounted.status()["user_accounts"], timeout=30,
             interval=0.2, until=lambda accounts: accounts == 0)
    idle = mounted.metrics()
    assert uid_series(idle) == before
    assert mounted.status()["users_expired"] == 1000
    assert class_written(idle) == 1000 * 4 * KiB  # folded into uid="", not lost
    print(f"after the expiry: {len(idle.splitlines())} lines")

    mounted.write_as(10_000, 1)  # a returning uid gets a series again, from zero
    back = mounted.metrics()
    assert re.search(r'^qosfs_write_bytes_total\{class="scratch",mount="[^"]*",tenant="",'
                     r'uid="10000"\} 4096\.0$', back, re.MULTILINE), back
    assert class_written(back) == 1001 * 4 * KiB


@pytest.mark.parametrize("mounted", ["[metrics]\nuser_series = 10"], indirect=True)
def test_a_class_labels_at_most_user_series_uids(mounted: Mount) -> None:
    mounted.write_as(20_000, 50)
    text = mounted.metrics()
    labelled = set(re.findall(r'^qosfs_write_bytes_total\{class="scratch",mount="[^"]*",'
                              r'tenant="",uid="(\d+)"\}', text, re.MULTILINE))
    assert len(labelled) == 10 and mounted.status()["user_accounts"] == 10
    assert class_written(text) == 50 * 4 * KiB  # the other 40 are in uid=""


@pytest.mark.parametrize("mounted", ["[metrics]\nuser_series = 0"], indirect=True)
def test_per_uid_series_can_be_turned_off(mounted: Mount) -> None:
    mounted.write_as(30_000, 5)
    text = mounted.metrics()
    assert uid_series(text) == 0
    assert class_written(text) == 5 * 4 * KiB
