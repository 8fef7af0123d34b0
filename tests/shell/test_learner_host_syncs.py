"""A step waits on the host a fixed number of times, not once per micro-batch or more: the
micro-batches' metrics stay on the device until one copy after the last backward, and timing
reads the device clock (CUDA events on a GPU) after it. Counted on CPU by wrapping every
tensor method that copies to the host or reads a value (``item``, ``tolist``, ``cpu``,
``numpy``, ``float()``, ``int()``, ``bool()``); on a GPU each would wait for the queued work."""

import pytest
import torch
from on_policy import on_policy
from packing_strategies import make_sample

from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.core.packing.tree import pack_row
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner

pytestmark = pytest.mark.usefixtures("process_group")
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


def rows(model, count):
    samples = [
        on_policy(model, make_sample([5, 6, 7, 8 + i, 9, 10], [0, 0, 0, 1, 1, 1]), 4)
        for i in range(count)
    ]
    return [pack_row([sample]) for sample in samples]


def host_reads_of_a_step(learner, micro_batches, monkeypatch) -> int:
    counted = [0]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, __original=original, **kwargs):
            counted[0] += 1
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    learner.train_step(micro_batches)
    monkeypatch.undo()
    return counted[0]


def test_more_micro_batches_add_no_host_reads(tiny_qwen3, monkeypatch) -> None:
    stock = load_causal_lm(tiny_qwen3)
    one_row, six_rows = rows(stock, 1), rows(stock, 6)
    config = AsyncGRPOConfig(learning_rate=1e-3, num_sampler_logprobs=4, seed=0)
    learner = Learner(load_causal_lm(tiny_qwen3), config)
    one = host_reads_of_a_step(learner, one_row, monkeypatch)
    six = host_reads_of_a_step(learner, six_rows, monkeypatch)
    print(f"host reads: a step of 1 micro-batch {one}, of 6 micro-batches {six}")
    assert six - one <= 5  # at most one per micro-batch added (measured 2026-12-07: none)
    # per step (measured: 10): the global token counts, the metrics, the gradient norm, the
    # agreed loss (2), the weights' finiteness, and the metric windows' object all-gather (4)
    assert one <= 10
