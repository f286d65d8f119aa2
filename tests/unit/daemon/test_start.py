"""Which path a ``qosfs mount`` takes (qosfs.daemon.start): the decision from what is
found at the mountpoint, and the path run for each, without a mount (the paths
themselves are replaced; tests/mount/test_lifecycle.py, test_crash_recovery.py and
test_upgrade.py run them on real mounts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from qosfs.core.errors import EXIT_MOUNTPOINT
from qosfs.daemon import start
from qosfs.daemon.config import MountConfig
from qosfs.daemon.start import Start, decide
from qosfs.daemon.takeover.recover import Unrecoverable


def _never_asked() -> bool:
    raise AssertionError("the mountpoint was touched although a keeper holds its connection")


def test_nothing_found_mounts_afresh() -> None:
    assert decide(False, lambda: False) is Start.FRESH


def test_a_live_daemon_hands_the_mount_over() -> None:
    assert decide(False, lambda: True) is Start.ADOPT


def test_a_kept_connection_is_recovered_without_touching_the_mountpoint() -> None:
    assert decide(True, _never_asked) is Start.RECOVER


class _Paths:
    """The three paths replaced by recorders, and what the probes find."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, kept: tuple[int, int] | None,
                 live: bool, recoverable: bool = True) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

        def recorder(name: str, fails: bool = False) -> Callable[..., int]:
            def call(*args: Any, **kwargs: Any) -> int:
                self.calls.append((name, args, kwargs))
                if fails:
                    raise Unrecoverable("journal unreadable", EXIT_MOUNTPOINT)
                return 0
            return call

        monkeypatch.setattr(start, "kept_descriptors", lambda cfg: kept)
        monkeypatch.setattr(start, "serves_qosfs",
                            lambda mountpoint: live if kept is None else _never_asked())
        monkeypatch.setattr(start, "run_mount", recorder("fresh"))
        monkeypatch.setattr(start, "recover_mount", recorder("recover", not recoverable))
        monkeypatch.setattr(start, "adopt_mount", recorder("adopt"))

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]


CFG = MountConfig(source="/src", mountpoint="/mnt", socket_path="/run/qosfs/mnt.sock")


def test_start_mount_runs_the_fresh_path(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _Paths(monkeypatch, kept=None, live=False)
    assert start.start_mount(CFG, foreground=True) == 0
    assert paths.calls == [("fresh", (CFG,), {})]


def test_start_mount_recovers_on_the_kept_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _Paths(monkeypatch, kept=(7, 8), live=True)
    assert start.start_mount(CFG, foreground=True) == 0
    assert paths.calls == [("recover", (CFG, (7, 8), "/run/qosfs/mnt.sock", None), {})]


def test_an_unrecoverable_journal_mounts_afresh(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    paths = _Paths(monkeypatch, kept=(7, 8), live=False, recoverable=False)
    assert start.start_mount(CFG, foreground=True) == 0
    assert paths.names == ["recover", "fresh"]
    (record,) = [r for r in caplog.records if "journal unreadable" in r.getMessage()]
    record.expected = True  # type: ignore[attr-defined]


def test_start_mount_adopts_with_the_mount_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _Paths(monkeypatch, kept=None, live=True)
    assert start.start_mount(CFG, foreground=True) == 0
    assert paths.calls == [("adopt", ("/mnt", "/run/qosfs/mnt.sock", True),
                            {"requested": CFG})]
