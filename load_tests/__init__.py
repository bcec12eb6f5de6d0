"""Load tests and benchmarks of streamkv (see ``docs/benchmarks.md``).

Every script runs as ``python -m load_tests.<name> --help``; shared helpers
(machine info, percentiles, tables, goals, a spawned server, model loading)
live in :mod:`load_tests.common`.
"""
