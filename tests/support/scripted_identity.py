"""A fake client (named so) of one server whose identity readings are scripted: what a real
server cannot be made to answer on cue (a reading that fails, then one that changes)."""

from __future__ import annotations

from collections.abc import Iterator


class ScriptedIdentity:
    """A client of one server whose identity readings are, in turn, ``answers`` (an exception
    is raised)."""

    def __init__(self, answers: Iterator[float | Exception]) -> None:
        self.answers = answers

    async def __aenter__(self) -> ScriptedIdentity:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def server_identity(self) -> float | None:
        answer = next(self.answers)
        if isinstance(answer, Exception):
            raise answer
        return answer
