"""The packed forward: tree attention and its backends, gated DeltaNet on a tree, which
architectures it computes exactly, and the packed policy module.
"""
