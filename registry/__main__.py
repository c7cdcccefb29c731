"""``python -m registry``: the ``pcr`` command."""

from __future__ import annotations

import sys

from registry.cli import main

sys.exit(main())
