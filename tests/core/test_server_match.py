"""Servers of one run standing in for each other: every differing flag is named."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.servers.match import (
    FLAGS,
    ServerFlags,
    ServerMismatch,
    check_servers,
    mismatches,
)

text = st.sampled_from(["a", "b", "torch.float32", "torch.bfloat16", "processed_logprobs"])
maybe_int = st.one_of(st.none(), st.integers(1, 4096))
flag_sets = st.builds(
    ServerFlags,
    models=st.lists(st.sampled_from(["m", "n"]), min_size=1, max_size=2, unique=True).map(tuple),
    max_model_len=maybe_int,
    described=st.booleans(),
    dtype=st.one_of(st.none(), text),
    logprobs_mode=st.one_of(st.none(), text),
    max_logprobs=maybe_int,
    generation_config=st.one_of(st.none(), text),
    sampling_mask=st.one_of(st.none(), st.booleans()),
    token_endpoint=st.one_of(st.none(), st.booleans()),
    weight_transfer=st.one_of(st.none(), text),
    lora=st.booleans(),
    max_loras=maybe_int,
    max_lora_rank=maybe_int,
)


@given(flag_sets)
def test_a_server_matches_itself(flags) -> None:
    assert mismatches(flags, flags) == ()
    if "m" in flags.models:
        check_servers(["http://a:1", "http://b:2"], [flags, flags], "m")


@given(flag_sets, flag_sets)
def test_exactly_the_differing_flags_are_named_in_order(a, b) -> None:
    found = mismatches(a, b)
    differing = [flag for name, flag in FLAGS.items() if getattr(a, name) != getattr(b, name)]
    assert [m.flag for m in found] == differing
    assert set(FLAGS) == {f.name for f in attrs.fields(ServerFlags)} - {"models"}


@given(flag_sets, st.sampled_from(sorted(FLAGS)), st.integers(1, 3))
def test_the_first_differing_server_and_its_flag_are_named(flags, name, position) -> None:
    flags = attrs.evolve(flags, models=("m",))
    value = getattr(flags, name)
    if isinstance(value, bool):
        other = not value
    elif isinstance(value, int):
        other = value + 1
    else:
        other = 7 if value is None else f"{value}x"
    changed = attrs.evolve(flags, **{name: other})
    urls = [f"http://127.0.0.1:{8000 + i}" for i in range(4)]
    pool = [flags] * 4
    pool[position] = changed
    with pytest.raises(ServerMismatch) as failed:
        check_servers(urls, pool, "m")
    message = str(failed.value)
    assert message.startswith(
        f"the vLLM server at {urls[position]} differs from the one at {urls[0]} in {FLAGS[name]}:"
    )
    assert "also" not in message  # one flag changed: one named


def test_a_server_without_the_model_is_named_and_adapters_served_are_no_mismatch() -> None:
    serving = ServerFlags(models=("policy",))
    with pytest.raises(ServerMismatch, match="http://b does not serve model 'policy'"):
        check_servers(["http://a", "http://b"], [serving, ServerFlags(models=("other",))], "policy")
    with_adapters = ServerFlags(models=("policy", "asyncgrpo-policy-v3"))
    check_servers(["http://a", "http://b"], [serving, with_adapters], "policy")
