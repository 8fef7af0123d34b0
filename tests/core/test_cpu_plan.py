"""The CPU split between a server on this host and the trainer's ranks: properties."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.servers.cpu_plan import (
    AUTO,
    OFF,
    format_cpu_list,
    is_local_host,
    plan_cpus,
)

core_sets = st.sets(st.integers(0, 255), min_size=1, max_size=64)
ranks = st.integers(1, 8)
server_counts = st.none() | st.integers(1, 64)


@given(core_sets, ranks, server_counts)
def test_a_possible_split_is_disjoint_covers_the_cores_and_threads_match(
    cores, local_ranks, server_cpus
) -> None:
    plan = plan_cpus(sorted(cores), local_ranks, True, AUTO, server_cpus)
    assert len(plan.rank_threads) == local_ranks
    if len(cores) <= local_ranks:
        assert not plan.disjoint and plan.rank_threads == (1,) * local_ranks
        return
    assert plan.disjoint and plan.server_cpus
    assert len(plan.rank_cpus) == local_ranks and all(plan.rank_cpus)
    sets = [set(plan.server_cpus), *(set(s) for s in plan.rank_cpus)]
    assert sum(len(s) for s in sets) == len(set().union(*sets)) == len(cores)
    assert set().union(*sets) == cores
    assert plan.rank_threads == tuple(len(s) for s in plan.rank_cpus)
    if server_cpus is not None:
        assert len(plan.server_cpus) == min(server_cpus, len(cores) - local_ranks)


@given(core_sets, ranks)
def test_without_a_server_the_ranks_get_every_core(cores, local_ranks) -> None:
    plan = plan_cpus(sorted(cores), local_ranks, False)
    assert plan.server_cpus == () and plan.vllm_bind() is None
    assert set().union(*map(set, plan.rank_cpus)) == cores
    assert all(t >= 1 for t in plan.rank_threads)


@given(core_sets, ranks, st.booleans())
def test_off_leaves_threads_and_affinity_alone(cores, local_ranks, server) -> None:
    plan = plan_cpus(sorted(cores), local_ranks, server, OFF)
    assert plan.server_cpus == () and plan.rank_cpus == ()
    assert plan.rank_threads == (0,) * local_ranks


@given(core_sets, ranks, server_counts)
def test_the_plan_depends_only_on_its_inputs(cores, local_ranks, server_cpus) -> None:
    ordered = sorted(cores)
    assert plan_cpus(ordered, local_ranks, True, AUTO, server_cpus) == plan_cpus(
        list(reversed(ordered)), local_ranks, True, AUTO, server_cpus
    )


def test_two_cores_one_rank_give_the_server_core_0_and_the_trainer_core_1() -> None:
    plan = plan_cpus([0, 1], 1, True)
    assert (plan.server_cpus, plan.rank_cpus, plan.rank_threads) == ((0,), ((1,),), (1,))
    assert plan.vllm_bind() == "0"


@given(st.sets(st.integers(0, 500), min_size=1, max_size=40))
def test_cpu_lists_round_trip(cpus) -> None:
    text = format_cpu_list(sorted(cpus))
    parsed = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        parsed |= set(range(int(low), int(high or low) + 1))
    assert parsed == cpus


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="cpu_sharing"):
        plan_cpus([0, 1], 1, True, "sometimes")
    with pytest.raises(ValueError, match="server_cpus"):
        plan_cpus([0, 1], 1, True, AUTO, 0)
    with pytest.raises(ValueError, match="local_ranks"):
        plan_cpus([0, 1], 0, True)


def test_local_hosts() -> None:
    assert is_local_host("localhost") and is_local_host("myhost", ["myhost"])
    assert not is_local_host("10.0.0.7", ["myhost"])


@given(st.lists(st.integers(0, 63), max_size=16, unique=True), st.integers(1, 8))
def test_local_servers_split_the_server_cores(cores, servers) -> None:
    from asyncgrpo.core.servers.cpu_plan import split_server_cpus

    shares = split_server_cpus(cores, servers)
    assert len(shares) == servers
    if not cores:
        assert shares == ((),) * servers
        return
    assert all(shares)  # every server gets a core
    assert set().union(*shares) == set(cores)
    if len(cores) >= servers:  # disjoint, near-equal
        assert sum(len(s) for s in shares) == len(cores)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
