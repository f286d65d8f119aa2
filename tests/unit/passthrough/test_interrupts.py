"""The FUSE request introspection must fit the pyfuse3 and libfuse this venv runs: when it
does not, parked requests of killed callers are no longer answered at once (the flood
tests then time out), and only a warning says so."""

from __future__ import annotations

import os

from qosfs.passthrough import interrupts


def test_the_hook_fits_this_pyfuse3_and_reads_its_own_libfuse() -> None:
    assert interrupts.install(), "pyfuse3's request layout is not one the hook knows"
    # The library whose requests pyfuse3 hands out, not whichever libfuse3 is on the path
    # (the project's build is libfuse3.so.4 by rpath, the system's libfuse3.so.3).
    loaded = interrupts._loaded_libfuse()
    assert os.path.basename(loaded).startswith("libfuse3.so")
    with open("/proc/self/maps") as maps:
        assert loaded in maps.read()
