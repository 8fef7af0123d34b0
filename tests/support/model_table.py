"""The model table of docs/models.md: each family's tiny model (:mod:`families`) on the path
the trainer gives it, against each sample forwarded alone.

:func:`measure` builds a family, takes the path ``training_path`` gives it the way the learner
does (dropout off, tree attention on the tree), and returns the
largest differences over one row of four samples with shared prefixes, longer than the window
and the chunk. :func:`table` writes the rows as markdown; ``python benchmarks/model_table.py``
rewrites the table in docs/models.md and ``tests/adapters/test_model_table.py`` checks it.
"""

import copy
import functools
from dataclasses import dataclass

import numpy as np
import torch
from families import tiny_text_config
from packing_strategies import make_sample
from transformers import AutoModelForCausalLM

from asyncgrpo.adapters.kernels.architecture_support import (
    UnsupportedArchitectureError,
    training_path,
)
from asyncgrpo.adapters.kernels.attention import enable_tree_attention
from asyncgrpo.adapters.kernels.packed_forward import packed_log_probs
from asyncgrpo.adapters.kernels.per_sample_forward import per_sample_log_probs
from asyncgrpo.adapters.models.causal_lm import disable_dropout
from asyncgrpo.core.packing.tree import pack_row

LOGP_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 5e-5  # per parameter, relative to its norm (floored as below)
GRADIENT_NORM_FLOOR = 1e-2  # of the largest parameter gradient norm
BEGIN = "<!-- model table: written by benchmarks/model_table.py -->"
END = "<!-- end of model table -->"

ROW = pack_row(
    [
        make_sample(range(3, 14), [0] * 5 + [1] * 6),
        make_sample([*range(3, 9), 17, 18, 19, 20, 21, 22, 23, 24], [0] * 5 + [1] * 9),
        make_sample([*range(3, 9), 17, 18, 30, 31], [0] * 5 + [1] * 5),
        make_sample([3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 0] + [1] * 7),
    ]
)


@dataclass(frozen=True)
class Measured:
    """One family's row: its class, path, why not the tree, and the largest differences
    (log-prob absolute, gradient relative); ``noise``: the model's own log-prob difference
    between eager attention and SDPA, measured when the path's exceeds the tolerance."""

    family: str
    model_class: str
    path: str
    why: str
    dlogp: float
    grad: float
    noise: float = 0.0

    @property
    def exact(self) -> bool:
        """Within the tolerances, or within twice the model's own rounding."""
        return self.dlogp <= max(LOGP_TOLERANCE, 2 * self.noise) and self.grad <= (
            GRADIENT_TOLERANCE
        )

    def markdown(self) -> str:
        figures = ("", "") if self.path == "refused" else (f"{self.dlogp:.1e}", f"{self.grad:.1e}")
        return (
            f"| {self.family} | `{self.model_class}` | {self.path} | {self.why} | "
            f"{figures[0]} | {figures[1]} |"
        )


def reference_log_probs(model, samples, targets):
    """float [N]: each sample forwarded alone, the log-probs of its trained tokens."""
    logits = [torch.zeros(0, model.config.get_text_config().vocab_size)]
    for sample in samples:
        positions = torch.from_numpy(np.flatnonzero(sample.sequence.trained_mask))
        if len(positions):
            ids = torch.tensor(sample.sequence.input_ids)[None]
            logits.append(model(input_ids=ids, use_cache=False).logits[0, positions - 1])
    return torch.log_softmax(torch.cat(logits), -1).gather(-1, targets[:, None])[:, 0]


def gradients(model) -> list[torch.Tensor]:
    """Each parameter's gradient (zeros where none), cleared from the model."""
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def differences(tested, stock, forward, row, seed: int = 0) -> tuple[float, float]:
    """(largest |log-prob difference|, largest per-parameter gradient difference relative to
    that parameter's gradient norm) between ``forward(tested, row)`` and each of ``row``'s
    samples forwarded alone by ``stock`` (a copy of the same weights), for a random weighting
    of the trained tokens. A parameter's norm counts at least :data:`GRADIENT_NORM_FLOOR` of
    the largest: a gradient that small is a sum that mostly cancels."""
    targets = torch.tensor(row.target_ids)
    weights = torch.randn(len(targets), generator=torch.Generator().manual_seed(seed))
    got = forward(tested, row)
    (got.logp * weights.to(got.logp.dtype)).sum().backward()
    want = reference_log_probs(stock, row.samples, targets)
    (want * weights.to(want.dtype)).sum().backward()
    got_grads, want_grads = gradients(tested), gradients(stock)
    largest = max(max(w.norm() for w in want_grads), torch.finfo(torch.float32).tiny)
    grad = max(
        ((g - w).norm() / max(w.norm(), GRADIENT_NORM_FLOOR * largest)).item()
        for g, w in zip(got_grads, want_grads, strict=True)
    )
    return (got.logp - want).abs().max().item(), grad


def measure(family: str, model_class: str) -> Measured:
    """``family``'s row of the table (see the module docstring)."""
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(tiny_text_config(family), attn_implementation="eager")
    for module in stock.modules():  # sinks of order 1, so that they matter
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.sinks, std=1.0)
    try:
        path = training_path(stock)
    except UnsupportedArchitectureError as error:
        return Measured(family, model_class, "refused", _short(str(error).split("\n")[1]), 0, 0)
    disable_dropout(stock)
    tested = copy.deepcopy(stock)
    if path.kind == "tree":
        enable_tree_attention(tested)

        def forward(model, row):
            return packed_log_probs(model, row, 1.0, backend="segments")

    else:
        forward = functools.partial(per_sample_log_probs, temperature=1.0)
    dlogp, grad = differences(tested, stock, forward, ROW)
    why = _short(path.reasons[0]) if path.reasons else ""
    noise = _own_rounding(stock, torch.tensor(ROW.target_ids)) if dlogp > LOGP_TOLERANCE else 0.0
    return Measured(family, model_class, path.kind, why, dlogp, grad, noise)


def _own_rounding(model, targets) -> float:
    """The model's own largest log-prob difference between eager attention and SDPA on the
    row's samples alone (no packing involved)."""
    sdpa = copy.deepcopy(model)
    sdpa.config._attn_implementation = "sdpa"
    with torch.no_grad():
        eager = reference_log_probs(model, ROW.samples, targets)
        return (reference_log_probs(sdpa, ROW.samples, targets) - eager).abs().max().item()


def _short(reason: str) -> str:
    """The part of a reason before its explanation, for a table cell."""
    return reason.strip().split(": ")[0].replace("|", "/")


def table(rows: list[Measured]) -> str:
    """The markdown table of ``rows``, between the markers docs/models.md keeps it in."""
    header = [
        "| family | class | path | why not the tree | largest dlogp | largest grad rel |",
        "|---|---|---|---|---|---|",
    ]
    return "\n".join([BEGIN, *header, *(row.markdown() for row in rows), END])


def documented_rows(text: str) -> dict[str, list[str]]:
    """``{family: cells}`` of the table in ``text`` (docs/models.md)."""
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = [line.strip("|").split("|") for line in block.strip().splitlines()[2:]]
    return {cells[0].strip(): [cell.strip() for cell in cells] for cells in rows}
