import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.core.experiments import gpu_plan
from asyncgrpo.core.experiments.decode_figures import PUBLISHED, implied_overhead_s, nearest
from asyncgrpo.core.experiments.generator import DECODE_STEP_OVERHEAD_S
from asyncgrpo.core.experiments.launch import launch_blocks
from asyncgrpo.core.experiments.parts import TRAINER_OVERHEAD_S_PER_SAMPLE
from asyncgrpo.core.experiments.workload import WorkloadError, workload_from_mapping

WORKLOAD = {
    "model": {"name": "Qwen/Qwen2.5-7B", "parameters": 7.6e9, "kv_bytes_per_token": 57344},
    "cluster": {"gpu": "h100", "gpus_per_node": 8},
    "batch": {"prompts_per_step": 64, "num_generations": 8},
    "lengths": {
        "prompt": {"mean": 200, "p50": 150, "max": 1024},
        "response": {"mean": 2600, "p50": 1800, "p90": 5500, "max": 8192},
    },
}


def changed(table: str, key: str, value: object) -> dict:
    data = copy.deepcopy(WORKLOAD)
    if value is None:
        del data[table][key]
    else:
        data.setdefault(table, {})[key] = value
    return data


@pytest.mark.parametrize(
    ("data", "names"),
    [
        (changed("batch", "num_generations", 1), ["[batch] num_generations", ">= 2"]),
        (changed("batch", "prompts_per_step", None), ["[batch] prompts_per_step", "missing"]),
        (changed("cluster", "gpu", "h1000"), ["[cluster] gpu", "did you mean 'h100'"]),
        (changed("cluster", "intra_node", "nvlnk4"), ["[cluster] intra_node", "nvlink4"]),
        (changed("model", "kv_bytes_per_token", None), ["[model]", "kv_bytes_per_token"]),
        (changed("model", "parameter", 7e9), ["[model] parameter", "did you mean 'parameters'"]),
        (
            changed("lengths", "response", {"mean": 900, "max": 4096}),
            ["[lengths] response", "add quantiles"],
        ),
        (
            changed("lengths", "response", {"mean": 7900, "p50": 1000, "max": 8192}),
            ["[lengths] response", "they allow"],
        ),
        (
            changed("lengths", "group_correlation", 1.5),
            ["[lengths] group_correlation", "lies in [0, 1]"],
        ),
        (changed("lengths", "group_correlation", "high"), ["[lengths] group_correlation"]),
        (changed("settings", "weight_path", "nfs"), ["[settings] weight_path", "nccl"]),
        (
            changed("settings", "delta_changed_frac", 2.0),
            ["[settings] delta_changed_frac", "in [0, 1]"],
        ),
        (
            changed("settings", "max_staleness", 0)
            | {"settings": {"max_staleness": 0, "weight_sync_steps": 3}},
            ["[settings] max_staleness", "raise max_staleness"],
        ),
        (changed("generator", "tokens_per_s", 2500.0), ["[generator] source"]),
        (changed("trainer", "mfu", 40), ["[trainer] mfu", "at most 1"]),
        (changed("trainer", "step_overhead_s", -1), ["[trainer] step_overhead_s", ">= 0"]),
        (
            changed("trainer", "measured", [{"gpus": 8, "train_s": 30.0}]),
            ["[trainer] measured", "two or more trainer GPU counts"],
        ),
        (
            changed("trainer", "measured", [{"gpus": 8, "step_s": 30.0}]),
            ["[trainer] measured", "{gpus = N, train_s = S}"],
        ),
        ({**WORKLOAD, "clusters": {}}, ["[clusters]", "did you mean 'cluster'"]),
    ],
)
def test_a_bad_workload_names_the_table_the_key_and_the_fix(data, names) -> None:
    with pytest.raises(WorkloadError) as error:
        workload_from_mapping(data)
    for name in names:
        assert name in str(error.value)


