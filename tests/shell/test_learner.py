"""The learner on one process (FSDP2 over a 1-process gloo group, tiny models, fp32 CPU).

Samples are made on-policy (their sampler log-probs and top-k tables are the model's own), so
the importance ratios start at 1 and no token is masked.
"""

import attrs
import numpy as np
import pytest
import torch
from on_policy import on_policy
from packing_strategies import make_sample
from peft import LoraConfig, PeftModel
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

from asyncgrpo.adapters.kernels.packed_policy import candidate_mask, sampler_topk
from asyncgrpo.adapters.models.causal_lm import build_tokenizer, load_causal_lm
from asyncgrpo.core.loss.objectives import OBJECTIVES
from asyncgrpo.core.packing.tree import pack_row
from asyncgrpo.core.records import TrainingSequence
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner

PROMPT = [11, 12, 13, 14, 15]
K = 4


pytestmark = pytest.mark.usefixtures("process_group")


def on_policy_samples(path, samples, k=K):
    """``samples`` with the model's own log-probs and top-``k`` tables as the sampler's."""
    model = load_causal_lm(path)
    return [on_policy(model, sample, k) for sample in samples]


def completion(tokens, advantage, group=0, prompt=PROMPT):
    return make_sample(prompt + tokens, [0] * len(prompt) + [1] * len(tokens), group, advantage)


def samples_of(path, *specs):
    return on_policy_samples(path, [completion(*spec) for spec in specs])


def sequence_logp(model, sample) -> float:
    """Summed log-prob of the sample's trained tokens under ``model`` (stock attention)."""
    seq = sample.sequence
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(seq.input_ids)[None], use_cache=False).logits
    logp_all = torch.log_softmax(logits[0].double(), -1)
    trained = np.flatnonzero(seq.trained_mask)
    return float(logp_all[trained - 1, seq.input_ids[trained]].sum())


def weights_after(learner):
    return {k: v.clone() for k, v in learner.export.full_state_dict().items()}


def config(**overrides) -> AsyncGRPOConfig:
    fields = dict(learning_rate=1e-2, num_sampler_logprobs=K, seed=0)
    return AsyncGRPOConfig(**(fields | overrides))


def sgd(model, lr=0.5):
    return (torch.optim.SGD(model.parameters(), lr=lr), None)


@pytest.mark.parametrize("loss_type", sorted(OBJECTIVES))
def test_a_step_raises_positive_and_lowers_negative_advantage_tokens(tiny_qwen3, loss_type) -> None:
    """Every objective, through the learner: on-policy, each is a policy gradient."""
    good, bad = samples_of(tiny_qwen3, ([21, 22, 23], 1.0), ([31, 32, 33], -1.0))
    learner = Learner(load_causal_lm(tiny_qwen3), config(loss_type=loss_type))
    needs_topk = OBJECTIVES[loss_type].needs.sampler_topk
    out = learner.train_step([pack_row([good, bad])])
    stock = load_causal_lm(tiny_qwen3)
    before = [sequence_logp(stock, s) for s in (good, bad)]
    stock.load_state_dict(learner.export.full_state_dict())
    after = [sequence_logp(stock, s) for s in (good, bad)]
    assert after[0] > before[0] + 0.1 and after[1] < before[1] - 0.1
    metrics = out.metrics
    assert metrics["sampling/masked_mean"] == 0.0
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["learning_rate"] == 1e-2 and metrics["grad_norm"] > 0
    assert ("sampling/sampler_mass" in metrics) == needs_topk
    assert {"perf/fwd_s", "perf/fwd_bwd_s", "perf/optimizer_s"} <= set(metrics)
    assert learner.step == 1


def test_accumulating_two_micro_batches_equals_one_holding_both(tiny_qwen3) -> None:
    """Equal trained tokens per micro-batch: sum_A / (2n) + sum_B / (2n) = (sum_A + sum_B) / 2n."""
    a, b = samples_of(tiny_qwen3, ([21, 22, 23], 1.0), ([31, 32, 33], -0.5, 1, [16, 17, 18]))
    results = []
    for steps, micro_batches in ((2, [pack_row([a]), pack_row([b])]), (1, [pack_row([a, b])])):
        model = load_causal_lm(tiny_qwen3)
        learner = Learner(model, config(gradient_accumulation_steps=steps), optimizers=sgd(model))
        out = learner.train_step(micro_batches)
        results.append((weights_after(learner), out.metrics))
    (accumulated, m1), (single, m2) = results
    for name, tensor in single.items():
        torch.testing.assert_close(accumulated[name], tensor, rtol=0, atol=1e-6)
    for name in ("loss", "grad_norm", "entropy", "sampling/sampler_mass"):
        assert m1[name] == pytest.approx(m2[name], rel=1e-5), name


