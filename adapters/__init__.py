"""Adapters: one thin, typed module per outside system (vLLM, models, kernels, datasets).

Adapters may import the core, never the shell.
"""
