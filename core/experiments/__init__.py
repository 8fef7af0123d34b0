"""Experiments read off runs: learning curves, statistics over seeds, claims, the comparison table,
a sweep's plan, and the simulator's calibration and scoring.
"""
