"""``python -m distlocks.testing.servers``: see :mod:`distlocks.testing.servers.cli`."""

from __future__ import annotations

import sys

from distlocks.testing.servers.cli import main

if __name__ == "__main__":
    sys.exit(main())
