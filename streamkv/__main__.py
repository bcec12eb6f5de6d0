"""``python -m streamkv`` = the ``streamkv`` console script (streamkv.server.cli:main)."""

from __future__ import annotations

import sys

from streamkv.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
