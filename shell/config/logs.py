"""Where asyncgrpo's log lines go: through the standard library's ``logging``, under the
``"asyncgrpo"`` logger hierarchy, so a program that uses asyncgrpo as a library routes, filters
and silences them as it does every other library's.

asyncgrpo logs with structlog (``structlog.get_logger("asyncgrpo.<part>")``); each line is
rendered by structlog, then handed to the standard library logger of the same name
(``structlog.stdlib.LoggerFactory``). Two ways to set this up:

- :func:`use_log_levels`, which the trainer calls when it is built (and the rollout process
  when it starts): it sets the ``"asyncgrpo"`` logger's level from the config's ``log_level``
  (the main process, rank 0) or ``log_level_replica`` (the other ranks and the rollout
  process), like transformers' ``Trainer`` does for the ``"transformers"`` logger. It changes
  structlog's configuration only where nobody configured structlog yet (a program that did
  keeps its own), and it touches no handler of the program's: it adds one handler to the
  ``"asyncgrpo"`` logger, which writes to stderr only while no other handler would receive the
  line (the program configured no logging: ``logging.basicConfig`` or its own handlers take
  over as soon as they exist).
- :func:`configure_logging`, for a program (the ``asyncgrpo`` command line, a script) that
  wants asyncgrpo's own console lines: always on stderr, human-readable or JSON, and not
  passed on to the root logger's handlers.

Example, a library user who wants only warnings from asyncgrpo::

    import logging

    logging.getLogger("asyncgrpo").setLevel(logging.WARNING)
    # or, for a run: AsyncGRPOConfig(log_level="warning")
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import TYPE_CHECKING

import structlog
from transformers.training_args import trainer_log_levels

from asyncgrpo.adapters.process_group import launch_rank

if TYPE_CHECKING:
    from asyncgrpo.shell.config.fields import AsyncGRPOConfig

LIBRARY_LOGGER = "asyncgrpo"
"""The standard library logger above every asyncgrpo logger (``asyncgrpo.trainer``,
``asyncgrpo.rollout``, ...)."""
DEFAULT_MAIN_LEVEL = logging.INFO
"""The main process's level when ``log_level`` is ``"passive"`` and the program set none on the
``"asyncgrpo"`` logger: one line per logged step, the plan, warnings."""
DEFAULT_REPLICA_LEVEL = logging.WARNING
"""Likewise for the other ranks and the rollout process."""

_setup_lock = threading.Lock()


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time (test runners and notebooks swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class StderrHandler(logging.StreamHandler):
    """asyncgrpo's handler on the ``"asyncgrpo"`` logger: writes each line (already rendered
    by structlog) to the current ``sys.stderr``.

    Attributes:
        only_when_unconfigured: True (the library's default): write a line only when no other
            handler would receive it, that is when the program configured no logging. False
            (:func:`configure_logging`): always write.
    """

    def __init__(self, only_when_unconfigured: bool) -> None:
        super().__init__(_CurrentStderr())
        self.only_when_unconfigured = only_when_unconfigured
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if self.only_when_unconfigured and self._others_receive(record):
            return
        super().emit(record)

    def _others_receive(self, record: logging.LogRecord) -> bool:
        """Whether a handler other than this one is on the way of ``record`` from its logger
        up to the root (as ``Logger.callHandlers`` walks it)."""
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(handler is not self for handler in logger.handlers):
                return True
            logger = logger.parent if logger.propagate else None
        return False


def _renderer(json_logs: bool) -> list[structlog.typing.Processor]:
    if json_logs:
        return [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    return [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]


def route_structlog_to_stdlib(json_logs: bool = False) -> None:
    """Configure structlog to hand every line, rendered (key=value for people, or JSON), to the
    standard library logger of its name; lines below that logger's effective level are
    dropped before they are rendered."""
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            *_renderer(json_logs),
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,  # structlog.testing.capture_logs needs fresh loggers
    )


def _library_handler() -> StderrHandler:
    """asyncgrpo's handler on the ``"asyncgrpo"`` logger, added on first use."""
    logger = logging.getLogger(LIBRARY_LOGGER)
    for handler in logger.handlers:
        if isinstance(handler, StderrHandler):
            return handler
    handler = StderrHandler(only_when_unconfigured=True)
    logger.addHandler(handler)
    return handler


def configure_logging(level: int | str = logging.INFO, json_logs: bool = False) -> None:
    """Print asyncgrpo's log lines at ``level`` and above to stderr: key=value lines for people
    (coloured on a terminal), or one JSON object per line for machines.

    For a program that wants asyncgrpo's console output whatever else it configured (the
    ``asyncgrpo`` command line calls it): it configures structlog for the whole process, and the
    ``"asyncgrpo"`` logger stops passing its lines to the root logger's handlers (they would
    print them twice). A library user who routes logging on their own needs none of this: see
    the module's docstring.

    Args:
        level: the ``"asyncgrpo"`` logger's level, a ``logging`` level or its name
            (``"debug"``, ``"info"``, ``"warning"``, ``"error"``, ``"critical"``).
        json_logs: JSON lines instead of key=value lines.

    Example, a script that shows asyncgrpo's warnings and errors only, as JSON lines::

        from asyncgrpo import AsyncGRPOTrainer, configure_logging

        configure_logging("warning", json_logs=True)
        AsyncGRPOTrainer(...).train()
    """
    with _setup_lock:
        route_structlog_to_stdlib(json_logs)
        logger = logging.getLogger(LIBRARY_LOGGER)
        logger.setLevel(level.upper() if isinstance(level, str) else level)
        logger.propagate = False
        _library_handler().only_when_unconfigured = False


def process_log_level(config: AsyncGRPOConfig, main_process: bool) -> int | None:
    """The ``"asyncgrpo"`` logger's level in this process: the config's ``log_level`` in the
    main process (rank 0), its ``log_level_replica`` in the other ranks and the rollout process;
    None for ``"passive"`` (leave the logger's level as the program set it).

    Example:
        >>> from asyncgrpo import AsyncGRPOConfig
        >>> config = AsyncGRPOConfig(log_level="error", log_level_replica="debug")
        >>> process_log_level(config, main_process=True), process_log_level(config, False)
        (40, 10)
    """
    name = config.log_level if main_process else config.log_level_replica
    try:
        level = trainer_log_levels[name]
    except KeyError:
        field = "log_level" if main_process else "log_level_replica"
        raise ValueError(
            f"{field}={name!r} is not a log level: use one of {sorted(trainer_log_levels)}"
        ) from None
    return None if level < 0 else level


def use_log_levels(config: AsyncGRPOConfig, main_process: bool | None = None) -> None:
    """Set up this process's asyncgrpo logging for a run of ``config`` (see the module's
    docstring): structlog hands its lines to the standard library (unless the program
    configured structlog itself), the ``"asyncgrpo"`` logger gets the level of
    :func:`process_log_level` and asyncgrpo's stderr handler.

    Args:
        main_process: whether this is the main process (its ``log_level`` applies); None: rank
            0 of torchrun's ``RANK`` (1 process: the main one).
    """
    if main_process is None:
        main_process = launch_rank() == 0
    level = process_log_level(config, main_process)
    with _setup_lock:
        if not structlog.is_configured():
            route_structlog_to_stdlib()
        logger = logging.getLogger(LIBRARY_LOGGER)
        if level is not None:
            logger.setLevel(level)
        elif logger.level == logging.NOTSET:
            logger.setLevel(DEFAULT_MAIN_LEVEL if main_process else DEFAULT_REPLICA_LEVEL)
        _library_handler()
