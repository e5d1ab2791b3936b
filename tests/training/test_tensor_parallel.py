"""Tensor parallelism inside a cluster (issue 53, item 1): a model split over 2 and 4 ranks
(gloo, as on a CPU-only cluster; NCCL takes the same code) trains as the unsplit model does,
step for step: the loss to 1e-5 relative, the parameters gathered at the end alike."""

from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from training.worker import free_port

pytestmark = pytest.mark.slow

VOCAB, CTX, STEPS = 50, 16, 5


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, VOCAB, (8, CTX), generator=g),
            torch.randint(0, VOCAB, (8, CTX), generator=g),
        )
        for _ in range(STEPS)
    ]


def _train(model: torch.nn.Module) -> list[float]:
    # SGD: Adam divides a gradient that is zero in exact arithmetic (a key's bias: softmax
    # ignores what shifts every score alike) by its own rounding noise, so two exact runs
    # move that bias by +-lr in noise-chosen directions
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in _batches():
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _model() -> Any:
    from training.tensor_parallel import Transformer

    torch.manual_seed(3)
    return Transformer(VOCAB, CTX, dim=32, layers=2, heads=4)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from training.tensor_parallel import full_state, tensor_parallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    model = tensor_parallel(_model(), init_device_mesh("cpu", (world,)))
    q: Any = model.get_parameter("blocks.0.attn.q.weight")  # a DTensor, split by rows
    local_rows = q.to_local().shape[0]
    losses = _train(model)
    state = full_state(model)
    dist.destroy_process_group()
    torch.save({"losses": losses, "state": state, "rows": local_rows}, Path(out) / f"r{rank}.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_a_split_model_trains_as_the_whole_one(tmp_path: Path, world: int) -> None:
    torch.set_num_threads(1)
    whole = _model()
    want = _train(whole)
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0
    got = [torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in range(world)]
    assert {g["rows"] for g in got} == {32 // world}  # each rank holds its heads' rows only
    for g in got:
        assert g["losses"] == pytest.approx(want, rel=1e-5)
    for name, value in whole.state_dict().items():
        if name in got[0]["state"]:
            torch.testing.assert_close(got[0]["state"][name], value, rtol=1e-5, atol=1e-6)


def test_heads_that_do_not_split_are_refused() -> None:
    from training.tensor_parallel import tensor_parallel

    class Mesh:
        def size(self) -> int:
            return 3

    with pytest.raises(ValueError, match="4 heads do not split over 3 GPUs"):
        tensor_parallel(_model(), Mesh())
