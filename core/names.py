"""The hint for a misspelt name: the known name closest to it.

>>> did_you_mean("learnig_rate", ["learning_rate", "max_steps"])
" (did you mean 'learning_rate'?)"
>>> did_you_mean("zzz", ["learning_rate"])
''
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
