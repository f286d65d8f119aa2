"""Start DLIO (``dlio_benchmark.main``) where TensorFlow is not installed.

DLIO 2.0.0 imports ``tensorflow`` eagerly in exactly one place: its profiler factory
imports the TensorFlow profiler class, which is only instantiated for ``profiler:
tensorflow``. Everything on the PyTorch path (framework, data loader, readers, data
generators, checkpointing) imports TensorFlow lazily, only when configured. So when
TensorFlow is absent this entry point registers an empty module under that name before
importing DLIO, which saves the ~1.5 GB a TensorFlow install costs the ``training`` extra.
A configuration that really needs TensorFlow then fails with an AttributeError on ``tf``,
not silently. Run as ``mpiexec -n N python -m bench.suites.training.dlio_entry [hydra overrides]``.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def main() -> None:
    if importlib.util.find_spec("tensorflow") is None:
        sys.modules["tensorflow"] = types.ModuleType("tensorflow")
    from dlio_benchmark.main import main as dlio_main

    dlio_main()


if __name__ == "__main__":
    main()
