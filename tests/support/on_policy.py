"""Relabel samples as if the model itself had sampled them (staleness 0)."""

import attrs
import numpy as np
import torch

from asyncgrpo.core.records import TrainingSample, TrainingSequence


def on_policy(model, sample: TrainingSample, k: int) -> TrainingSample:
    """``sample`` with the model's own log-probs and top-``k`` tables as the sampler's."""
    seq = sample.sequence
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(seq.input_ids)[None], use_cache=False).logits
    logp_all = torch.log_softmax(logits[0].double(), -1)
    trained = np.flatnonzero(seq.trained_mask)
    logprobs = np.zeros(len(seq))
    logprobs[trained] = logp_all[trained - 1, seq.input_ids[trained]].numpy()
    tables = [None] * len(seq)
    for t in trained:
        top = logp_all[t - 1].topk(k)
        tables[t] = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    new = TrainingSequence(seq.input_ids, seq.trained_mask, logprobs, None, tuple(tables))
    return attrs.evolve(sample, sequence=new)
