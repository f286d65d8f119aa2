"""Where a mount's control socket is: its name from the mountpoint."""

from __future__ import annotations

import os

from qosfs.control.address import default_socket_path


def test_default_socket_path_is_readable_unambiguous_and_short(tmp_path) -> None:
    a, b = tmp_path / "a-b", tmp_path / "a" / "b"
    a.mkdir()
    b.mkdir(parents=True)
    pa, pb = default_socket_path(str(a)), default_socket_path(str(b))
    assert pa != pb
    assert os.path.basename(pa).startswith(str(a).strip("/").replace("/", "-")[:20])
    assert pa.endswith(".sock")
    assert default_socket_path(str(a)) == default_socket_path(str(a) + "/")
    deep = "/" + "/".join(["verylongdirectoryname"] * 20)
    assert len(default_socket_path(deep)) < 108
    if os.geteuid() == 0:
        assert pa.startswith("/run/qosfs/")
    assert os.path.basename(default_socket_path("/")).startswith("root-")
