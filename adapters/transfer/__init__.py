"""Weights from the trainer to the vLLM server: files on disk (full weights, LoRA adapters),
weight-transfer engines (gloo on CPU, NCCL on GPU) and the vLLM plugin that serves them.
"""
