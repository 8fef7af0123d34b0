"""Rewrite the model table of docs/models.md: every decoder-only family transformers ships and
vLLM registers, built tiny, on the path the trainer gives it, against each sample alone.

    python benchmarks/model_table.py          # about a minute; prints families not exact

``tests/adapters/test_model_table.py`` checks the table against the same measurements.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from families import served_families  # noqa: E402
from model_table import BEGIN, END, measure, table  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")
    rows = [measure(family, name) for family, name in served_families().items()]
    docs = ROOT / "docs" / "models.md"
    text = docs.read_text()
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    docs.write_text(before + table(rows) + after)
    wrong = [row.family for row in rows if not row.exact and row.path != "refused"]
    print(f"{len(rows)} families written to {docs}; not exact: {wrong or 'none'}")


if __name__ == "__main__":
    main()
