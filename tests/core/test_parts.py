import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.experiments.hardware import GPUS, INTERCONNECTS, model_spec, parameters_only
from asyncgrpo.core.experiments.parts import (
    TRAINER_OVERHEAD_S_PER_SAMPLE,
    Contention,
    Push,
    fit_trainer,
    fsdp_trainer,
    trainer_memory_bytes,
    weight_push,
)

NVLINK, IB = INTERCONNECTS["nvlink4"], INTERCONNECTS["ib-ndr"]


@given(st.floats(1e8, 1e11), st.integers(1, 64), st.integers(1, 64), st.floats(1e3, 1e5))
def test_trainer_throughput_grows_with_gpus_and_collectives_cost_more_across_nodes(
    parameters, gpus, micro_batches, micro_batch_tokens
):
    model = parameters_only(parameters)
    one = fsdp_trainer(model, GPUS["h100"], 1, NVLINK, IB, 8, micro_batch_tokens, micro_batches)
    many = fsdp_trainer(model, GPUS["h100"], gpus, NVLINK, IB, 8, micro_batch_tokens, micro_batches)
    assert many.tokens_per_s == pytest.approx(gpus * one.tokens_per_s)
    assert many.fixed_s >= 0
    # the same ranks over InfiniBand only: never cheaper than within a node
    slow_link = fsdp_trainer(
        model, GPUS["h100"], gpus, IB, IB, 8, micro_batch_tokens, micro_batches
    )
    assert slow_link.fixed_s >= many.fixed_s - 1e-12


def test_gathers_show_only_where_compute_cannot_hide_them() -> None:
    """A 70B model's gathers over 16 ranks across InfiniBand with short micro-batches take
    longer than their compute: the excess is a fixed cost per step; within a node and with
    long micro-batches they hide."""
    model = parameters_only(70e9)
    exposed = fsdp_trainer(model, GPUS["h100"], 16, NVLINK, IB, 8, 1024, 4)
    hidden = fsdp_trainer(model, GPUS["h100"], 8, NVLINK, IB, 8, 65536, 4)
    optimizer_only = 32 * 70e9 / 8 / GPUS["h100"].memory_bytes_per_s
    assert exposed.fixed_s > 1.0
    assert hidden.fixed_s == pytest.approx(optimizer_only)


def test_a_push_sends_to_each_server_and_pauses() -> None:
    model = parameters_only(7e9)
    assert Push(14e9, 50e9, pause_s=0.2, servers=3).seconds == pytest.approx(0.2 + 3 * 0.28)
    nccl = weight_push(model, "nccl", 2, 4, NVLINK, IB)
    assert nccl.seconds == pytest.approx(14e9 * 3 / 4 / 450e9 + 0.2 + 2 * 14e9 / 50e9)
    assert weight_push(model, "lora", 2, 4, NVLINK, IB, lora_bytes=1e8).seconds < nccl.seconds
    with pytest.raises(ValueError, match="lora_bytes"):
        weight_push(model, "lora", 2, 4, NVLINK, IB)


def test_a_delta_push_sends_the_changed_fraction_and_reloads_the_whole_policy() -> None:
    """Bytes from the changed fraction (an int32 index and a bf16 value per changed element,
    never more than the full push); the server's reload of the whole policy from host memory
    is paid either way, so a delta wins over a slow link and loses over a fast one."""
    model = parameters_only(7e9)
    nccl = weight_push(model, "nccl", 2, 4, NVLINK, IB)
    for frac in (0.0, 0.01, 0.3, 1.0):
        delta = weight_push(model, "delta", 2, 4, NVLINK, IB, changed_frac=frac)
        assert delta.bytes == pytest.approx(min(14e9, 14e9 * frac * 3))
        assert delta.pause_s == pytest.approx(0.2 + 14e9 / 25e9)
        assert delta.gather_s == nccl.gather_s
    assert weight_push(model, "delta", 2, 4, NVLINK, IB, changed_frac=0.01).seconds > nccl.seconds
    ethernet = INTERCONNECTS["ethernet-100g"]
    slow = weight_push(model, "nccl", 2, 4, NVLINK, ethernet)
    assert weight_push(model, "delta", 2, 4, NVLINK, ethernet, changed_frac=0.01).seconds < (
        slow.seconds / 2
    )


def test_contention_slows_each_side_only_while_the_other_runs() -> None:
    c = Contention(training_slowdown=1.5, generation_slowdown=1.25)
    assert c.training_rate(generating=False) == 1.0
    assert c.training_rate(generating=True) == pytest.approx(1 / 1.5)
    assert c.generation_rate(training=True) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="slowdown is >= 1"):
        Contention(training_slowdown=0.5)


def test_a_configs_shape_sets_the_trainers_memory() -> None:
    config = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    }
    llama = model_spec(config)  # Llama-3-8B's shape
    assert llama.parameters == pytest.approx(8.03e9, rel=0.01)
    assert llama.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    state_only = trainer_memory_bytes(parameters_only(llama.parameters), 4, 16384)
    assert (
        trainer_memory_bytes(llama, 4, 16384)
        > state_only
        == pytest.approx(16 * llama.parameters / 4)
    )


@given(
    st.floats(0.0, 300.0),
    st.floats(1.0, 1e5),
    st.lists(
        st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 512]), min_size=2, max_size=5, unique=True
    ),
)
def test_a_fit_over_gpu_counts_recovers_the_fixed_and_the_shared_parts(fixed, work, counts) -> None:
    fit = fit_trainer([(n, fixed + work / n) for n in counts])
    assert fit.fixed_s == pytest.approx(fixed, rel=1e-6, abs=1e-6)
    assert fit.gpu_s == pytest.approx(work, rel=1e-6)


def test_verls_asynchronous_runs_give_the_default_fixed_cost() -> None:
    """The default (per sample of a 512 x 16 step) is the fit through 32 and 64 GPUs; with the
    run on 16 the three give 56.8 s; one GPU count cannot be fitted."""
    pair = fit_trainer([(32, 157.0), (64, 113.16)])
    assert pair.fixed_s == pytest.approx(TRAINER_OVERHEAD_S_PER_SAMPLE * 8192)
    assert fit_trainer([(16, 269.8), (32, 157.0), (64, 113.16)]).fixed_s == pytest.approx(
        56.76, abs=0.01
    )
    with pytest.raises(ValueError, match="two or more trainer GPU counts"):
        fit_trainer([(32, 157.0), (32, 150.0)])
