"""``pcr bench``: every registry operation measured against the raw Redis commands."""
