"""Test-suite settings shared by every test."""

from hypothesis import settings

# The machines that run this suite are small and shared: a per-example deadline measures
# the neighbours, not the code. Speed is measured by the benchmarks instead.
settings.register_profile("asyncgrpo", deadline=None)
settings.load_profile("asyncgrpo")
