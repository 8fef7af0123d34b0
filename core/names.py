"""Names in messages: the hint for a misspelt name (the known name closest to it), and a list
of names as a sentence says it.

>>> did_you_mean("learnig_rate", ["learning_rate", "max_steps"])
" (did you mean 'learning_rate'?)"
>>> did_you_mean("zzz", ["learning_rate"])
''
>>> spoken_list(["disk", "nccl", "asyncgrpo_gloo"])
'disk, nccl or asyncgrpo_gloo'
>>> spoken_list(["disk"])
'disk'
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, known: Iterable[str], cutoff: float = 0.6) -> str:
    """``" (did you mean 'x'?)"`` for the known name closest to ``name`` (dashes read as
    underscores, as on a command line), or ``""`` when none is within ``cutoff`` (difflib's
    similarity ratio, 0 to 1; 0 always names one)."""
    match = difflib.get_close_matches(name.replace("-", "_"), sorted(known), n=1, cutoff=cutoff)
    return f" (did you mean {match[0]!r}?)" if match else ""


def spoken_list(names: Iterable[str]) -> str:
    """``"a, b or c"``: the names in their order, the last after "or" (one name alone)."""
    names = list(names)
    if not names:
        raise ValueError("spoken_list needs at least one name")
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
