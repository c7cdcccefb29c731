"""The ``pcr`` command line, thin: it parses arguments and calls the library, the services
(``pcr.serve``, ``pcr.gateway``), the simulation and the benchmarks (``pcr.bench``).
The entry point is ``pcr.cli.main:main``."""
