"""Allow ``python -m qosfs``."""

from __future__ import annotations

import sys

from qosfs.daemon.cli import main

sys.exit(main())
