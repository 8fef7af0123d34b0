"""The learner on the per-sample path (FSDP2 over a 1-process gloo group, fp32 CPU): a decoder
with a recurrent state the tree does not fork (tiny Jamba with experts, Mamba, Zamba2) takes a
step exactly,
its load-balancing loss counts the samples' tokens and no padding, and the run says once what
the tree would have saved."""

import pytest
import torch
from families import RECURRENT
from on_policy import on_policy
from packing_strategies import make_sample
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM

from asyncgrpo.adapters.kernels.packed_policy import PackedPolicy, RouterAuxLoss
from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.core.packing.tree import pack_row
from asyncgrpo.core.weights.parity import STALENESS0_GAP
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner

pytestmark = pytest.mark.usefixtures("process_group")
K = 4


def saved(family, folder):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(RECURRENT[family]()).save_pretrained(folder)
    return folder


def samples_for(model):
    """A group of three (one a duplicate, one longer) sharing a prompt, and another prompt."""
    specs = [
        ([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1], 1.0),
        ([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1], 1.0),
        ([1, 2, 3, 7, 8, 9, 10, 11], [0, 0, 0, 1, 1, 1, 1, 1], -1.0),
        ([20, 21, 22, 23], [0, 0, 1, 1], 0.5),
    ]
    return [on_policy(model, make_sample(t, m, advantage=a), K) for t, m, a in specs]


def config(**overrides):
    return AsyncGRPOConfig(learning_rate=1e-2, num_sampler_logprobs=K, seed=0, **overrides)


@pytest.mark.parametrize(
    ("family", "layer"),
    [
        ("jamba", "JambaMambaMixer"),
        ("mamba", "MambaMixer"),
        ("zamba2", "Zamba2AttentionDecoderLayer"),
    ],
)
def test_a_recurrent_decoder_steps_on_policy_and_learns(family, layer, tmp_path) -> None:
    folder = saved(family, tmp_path)
    model = load_causal_lm(folder)
    samples = samples_for(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with capture_logs() as logs:
        learner = Learner(model, config())
    out = learner.train_step([pack_row(samples)])
    assert out.metrics[STALENESS0_GAP] < 1e-5  # the trainer computes what the model does alone
    after = learner.export.full_state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before)
    given_up = [e for e in logs if e["event"] == "tree packing given up"]
    assert len(given_up) == 1 and layer in " ".join(given_up[0]["reasons"])


def test_the_load_balancing_loss_counts_no_padding(tmp_path) -> None:
    folder = saved("jamba", tmp_path)
    model = load_causal_lm(folder)
    samples = samples_for(model)
    aux = RouterAuxLoss.for_model(model, 0.5)
    with torch.no_grad(), aux.capture() as captured:  # each sample alone, then per layer
        for sample in samples:
            model(input_ids=torch.tensor(sample.sequence.input_ids)[None], use_cache=False)
    layers = len(captured) // len(samples)
    want = aux.loss([torch.cat(captured[layer::layers]) for layer in range(layers)]).item()
    learner = Learner(load_causal_lm(folder), config(router_aux_loss_coef=0.5))
    out = learner.train_step([pack_row(samples)])
    assert out.metrics["aux_loss"] == pytest.approx(want, rel=1e-5)
    assert out.metrics[STALENESS0_GAP] < 1e-5


def test_counting_the_padding_would_change_the_load_balancing_loss(tmp_path, monkeypatch) -> None:
    """The control: the same step with every padded position counted."""
    folder = saved("jamba", tmp_path)
    samples = samples_for(load_causal_lm(folder))
    losses = []
    for counted in (False, True):
        if counted:
            monkeypatch.setattr(PackedPolicy, "forwarded_tokens", lambda self, row: None)
        learner = Learner(load_causal_lm(folder), config(router_aux_loss_coef=0.5))
        losses.append(learner.train_step([pack_row(samples)]).metrics["aux_loss"])
    assert abs(losses[1] - losses[0]) > 1e-3 * abs(losses[0])


def test_only_the_routers_are_recorded_where_transformers_names_them(tmp_path) -> None:
    """Jamba records its router logits from every ``nn.Linear`` named ``router``: the other
    linear layers' outputs are no router logits."""
    model = load_causal_lm(saved("jamba", tmp_path))
    aux = RouterAuxLoss.for_model(model, None)
    with torch.no_grad(), aux.capture() as captured:
        model(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=False)
    routers = [m for n, m in model.named_modules() if n.endswith(".router")]
    assert len(captured) == len(routers) >= 1
    assert all(logits.shape[-1] == model.config.num_experts for logits in captured)
