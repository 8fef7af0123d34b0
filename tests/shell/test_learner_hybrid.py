"""The learner on a vision-language hybrid checkpoint (tiny Qwen3.5 VL): one real step trains
the text model only; weight sync sends the text weights alone under the checkpoint's names;
the saved model loads back with AutoModelForImageTextToText."""

import pytest
import torch
from on_policy import on_policy
from packing_strategies import make_sample
from transformers import AutoModelForImageTextToText

from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.core.packing.tree import pack_row
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner

TOWER = "model.visual."


pytestmark = pytest.mark.usefixtures("process_group")


def test_a_step_trains_the_text_model_and_syncs_only_it(tiny_vl, tmp_path) -> None:
    model = load_causal_lm(tiny_vl)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = on_policy(
        model, make_sample([5, 6, 7, 8, 9, 10], [0, 0, 0, 1, 1, 1], advantage=1.0), 4
    )
    learner = Learner(model, AsyncGRPOConfig(learning_rate=1e-2, num_sampler_logprobs=4, seed=0))
    learner.train_step([pack_row([sample])])

    full = learner.export.full_state_dict()
    synced = learner.export.synced_state_dict()
    assert set(synced) == {k for k in full if not k.startswith(TOWER)}
    assert any(k.startswith(TOWER) for k in full)
    assert [name for name, _, _ in learner.export.weight_metadata()] == list(synced)
    assert [name for name, _ in learner.export.iter_weights()] == list(synced)
    assert all(torch.equal(full[k], before[k]) for k in full if k.startswith(TOWER))
    assert not torch.equal(full["lm_head.weight"], before["lm_head.weight"])

    learner.export.save_pretrained(tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in full.items())
