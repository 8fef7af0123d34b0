"""The imperative shell: processes, loops, logging and the command line.

The shell asks the core for every decision and the adapters for every effect.
"""
