"""Each rank of a torchrun gloo group asks :func:`decided_on_rank0` three things and writes
what it got to ``<out>/rank-<rank>.json`` (see tests/distributed/test_rank0_decides.py):
a value every rank would decide differently (its own rank), a refusal rank 0 raises (a
``ValueError`` every rank must raise), and a decision that is itself an exception object."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from asyncgrpo.adapters.process_group import decided_on_rank0, destroy_process_groups


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    got: dict[str, object] = {"value": decided_on_rank0(lambda: {"rank": rank})}

    def refuse() -> int:
        raise ValueError(f"weight_transfer_backend: rank {rank} refuses")

    try:
        decided_on_rank0(refuse, refusals=(ValueError,))
        got["refusal"] = None
    except ValueError as error:
        got["refusal"] = str(error)
    decision = decided_on_rank0(lambda: ValueError(f"a decision made on rank {rank}"))
    got["exception_as_value"] = f"{type(decision).__name__}: {decision}"
    (out / f"rank-{rank}.json").write_text(json.dumps(got))
    destroy_process_groups()


if __name__ == "__main__":
    main()
