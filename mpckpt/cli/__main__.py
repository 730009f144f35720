"""``python -m mpckpt.cli``: the same as the ``mpckpt`` command."""

from __future__ import annotations

import sys

from mpckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