def test_an_empty_row_runs_and_adds_nothing(tiny_qwen3) -> None:
    (sample,) = samples_of(tiny_qwen3, ([21, 22, 23], 1.0))
    model = load_causal_lm(tiny_qwen3)
    learner = Learner(model, config(), optimizers=sgd(model, lr=0.0))
    empty = learner.train_step([None]).metrics
    assert empty["grad_norm"] == 0.0 and empty["loss"] == 0.0 and "entropy" not in empty
    half = learner.train_step([pack_row([sample]), None]).metrics
    full = learner.train_step([pack_row([sample])]).metrics
    # the step's loss is the mean over its micro-batches, the empty one included
    assert half["grad_norm"] == pytest.approx(full["grad_norm"] / 2, rel=1e-6)
    assert half["entropy"] == full["entropy"]


def test_resume_gives_bit_identical_weights(tiny_qwen3, tmp_path) -> None:
    first, second = samples_of(tiny_qwen3, ([21, 22, 23], 1.0), ([31, 32], -1.0))
    settings = config(lr_scheduler_type="constant_with_warmup", warmup_steps=3, weight_decay=0.1)
    straight = Learner(load_causal_lm(tiny_qwen3), settings)
    straight.train_step([pack_row([first])])
    straight.save_checkpoint(tmp_path)
    out = straight.train_step([pack_row([second])])
    resumed = Learner(load_causal_lm(tiny_qwen3), settings)
    resumed.load_checkpoint(tmp_path)
    assert resumed.step == 1
    resumed_out = resumed.train_step([pack_row([second])])
    assert (
        resumed_out.metrics["learning_rate"]
        == out.metrics["learning_rate"]
        == pytest.approx(1e-2 / 3)
    )
    want, got = weights_after(straight), weights_after(resumed)
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_save_pretrained_round_trips(tiny_qwen3, tmp_path) -> None:
    (sample,) = samples_of(tiny_qwen3, ([21, 22, 23], 1.0))
    learner = Learner(load_causal_lm(tiny_qwen3), config())
    learner.train_step([pack_row([sample])])
    learner.export.save_pretrained(tmp_path, AutoTokenizer.from_pretrained(tiny_qwen3))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    want = learner.export.full_state_dict()
    assert set(loaded.state_dict()) == set(want)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in want.items())
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == len(build_tokenizer())


