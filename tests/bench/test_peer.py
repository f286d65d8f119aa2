"""bench.suites.peer: what the section and the headline say when a column is missing, and the
parts of the runner that need no mount."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.core.epochs import make_samples
from bench.core.libfuse_peer import peer_mount
from bench.core.system import BenchError
from bench.suites.peer import PeerResult
from bench.suites.peer import headline as peer_headline
from bench.suites.peer import section as section_peer
from tests.bench.test_registry import sample


def stored() -> PeerResult:
    return PeerResult.from_json(sample("peer"))


def test_without_passthrough_hp_the_section_says_why_and_the_rest_is_measured() -> None:
    r = stored()
    hp = ("hp-single", "hp-multi", "hp-passthrough")
    r = dataclasses.replace(
        r, peer=None, peer_missing="no fuse3 source package reachable",
        peer_passthrough=None,
        tmpfs={c: f for c, f in r.tmpfs.items() if c not in hp},
        disk_figures={c: f for c, f in r.disk_figures.items() if c not in hp},
        errors={f"tmpfs {c}": "passthrough_hp not measured" for c in hp})
    text = "\n".join(section_peer({}, r))
    assert "- passthrough_hp was not measured: no fuse3 source package reachable." in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| 4 KiB random read, QD1"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:5] == ["—", "—", "—"]  # the three passthrough_hp columns
    assert cells[1] != "—" and cells[6].endswith("×)")  # native, qosfs default (ratio)
    rows = peer_headline(r)
    assert rows[0][1] != "—"  # qosfs / native does not need the peer
    assert [row[1] for row in rows[1:]] == ["—", "—"]
    assert [row[3] for row in rows[1:]] == ["—", "—"]


def test_a_qosfs_passthrough_entry_is_shown_as_the_daemon_gave_it() -> None:
    r = dataclasses.replace(stored(), qosfs_passthrough={"tmpfs policy": {"opens": 4001}})
    text = "\n".join(section_peer({}, r))
    assert '`ctl status` passthrough, tmpfs policy: `{"opens": 4001}`' in text
    assert "no `passthrough` entry" not in text
    assert "no `passthrough` entry" in "\n".join(
        section_peer({}, dataclasses.replace(r, qosfs_passthrough=None)))


def test_fixed_size_samples(tmp_path: Path) -> None:
    names = make_samples(tmp_path, 20, kib=112)
    assert len(names) == 20 and all(n.startswith("data/") for n in names)
    assert {(tmp_path / n).stat().st_size for n in names} == {112 * 1024}


def test_a_peer_that_does_not_mount_is_one_line_and_nothing_is_left(tmp_path: Path) -> None:
    log = tmp_path / "peer.log"
    with pytest.raises(BenchError, match="passthrough_hp did not mount"), \
            peer_mount("/bin/false", tmp_path, tmp_path / "mnt", (), log):
        pass
    assert not (tmp_path / "mnt").is_mount()
