"""Several processes, one run: torch.distributed's own DDP and FSDP2 (``fully_shard``) under ``torchrun``.

How the trainer divides the work (docs/distributed.md has the commands):

- Every rank draws the same global batch of prompts (one sampler, one seed) and keeps its contiguous share, so each
  group lives whole on one rank. Sampling seeds depend on the step and the global prompt chunk, not on the rank, so
  the completions do not depend on the number of processes (given the same ``generation_prompts``).
- Rewards are all-gathered: advantages (group or batch scaling) and the logged rewards are computed on the global
  batch, identically on every rank, and each rank keeps its rows.
- The loss of each rank is its part of the global loss (token and row counts all-reduced, so
  ``num_items_in_batch`` is the global token count), times the world size because DDP and FSDP2 average gradients.
- Everything that touches the weights runs inside the forward of one wrapper module (:class:`PolicyForward`), so
  DDP prepares its gradient reduction and FSDP2 gathers the sharded parameters (the lm_head weight included, tied
  embeddings too) before the fused loss reads them. Gradient accumulation synchronises on the last micro-batch only.
- A non-finite value anywhere makes every rank's gradient non-finite (it is all-reduced), so all ranks skip the
  same update.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger("grpo_fast.train")

STRATEGIES = ("ddp", "fsdp2")


@dataclass(frozen=True)
class World:
    """This process's place in the run; ``size == 1`` for a plain single-process run."""

    rank: int = 0
    size: int = 1
    strategy: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init(strategy: str, device: torch.device) -> World:
    """Joins the process group that ``torchrun`` describes in the environment (``WORLD_SIZE`` > 1); a plain run
    gets a one-process :class:`World`. NCCL on CUDA, gloo on CPU."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if strategy not in STRATEGIES:
        raise ValueError(f"TrainConfig.distributed must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = World(rank=dist.get_rank(), size=dist.get_world_size(), strategy=strategy)
    logger.info("distributed: rank %d of %d, %s, backend %s", world.rank, world.size, strategy, dist.get_backend())
    return world


def local_device(device: torch.device) -> torch.device:
    """Under torchrun each process takes the GPU of its ``LOCAL_RANK``."""
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        index = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return device


def shard(items: list, world: World) -> list:
    """This rank's contiguous share of ``items`` (whose length the caller checked to be a multiple of the size)."""
    n = len(items) // world.size
    return items[world.rank * n : (world.rank + 1) * n]


def sum_across(values: list[float], world: World, device: torch.device) -> list[float]:
    """Element-wise sum over the ranks (the values themselves in a one-process run)."""
    if not world.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def gather_rows(x: torch.Tensor, world: World) -> torch.Tensor:
    """``x`` of every rank, concatenated along dim 0 in rank order (all ranks hold equal shapes)."""
    if not world.distributed:
        return x
    parts = [torch.empty_like(x) for _ in range(world.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def all_true(flag: bool, world: World, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank."""
    return sum_across([0.0 if flag else 1.0], world, device)[0] == 0.0


class PolicyForward(torch.nn.Module):
    """Runs ``fn(model, *args)`` inside its own forward: what DDP and FSDP2 need to see of a training or log-prob
    pass (DDP prepares gradient reduction in forward; FSDP2 gathers the root's parameters, such as the lm_head and
    the embeddings, around forward and reduce-scatters their gradients in backward)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def inner_model(policy) -> torch.nn.Module:
    """The model inside :func:`wrap`'s result (DDP keeps the wrapper as ``.module``)."""
    return getattr(policy, "module", policy).model


def wrap(model: torch.nn.Module, world: World, device: torch.device, trainable: bool = True):
    """The module the trainer calls: ``PolicyForward(model)``, under DDP or FSDP2 in a distributed run.

    FSDP2 shards each decoder layer, then the root (embeddings, final norm, lm_head: a tied lm_head stays one
    parameter in the root's group). A frozen model (the reference) is sharded the same way; DDP leaves it as is.
    """
    policy = PolicyForward(model)
    if not world.distributed:
        return policy
    if world.strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        from grpo_fast.train.forward import decoder_of

        for layer in decoder_of(model).layers:
            fully_shard(layer)
        fully_shard(policy)
        return policy
    if not trainable:
        return policy
    from torch.nn.parallel import DistributedDataParallel

    # the buffers (rotary frequencies) never change: no broadcast before every forward
    return DistributedDataParallel(policy, device_ids=[device.index] if device.type == "cuda" else None,
                                   broadcast_buffers=False)


@contextlib.contextmanager
def gradient_sync(policy, sync: bool):
    """Gradient accumulation: reduce gradients only on the micro-batch whose backward has ``sync`` True."""
    if sync:
        yield
    elif hasattr(policy, "no_sync"):  # DDP
        with policy.no_sync():
            yield
    elif hasattr(policy, "set_requires_gradient_sync"):  # FSDP2
        policy.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            policy.set_requires_gradient_sync(True)
    else:
        yield


def grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Clips the global gradient norm (sharded DTensor gradients included); returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def shutdown(world: World) -> None:
    """Leaves the process group once every rank is done. Call it after the DDP/FSDP2 modules are gone: a wrapper
    that outlives its process group can abort the process when it is destroyed at exit."""
    if world.distributed and dist.is_initialized():
        import gc

        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


@torch.no_grad()
def check_replicas(model: torch.nn.Module, world: World) -> None:
    """DDP keeps one replica per rank; raises if they have drifted apart (compared by a float64 checksum of every
    parameter, all-gathered)."""
    if not world.distributed or world.strategy != "ddp":
        return
    local = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for p in model.parameters():  # one float64 copy at a time, not the whole model's
        x = p.detach().double()
        local += torch.stack([x.sum(), (x * x).sum()])
    every = gather_rows(local[None], world)
    if not torch.equal(every, every[:1].expand_as(every)):
        raise RuntimeError(f"distributed: the DDP replicas differ across ranks (parameter checksums "
                           f"{every.tolist()}); the run is no longer one model")
    logger.info("distributed: parameters identical on all %d ranks (checksum %.17g)", world.size, float(local[0]))