def test_a_config_gives_the_model_and_defaults_fill_the_cluster() -> None:
    data = changed("model", "parameters", None)
    del data["model"]["kv_bytes_per_token"]
    data["model"]["config"] = {
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
    }
    w = workload_from_mapping(data)
    assert w.model.parameters == pytest.approx(7.62e9, rel=0.01)
    assert w.model.kv_bytes_per_token == 57344
    assert (w.intra_node.name, w.inter_node.name, w.max_staleness, w.weight_path) == (
        "nvlink4",
        "ib-ndr",
        None,
        "nccl",
    )
    assert w.max_model_len == 1024 + 8192


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 40), st.sampled_from([4, 8]), st.sampled_from([1.5e9, 7.6e9, 32e9]))
def test_every_split_uses_each_gpu_once_and_its_commands_add_up(gpus, per_node, parameters):
    """Whatever the GPUs, every feasible split lays its roles on disjoint devices that add up
    to all of them, and its launch commands name exactly those devices."""
    data = changed("cluster", "gpus_per_node", per_node)
    data["model"]["parameters"] = parameters
    workload = workload_from_mapping(data)
    try:
        found = gpu_plan.splits(workload, gpus)
    except ValueError as error:
        assert "no split" in str(error) or "do not fit" in str(error)
        return
    for split in found:
        where = gpu_plan.layout(split, gpus, per_node)
        placed = [(n, d) for n, ds in (*where.trainer, *where.servers) for d in ds]
        assert len(placed) == len(set(placed)) == gpus
        assert all(d < per_node for _, d in placed)
        shape = gpu_plan.step_shape(workload, split)
        rows = split.trainer_gpus * shape.gradient_accumulation_steps
        assert rows * shape.token_budget * gpu_plan.PACKING >= shape.forwarded_tokens
        blocks = launch_blocks(
            workload.model_name, where, per_node, workload.max_model_len, "nccl", {}
        )
        text = "\n".join(b.text for b in blocks)
        assert text.count("vllm serve") == split.servers
        assert text.count("torchrun") == 1
        assert (where.nodes > 1) == ("#SBATCH --nodes" in text)


def test_the_long_tail_lowers_the_screened_rate_at_the_same_mean() -> None:
    """Responses of the same mean with a long tail: a group holds its slots until its longest
    response ends, so fewer of its requests run and the generator's rate falls."""
    even = workload_from_mapping(changed("lengths", "response", 2600))
    tail = workload_from_mapping(WORKLOAD)
    split = gpu_plan.Split(4, 4, 1)
    assert gpu_plan.running_share(even) == 1.0 > gpu_plan.running_share(tail)
    assert gpu_plan.screen(tail, split).generation < gpu_plan.screen(even, split).generation


def test_a_decode_step_overhead_slows_the_roofline_most_where_few_requests_run() -> None:
    """``[generator] step_overhead_s`` adds to every decode step of the roofline: one request
    (the tail of a synchronous step) decodes much slower, a full server less so; it
    needs a source, and a figure is optional beside it."""
    plain = workload_from_mapping(
        WORKLOAD | {"generator": {"step_overhead_s": 0.0, "source": "the roofline alone"}}
    )
    slowed = workload_from_mapping(
        changed("generator", "step_overhead_s", 0.0025)
        | {"generator": {"step_overhead_s": 0.0025, "source": "a measured run"}}
    )
    assert slowed.decode_figure is None and slowed.decode_step_overhead_s == 0.0025
    fast, slow = (gpu_plan.server_generator(w, 1) for w in (plain, slowed))
    alone = fast.tokens_per_s(1, 3000) / slow.tokens_per_s(1, 3000)
    full = fast.tokens_per_s(256, 256 * 3000) / slow.tokens_per_s(256, 256 * 3000)
    assert alone > 1.4 and 1.0 < full < alone, (alone, full)  # 4.5 ms a step alone on H100
    assert "2.5 ms a decode step besides" in slow.source
    with pytest.raises(WorkloadError, match=r"\[generator\] source"):
        workload_from_mapping(changed("generator", "step_overhead_s", 0.0025))
    with pytest.raises(WorkloadError, match=r"\[generator\] step_overhead_s"):
        workload_from_mapping(
            changed("generator", "step_overhead_s", -1.0)
            | {"generator": {"step_overhead_s": -1.0, "source": "x"}}
        )


