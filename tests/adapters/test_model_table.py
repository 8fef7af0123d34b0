"""docs/models.md's model table is this test's measurement: every decoder-only family that
transformers ships and vLLM registers, built tiny from its own config, trains exactly on the
path the trainer gives it (the tree, or each sample on its own), or is refused with the
reason; the table lists exactly those families with those paths."""

import functools
import warnings
from pathlib import Path

import pytest
from families import served_families
from model_table import documented_rows, measure

DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"
FAMILIES = served_families()


@functools.cache
def documented() -> dict[str, list[str]]:
    return documented_rows(DOCS.read_text())


def test_the_table_lists_every_served_family() -> None:
    assert sorted(documented()) == sorted(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_is_exact_on_its_path_as_documented(family) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = measure(family, FAMILIES[family])
    assert row.path == "refused" or row.exact, row
    measured = [cell.strip() for cell in row.markdown().strip("|").split("|")]
    # family, class, path, why: as measured; the figures are a dated run's, within tolerance
    assert documented()[family][:4] == measured[:4], "run python benchmarks/model_table.py"
