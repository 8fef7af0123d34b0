"""asyncgrpo's log lines in a program that uses it as a library: they go through the standard
library's ``"asyncgrpo"`` logger to stderr (never stdout), follow ``log_level`` on the main
process and ``log_level_replica`` elsewhere, and leave the program's own logging alone."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
import structlog
from structlog.testing import capture_logs

from asyncgrpo.shell.config import AsyncGRPOConfig, configure_logging, use_log_levels
from asyncgrpo.shell.config.logs import LIBRARY_LOGGER, process_log_level

log = structlog.get_logger("asyncgrpo.trainer")


@pytest.fixture(autouse=True)
def untouched_logging(monkeypatch) -> Iterator[None]:
    """Each test starts as a fresh process would (structlog unconfigured, the "asyncgrpo"
    logger as the standard library makes it) and leaves both as it found them."""
    saved, was_configured = structlog.get_config(), structlog.is_configured()
    logger = logging.getLogger(LIBRARY_LOGGER)
    level = logger.level
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    logger.setLevel(logging.NOTSET)
    structlog.reset_defaults()
    try:
        yield
    finally:
        logger.setLevel(level)
        if was_configured:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()


@contextlib.contextmanager
def no_logging_configured(monkeypatch) -> Iterator[None]:
    """As in a program that configured no logging (pytest's own handlers put aside)."""
    with monkeypatch.context() as patch:
        patch.setattr(logging.root, "handlers", [])
        yield


def config(**fields) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(output_dir="unused", **fields)


def test_a_library_user_sees_info_lines_on_stderr_and_silences_them(monkeypatch, capsys) -> None:
    use_log_levels(config(), main_process=True)
    with no_logging_configured(monkeypatch):
        log.debug("debug line")
        log.info("info line", step=3)
        logging.getLogger("asyncgrpo").setLevel(logging.WARNING)
        log.info("silenced line")
        log.warning("warning line")
    out, err = capsys.readouterr()
    assert out == ""
    assert "info line" in err and "step=3" in err and "warning line" in err
    assert "debug line" not in err and "silenced line" not in err


def test_log_level_of_the_config_silences_info_lines(monkeypatch, capsys) -> None:
    use_log_levels(config(log_level="warning"), main_process=True)
    with no_logging_configured(monkeypatch):
        log.info("info line")
        log.warning("warning line")
    assert "info line" not in capsys.readouterr().err
    assert logging.getLogger("asyncgrpo").getEffectiveLevel() == logging.WARNING


def test_a_level_the_program_set_stays_under_a_passive_log_level() -> None:
    logging.getLogger("asyncgrpo").setLevel(logging.ERROR)
    use_log_levels(config(log_level="passive"), main_process=True)
    assert logging.getLogger("asyncgrpo").level == logging.ERROR


def test_other_ranks_and_the_rollout_process_follow_log_level_replica(monkeypatch) -> None:
    settings = config(log_level="debug", log_level_replica="error")
    assert process_log_level(settings, main_process=True) == logging.DEBUG
    assert process_log_level(settings, main_process=False) == logging.ERROR
    monkeypatch.setenv("RANK", "1")  # torchrun's rank of this process
    use_log_levels(settings)
    assert logging.getLogger("asyncgrpo").level == logging.ERROR
    use_log_levels(settings, main_process=False)  # what the rollout process calls
    assert logging.getLogger("asyncgrpo").level == logging.ERROR
    monkeypatch.setenv("RANK", "0")
    use_log_levels(settings)
    assert logging.getLogger("asyncgrpo").level == logging.DEBUG


def test_a_program_that_configured_logging_gets_the_lines_in_its_handlers(caplog, capsys) -> None:
    """pytest's caplog is a handler on the root logger, as ``logging.basicConfig`` makes one:
    the line reaches it, rendered, and asyncgrpo's own handler prints nothing."""
    root_handlers = list(logging.root.handlers)
    use_log_levels(config(), main_process=True)
    with caplog.at_level(logging.INFO):
        log.info("info line", step=3)
    assert [r.name for r in caplog.records] == ["asyncgrpo.trainer"]
    assert "info line" in caplog.records[0].getMessage()
    assert "step=3" in caplog.records[0].getMessage()
    assert capsys.readouterr().err == ""
    assert logging.root.handlers == root_handlers  # the library added none there


def test_a_program_that_configured_structlog_keeps_its_configuration() -> None:
    renderer = structlog.processors.KeyValueRenderer()
    structlog.configure(processors=[renderer])
    use_log_levels(config(), main_process=True)
    assert structlog.get_config()["processors"] == [renderer]


def test_capture_logs_still_captures_after_the_library_set_up_logging() -> None:
    use_log_levels(config(log_level="warning"), main_process=True)
    with capture_logs() as logs:
        log.info("info line", step=3)
    assert logs == [{"event": "info line", "step": 3, "log_level": "info"}]


def test_configure_logging_prints_json_lines_to_stderr_even_beside_other_handlers(
    caplog, capsys
) -> None:
    configure_logging("info", json_logs=True)
    with caplog.at_level(logging.INFO):
        log.info("info line", step=3)
        log.debug("debug line")
    out, err = capsys.readouterr()
    assert out == ""
    assert '"event": "info line"' in err and '"step": 3' in err and "debug line" not in err
    assert caplog.records == []  # not passed on to the root logger's handlers: no duplicates
