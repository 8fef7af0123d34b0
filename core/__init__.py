"""The pure core: decisions as functions over immutable records.

No I/O, no clocks, no processes, no globals. Imports only the standard library, attrs, numpy
and torch tensor math; ``tests/test_dependency_rule.py`` enforces it.
"""
