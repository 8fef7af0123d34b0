"""Decisions over the weights on the server: which sync path a run takes, and whether the weights
there are the trainer's.
"""
