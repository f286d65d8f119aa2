"""Allow ``python -m qosfs``."""

from __future__ import annotations

import sys

from qosfs.cli import main

sys.exit(main())
