"""Decisions over the vLLM servers of a run: routing a group, outages, whether servers can stand in
for each other, which CPU cores each gets.
"""
