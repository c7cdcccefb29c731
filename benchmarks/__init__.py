"""Benchmarks of the registry against raw Redis commands (run by ``pcr bench``)."""
