"""``python -m pcr``: the same as the ``pcr`` command."""

from __future__ import annotations

import sys

from pcr.cli.main import main

sys.exit(main())