def test_the_trainers_fixed_cost_is_the_default_per_sample_the_workloads_or_a_fit() -> None:
    """A step's seconds that no GPU count removes: by default the per-sample figure fitted to
    verl's runs, else the workload's; with two measured steps the trainer is their fit, and
    it gives back the measured steps at their GPU counts (the FLOPs model does not)."""
    default = workload_from_mapping(WORKLOAD)
    assert default.trainer_overhead_s == pytest.approx(TRAINER_OVERHEAD_S_PER_SAMPLE * 512)
    given = workload_from_mapping(changed("trainer", "step_overhead_s", 2.5))
    assert given.trainer_overhead_s == 2.5
    split = gpu_plan.Split(4, 4, 1)
    shape = gpu_plan.step_shape(default, split)
    flops = gpu_plan.trainer_part(default, split, shape)
    assert flops.fixed_s == pytest.approx(
        gpu_plan.trainer_part(given, split, shape).fixed_s - 2.5 + default.trainer_overhead_s
    )
    measured = [{"gpus": 2, "train_s": 50.0}, {"gpus": 8, "train_s": 20.0}]
    fitted = workload_from_mapping(changed("trainer", "measured", measured))
    for point in measured:
        at = gpu_plan.Split(point["gpus"], 4, 1)
        trainer = gpu_plan.trainer_part(fitted, at, shape)
        assert trainer.step_s(shape.forwarded_tokens) == pytest.approx(point["train_s"])
        assert "FITTED" in trainer.source
        other = gpu_plan.trainer_part(default, at, shape).step_s(shape.forwarded_tokens)
        assert other != pytest.approx(point["train_s"], rel=0.05)  # the control


def test_the_default_generator_has_the_overhead_of_a_published_figure_else_verls() -> None:
    """Without a [generator] table a server is the roofline plus the decode step overhead a
    published figure of its GPU kind implies (H100: Mistral-7B's 8.95 ms TPOT at 10 requests,
    4.47 ms beyond its roofline), labelled with its source; a GPU kind without one gets the
    overhead fitted to verl's runs (5.18 ms); step_overhead_s = 0 gives the roofline alone,
    the labelled upper bound. A response of 27,648 tokens decoded alone (a synchronous step's
    tail) takes 27,648 overheads more."""
    h100 = gpu_plan.server_generator(workload_from_mapping(WORKLOAD), 1)
    h20 = gpu_plan.server_generator(workload_from_mapping(changed("cluster", "gpu", "h20")), 1)
    bound = gpu_plan.server_generator(
        workload_from_mapping(
            WORKLOAD | {"generator": {"step_overhead_s": 0.0, "source": "the roofline"}}
        ),
        1,
    )
    published = implied_overhead_s(nearest("h100", 7.6e9))
    assert h100.overhead_s == published == pytest.approx(4.47e-3, abs=5e-5)
    assert "Mistral-7B-Instruct-v0.3" in h100.source and "LambdaLabsML" in h100.source
    assert h20.overhead_s == DECODE_STEP_OVERHEAD_S and "verl" in h20.source
    assert bound.overhead_s == 0.0
    assert "ROOFLINE" in bound.source and "upper bound" in bound.source
    alone, overhead = (27648 / g.tokens_per_s(1, 28000) for g in (bound, h100))
    assert overhead - alone == pytest.approx(27648 * published)


def test_every_published_figure_is_slower_than_its_roofline_and_found_by_its_gpu() -> None:
    for figure in PUBLISHED:
        assert 0.0 < implied_overhead_s(figure) < figure.tpot_s
        assert nearest(figure.gpu, figure.parameters) == figure
    assert nearest("a100", 1.5e9).model == "Qwen3-1.7B"
    assert nearest("a100", 70e9).model == "Mistral-7B-Instruct-v0.3"


def test_a_groups_length_correlation_is_read_with_0_by_default() -> None:
    assert workload_from_mapping(WORKLOAD).response_group_correlation == 0.0
    workload = workload_from_mapping(changed("lengths", "group_correlation", 0.6))
    assert workload.response_group_correlation == 0.6
