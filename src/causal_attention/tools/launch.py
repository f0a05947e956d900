"""The distributed demo's launcher: one process per rank under torchrun, and what the training
loop needs to know about its strategy (ddp, fsdp, tp)."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..integrations.parallel import full_state_dict, fully_shard_gpt, local_batch, parallelize_gpt

Strategy = Literal["ddp", "fsdp", "tp"]
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp", "tp")


@dataclass(frozen=True)
class Run:
    """One process of a distributed training run: how the model is wrapped and the batch split.

    ``ddp`` and ``fsdp`` split each batch over the ranks (each loss term is divided by the whole
    batch's count and multiplied by the world size, so the averaged gradient is the whole batch's);
    ``tp`` feeds every rank the whole batch and shards the model's heads and MLP.
    """

    strategy: Strategy
    rank: int
    world_size: int
    mesh: DeviceMesh

    @property
    def data_parallel(self) -> bool:
        return self.strategy in ("ddp", "fsdp")

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as this strategy trains it (DDP, fully_shard_gpt, or parallelize_gpt)."""
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model)
        if self.strategy == "fsdp":
            return fully_shard_gpt(model, mesh=self.mesh)
        return parallelize_gpt(model, self.mesh)

    def local_batch(self, *tensors: Tensor) -> list[Tensor]:
        """This rank's rows of (B, ...) tensors (all of them under tensor parallel)."""
        return local_batch(tensors, self.rank, self.world_size) if self.data_parallel else list(tensors)

    @property
    def loss_scale(self) -> int:
        """What a loss normalised by the whole batch is multiplied by (gradients are averaged)."""
        return self.world_size if self.data_parallel else 1

    def global_sum(self, value: float) -> float:
        """value summed over the ranks of a data-parallel run (as is under tensor parallel)."""
        if not self.data_parallel:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return float(t[0])

    def gather(self, model: nn.Module, like: nn.Module) -> nn.Module | None:
        """The trained weights in ``like`` (an unsharded model of the same configuration) on rank 0,
        None on the other ranks (collective: every rank calls it)."""
        inner = model.module if self.strategy == "ddp" else model
        state = full_state_dict(inner)
        if self.rank != 0:
            return None
        like.load_state_dict(state)
        return like


def start(strategy: str) -> Run:
    """Joins the process group that ``torchrun`` (or ``python -m torch.distributed.run``) set up
    (gloo: CPU tensors), with a 1-D mesh over all ranks."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise RuntimeError(f"--distributed {strategy} runs under torchrun (missing environment: "
                               f"{', '.join(missing)}); e.g. torchrun --nproc-per-node 2 -m causal_attention demo "
                               f"--distributed {strategy}")
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    return Run(strategy, dist.get_rank(), world, mesh)  # type: ignore[arg-type]


def finish(*, ok: bool = True) -> None:
    """Ends this process's part in a run: a garbage collection (the wrapped models the caller no
    longer holds), then (``ok``: every rank got here) a wait for the other ranks, and the process
    group destroyed.

    FSDP2's modules are reference cycles, so they outlive the function that trained them until
    a garbage collection, possibly the interpreter's shutdown. Destroyed there, they and the gloo
    work they hold can abort the process ("terminate called without an active exception", seen
    once in CI after a run that had written all its files). Collecting them here, while the
    group and the interpreter are alive, leaves nothing for shutdown. Not ``ok`` (an exception):
    no barrier, a peer may be gone.
    """
    import torch.distributed as dist

    gc.collect()
    try:
        if ok:
            dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()
        gc.collect()
