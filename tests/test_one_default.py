"""Every setting has one default, in ``AsyncGRPOConfig``: a component record built from the
config (sampling, loss, step queue, objectives, the simulator's knobs named after config
fields) either has no default of its own for a setting, or the config's."""

from __future__ import annotations

import dataclasses
import typing

import attrs
import pytest

from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.core.loss.inputs import LossConfig
from asyncgrpo.core.loss.objectives import OBJECTIVES, SETTINGS, SETTINGS_TYPES
from asyncgrpo.core.run.step_queue import QueueSettings
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.experiments.simulate import SimulationConfig
from asyncgrpo.shell.servers import ServerSettings

CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}
RENAMED = {
    ("SamplingParams", "max_tokens"): "max_completion_length",
    ("ServerSettings", "base_url"): "vllm_server_base_url",
    ("ServerSettings", "timeout_s"): "vllm_server_timeout",
    ("ServerSettings", "stall_s"): "vllm_server_stall_timeout",
}
SAME_MEANING = {("SamplingParams", "min_p"): lambda config_default: config_default or 0.0}
"""A component's value for the config's default where the forms differ (None: off = 0.0)."""
OWN_MEANING = {
    ("SimulationConfig", "max_steps"): "the steps to simulate; the config's -1 (train by "
    "epochs) has no simulated counterpart",
    ("SimulationConfig", "token_budget"): "the simulated server's row size; the config's None "
    "means a real server's max_model_len",
}
"""Fields that share a config field's name but not its meaning, and why."""
COMPONENTS = (SamplingParams, LossConfig, QueueSettings, SimulationConfig, ServerSettings)
"""Objective settings take their one default from their objective's declaration
(:func:`test_each_objective_setting_is_a_config_field_with_its_declared_default`)."""


def component_defaults(cls: type) -> list[tuple[str, str, object]]:
    """``(field, config field, default)`` of each field of ``cls`` that names a config field
    and has a default of its own."""
    found = []
    for field in attrs.fields(cls):
        name = RENAMED.get((cls.__name__, field.name), field.name)
        if (cls.__name__, field.name) in OWN_MEANING:
            continue
        if name in CONFIG_DEFAULTS and field.default is not attrs.NOTHING:
            default = field.default
            found.append((field.name, name, default))
    return found


@pytest.mark.parametrize("cls", COMPONENTS, ids=lambda c: c.__name__)
def test_a_component_default_is_the_configs(cls: type) -> None:
    for field, name, default in component_defaults(cls):
        wanted = SAME_MEANING.get((cls.__name__, field), lambda d: d)(CONFIG_DEFAULTS[name])
        assert default == wanted, (
            f"{cls.__name__}.{field} defaults to {default!r} but AsyncGRPOConfig.{name} to "
            f"{CONFIG_DEFAULTS[name]!r}: drop the component's default (the config gives it)"
        )


@pytest.mark.parametrize("loss_type", OBJECTIVES)
def test_an_objectives_settings_record_defaults_are_the_configs(loss_type: str) -> None:
    """The chosen objective's record built from a default config is the record's own defaults
    (the worked examples' settings), of the objective's type."""
    settings = AsyncGRPOConfig(output_dir="x", loss_type=loss_type).objective_settings()
    assert settings == OBJECTIVES[loss_type].settings_type()
    assert type(settings) is OBJECTIVES[loss_type].settings_type


def test_the_checker_catches_a_second_default() -> None:
    @attrs.frozen
    class Stale:
        max_staleness: int = 1

    assert component_defaults(Stale) == [("max_staleness", "max_staleness", 1)]
    assert CONFIG_DEFAULTS["max_staleness"] != 1


def test_each_objective_setting_is_a_config_field_with_its_declared_default() -> None:
    """An objective declares its settings once (core.loss.objectives.SETTINGS); the config has
    a field of each, with the declared default, help and type, and builds the settings from
    those fields."""
    fields = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    hints = typing.get_type_hints(AsyncGRPOConfig)  # as HfArgumentParser reads them
    for setting in SETTINGS:
        field = fields[setting.name]
        assert field.default == setting.default, setting.name
        assert field.metadata["help"] == setting.help, setting.name
        assert hints[setting.name] == (float | None if setting.optional else float), setting.name
    objective_fields = [
        f.name for f in dataclasses.fields(AsyncGRPOConfig) if f.name in {s.name for s in SETTINGS}
    ]
    assert objective_fields == [setting.name for setting in SETTINGS], (
        "declare each objective setting once in AsyncGRPOConfig, after loss_type, in the order "
        "of core.loss.objectives.SETTINGS"
    )
    changed = {setting.name: 0.75 for setting in SETTINGS if setting.name.endswith("_clip_min")}
    config = AsyncGRPOConfig(output_dir="x", **changed)
    for settings_type in SETTINGS_TYPES:  # each record reads the flat fields of its names
        record = config._settings_record(settings_type)
        own = {field.name for field in attrs.fields(settings_type)} & set(changed)
        assert {name: getattr(record, name) for name in own} == {name: 0.75 for name in own}


def test_a_config_subclass_may_not_redeclare_an_objective_setting() -> None:
    with pytest.raises(TypeError, match="tis_token_cap is declared by its objective"):

        @dataclasses.dataclass
        class Redeclared(AsyncGRPOConfig):
            pass_rate_cap: float = 0.9
            tis_token_cap: float = 3.0


def test_a_config_subclass_adds_its_own_fields() -> None:
    @dataclasses.dataclass
    class CurriculumConfig(AsyncGRPOConfig):
        pass_rate_cap: float = 0.9

    config = CurriculumConfig(output_dir="x", pass_rate_cap=0.5, tis_token_cap=3.0)
    assert (config.pass_rate_cap, config.tis_token_cap) == (0.5, 3.0)