def test_lora_trains_only_the_adapters_and_merges(tiny_qwen3, tmp_path) -> None:
    good, bad = samples_of(tiny_qwen3, ([21, 22, 23], 1.0), ([31, 32, 33], -1.0))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    learner = Learner(load_causal_lm(tiny_qwen3), config(), peft_config=lora)
    trainable = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    learner.train_step([pack_row([good, bad])])
    adapters = learner.export.adapter_state_dict()
    assert adapters and all(".lora_" in k for k in adapters)
    assert any(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)
    base = load_causal_lm(tiny_qwen3).state_dict()
    merged = learner.export.full_state_dict()
    assert set(merged) == set(base)
    changed = {k for k in base if not torch.equal(merged[k], base[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed)
    learner.export.save_pretrained(tmp_path / "merged")
    learner.export.save_pretrained(tmp_path / "adapter", adapter_only=True)
    merged_model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    adapter_model = PeftModel.from_pretrained(load_causal_lm(tiny_qwen3), tmp_path / "adapter")
    for sample in (good, bad):
        assert sequence_logp(merged_model, sample) == pytest.approx(
            sequence_logp(adapter_model, sample), abs=1e-4
        )


@pytest.mark.parametrize(
    "lora",
    [
        LoraConfig(target_modules=["q_proj", "lm_head"]),
        LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"]),
        LoraConfig(target_modules=r".*(q_proj|lm_head)"),
    ],
    ids=["target", "modules_to_save", "regex"],
)
def test_lora_on_lm_head_is_rejected(tiny_qwen3, lora) -> None:
    with pytest.raises(ValueError, match="adapters on lm_head are not supported"):
        Learner(load_causal_lm(tiny_qwen3), config(), peft_config=lora)


def test_router_aux_loss_coef_on_a_dense_model_is_rejected(tiny_qwen3) -> None:
    with pytest.raises(ValueError, match="router_aux_loss_coef is 0.01 but Qwen3ForCausalLM"):
        Learner(load_causal_lm(tiny_qwen3), config(router_aux_loss_coef=0.01))


def test_moe_router_aux_loss_is_added(tmp_path) -> None:
    moe = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.5,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe).save_pretrained(tmp_path)
    samples = on_policy_samples(tmp_path, [completion([21, 22, 23], 1.0, prompt=[1, 2, 3])])
    losses = {}
    for coef in (None, 0.0):
        learner = Learner(load_causal_lm(tmp_path), config(router_aux_loss_coef=coef))
        losses[coef] = learner.train_step([pack_row(samples)]).metrics
    assert "aux_loss" not in losses[0.0] and losses[None]["aux_loss"] > 0
    want = losses[0.0]["loss"] + 0.5 * losses[None]["aux_loss"]
    assert losses[None]["loss"] == pytest.approx(want, rel=1e-5)


def test_score_centering_without_sampler_tables_names_the_fix(tiny_qwen3) -> None:
    learner = Learner(load_causal_lm(tiny_qwen3), config())
    with pytest.raises(ValueError, match="set score_centering=False"):
        learner.train_step([pack_row([completion([21, 22], 1.0)])])


def test_rows_become_sampler_topk_and_candidate_masks() -> None:
    tables = [None, {5: -0.1, 6: -3.0, 7: -2.0, 8: -4.0, 9: -5.0}, {2: -0.5, 3: -1.0}]
    seq = TrainingSequence([1, 2, 3], [0, 1, 1], [0.0, -0.1, -1.0], (None, (2, 5), None), tables)
    row = pack_row([attrs.evolve(completion([2, 3], 1.0), sequence=seq)])
    topk = sampler_topk(row, 3, torch.device("cpu"))
    assert topk.ids[:, :2].tolist() == [[5, 7], [2, 3]] and topk.ids[0, 2] == 6
    assert topk.valid.tolist() == [[True, True, True], [True, True, False]]
    torch.testing.assert_close(topk.logp[0], torch.tensor([-0.1, -2.0, -3.0]))
    mask = candidate_mask(row, 10, torch.device("cpu"))
    assert mask[0].nonzero().flatten().tolist() == [2, 5] and bool(mask[1].all())


@pytest.mark.parametrize("checkpointing", [True, False])
def test_gradient_checkpointing_recomputes_the_layers(tiny_qwen3, checkpointing) -> None:
    (sample,) = samples_of(tiny_qwen3, ([21, 22, 23], 1.0))
    learner = Learner(load_causal_lm(tiny_qwen3), config(gradient_checkpointing=checkpointing))
    calls = []
    layer = learner.model.get_decoder().layers[0]
    layer.self_attn.register_forward_hook(lambda *args: calls.append(1))
    learner.train_step([pack_row([sample])])
    assert len(calls) == (2 if checkpointing else 1)  # the backward runs the forward again


def test_checkpointing_is_decided_for_the_servers_rows_and_the_backend_chosen_once(
    tiny_qwen3,
) -> None:
    """No token_budget: rows are filled to the server's max_model_len, so the decision (asked
    once, on rank 0) is for that row, with the attention backend chosen once for the run."""
    asked = []

    def served_context() -> int:
        asked.append(1)
        return 32768

    with capture_logs() as logs:
        learner = Learner(load_causal_lm(tiny_qwen3), config(), max_model_len=served_context)
    reason = next(e["reason"] for e in logs if e["event"] == "gradient checkpointing")
    assert "a 32,768-token row (the server's max_model_len)" in reason
    assert "'dense or segments, by row' attention (heads x T x T)" in reason
    assert asked == [1] and learner.policy.backend is learner.attention
    backend = next(e for e in logs if e["event"] == "attention backend")
    assert backend["backend"] == learner.attention.name and backend["reason"]


def test_checkpointing_is_decided_once_the_model_is_sharded(tiny_qwen3, monkeypatch) -> None:
    """Free memory is measured with FSDP2's shards in place (on a GPU: on the device), and
    what training still adds is counted from them: a gradient and two AdamW moments per
    trained fp32 value, and the copy one process keeps gathered from forward to backward."""
    from torch.distributed.tensor import DTensor

    from asyncgrpo.shell.learner import learner as learner_module

    model = load_causal_lm(tiny_qwen3)
    sharded_when_measured = []

    def free_bytes(where: str) -> int:
        sharded_when_measured.append(all(isinstance(p, DTensor) for p in model.parameters()))
        return 2**40

    def choose(*args):
        decided.append(args)
        return choose_checkpointing(*args)

    decided: list = []
    choose_checkpointing = learner_module.choose_checkpointing
    monkeypatch.setattr(learner_module, "free_bytes", free_bytes)
    monkeypatch.setattr(learner_module, "choose_checkpointing", choose)
    parameters = sum(p.numel() for p in model.parameters())
    Learner(model, config(token_budget=512))
    assert sharded_when_measured == [True]
    ((_, row, _, device, reserved),) = decided
    assert device.free_bytes == 2**40 and row.tokens == 512
    assert reserved.training_state == (3 * 4 + 4) * parameters  # fp32 throughout


def test_rank_0_must_hold_the_weights_it_sends(tiny_qwen3) -> None:
    with pytest.raises(ValueError, match="rank 0's model is on the meta device"):
        Learner(load_causal_lm(tiny_qwen3, on_meta=True), config())


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_streamed_weights_equal_the_full_state_dict_and_their_metadata(tiny_qwen3, peft) -> None:
    """What weight-transfer engines send: iter_weights yields full_state_dict's tensors in its
    order, and weight_metadata declares them (name, dtype, shape) without gathering. A tied
    LM head is sent under its own name too: vLLM's in-place reload does not tie it again."""
    (sample,) = samples_of(tiny_qwen3, ([21, 22, 23], 1.0))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if peft else None
    learner = Learner(load_causal_lm(tiny_qwen3), config(), peft_config=lora)
    learner.train_step([pack_row([sample])])
    want = learner.export.full_state_dict()
    assert torch.equal(want["lm_head.weight"], want["model.embed_tokens.weight"])
    streamed = list(learner.export.iter_weights())
    assert [name for name, _ in streamed] == list(want)
    assert all(torch.equal(tensor, want[name]) for name, tensor in streamed)
    assert learner.export.weight_metadata() == [
        (n, t.dtype, tuple(t.shape)) for n, t in want.items()
    ]


def test_merged_lora_weights_stream_without_the_whole_model_on_the_host(
    tiny_qwen3, monkeypatch
) -> None:
    """A merged LoRA push gathers and merges one tensor at a time on the learner's device,
    counting what the server's dtype loses first: the whole model is never gathered to the
    host for it, and what streams is what the host-side merge gives."""
    from asyncgrpo.shell.learner import export as export_module

    (sample,) = samples_of(tiny_qwen3, ([21, 22, 23], 1.0))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    learner = Learner(load_causal_lm(tiny_qwen3), config(), peft_config=lora)
    learner.train_step([pack_row([sample])])
    learner.export.check_merged_pushes("torch.float32")
    want = learner.export.synced_state_dict()

    def whole_model_gathered(model):
        raise AssertionError("iter_weights gathered the whole model to the host")

    monkeypatch.setattr(export_module, "gathered_state_dict", whole_model_gathered)
    streamed = list(learner.export.iter_weights())
    assert [name for name, _ in streamed] == list(want)
    assert all(torch.equal(tensor, want[name]) for name, tensor in streamed)


def test_a_learner_that_keeps_freed_memory_gives_it_back_every_trim_period(
    tiny_qwen3, monkeypatch
) -> None:
    """The heap a CPU learner keeps (:mod:`asyncgrpo.core.packing.host_memory`) is trimmed after
    every TRIM_EVERY_STEPS-th optimizer step, once."""
    from asyncgrpo.core.packing.host_memory import TRIM_EVERY_STEPS
    from asyncgrpo.shell.learner import learner as learner_module

    model = load_causal_lm(tiny_qwen3)
    learner = Learner(model, config(), optimizers=sgd(model, lr=0.0))
    assert learner.host_memory.retain, learner.host_memory.reason  # a CPU learner, glibc
    trimmed_after: list[int] = []
    give_back = learner_module.give_back_freed_memory
    monkeypatch.setattr(
        learner_module,
        "give_back_freed_memory",
        lambda: (trimmed_after.append(learner.step), give_back()),
    )
    learner.step = TRIM_EVERY_STEPS - 2
    for _ in range(3):
        learner.train_step([None])
    assert trimmed_after == [TRIM_EVERY_STEPS]
