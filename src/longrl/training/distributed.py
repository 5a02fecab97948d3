"""Data-parallel GRPO on PyTorch distributed: the process group, the prompt split, the all-reduces, and the
gradient engine (DDP for replicated weights, FSDP2 ``fully_shard`` per decoder layer for full weights).

N ranks take the single-process step on the same global batch:

  prompts     the step's P prompts (drawn from one global stream) are cut in N contiguous blocks
              (:func:`shard`; with several optimizer steps per rollout batch, each step's, :func:`rank_prompts`);
              rank r samples, scores and computes group advantages for its block, so a prompt's G completions
              never leave their rank
  sampling    the sampler keys its random numbers by (seed, global sequence index, position), so a rank
              samples the tokens one process would (``SamplingParams.sequence_ids``; both backends)
  statistics  everything global (loss-weight normalisers, batch reward statistics, the entropy bonus's
              normaliser, metrics) is a sum of per-rank sums: :meth:`World.all_sum` (identity in one process);
              the high-entropy quantile is taken over every rank's entropies (:meth:`World.all_gather_cat`)
  gradients   each rank's loss is its share of the global loss Σ ω ℓ, so the global gradient is the *sum*
              of the ranks' gradients: DDP with a summing communication hook, or FSDP2 with divide factor 1

Process groups come from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT): NCCL on
GPUs, gloo on the CPU, with a configurable timeout so that a rank stuck in a collective ends the job.
NVLink multicast (NVLS) is never enabled: NCCL_NVLS_ENABLE defaults to 0 here unless the environment set it.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models import base_model
from ..models.structure import decoder_layers
from ..models.vision import vision_family, vision_trains

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    """This process's place in the job. ``World()`` is the single process (every reduction the identity)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    comm_device: str = "cpu"  # where collectives' tensors live: cuda:LOCAL_RANK for NCCL, cpu for gloo

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Σ over ranks of ``t`` (summed in float64, returned in t's dtype and device); ``t`` itself in one
        process. The ``reduce`` hook that global statistics (advantages, loss weights) take."""
        if not self.distributed:
            return t
        buf = t.detach().to(self.comm_device, torch.float64, copy=True)
        dist.all_reduce(buf)
        return buf.to(t.device, t.dtype)

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over ranks, in one collective."""
        if not self.distributed or not values:
            return {k: float(v) for k, v in values.items()}
        summed = self.all_sum(torch.tensor([float(v) for v in values.values()], dtype=torch.float64))
        return dict(zip(values, summed.tolist()))

    def max_floats(self, values: dict[str, float]) -> dict[str, float]:
        """Each value's maximum over ranks, in one collective."""
        if not self.distributed or not values:
            return {k: float(v) for k, v in values.items()}
        buf = torch.tensor([float(v) for v in values.values()], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        return dict(zip(values, buf.tolist()))

    def gather_floats(self, value: float) -> list[float]:
        """[world_size] ``value`` of every rank (rank order)."""
        slots = torch.zeros(self.world_size, dtype=torch.float64)
        slots[self.rank] = float(value)
        return self.all_sum(slots).tolist()

    def all_gather_cat(self, t: torch.Tensor) -> torch.Tensor:
        """[Σ_r n_r] the 1-D tensors ``t`` [n_r] of every rank, concatenated in rank order (in t's dtype, on t's
        device; the sizes may differ); ``t`` itself in one process."""
        if not self.distributed:
            return t
        sizes = [int(n) for n in self.gather_floats(t.numel())]
        if max(sizes) == 0:  # nothing on any rank
            return t.reshape(-1)
        buf = torch.zeros(max(sizes), dtype=t.dtype, device=self.comm_device)
        buf[:t.numel()] = t.detach().reshape(-1)
        parts = [torch.empty_like(buf) for _ in sizes]
        dist.all_gather(parts, buf)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)]).to(t.device)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast_text(self, text: str) -> str:
        """Rank 0's ``text`` on every rank (UTF-8 bytes in a tensor: nothing is unpickled)."""
        if not self.distributed:
            return text
        data = torch.tensor(list(text.encode()) if self.is_main else [], dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long, device=self.comm_device)
        dist.broadcast(size, 0)
        buf = torch.zeros(int(size), dtype=torch.uint8, device=self.comm_device)
        if self.is_main:
            buf.copy_(data)
        dist.broadcast(buf, 0)
        return bytes(buf.cpu().tolist()).decode()


SINGLE = World()


def shard(num_items: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous block when ``num_items`` are cut in ``world_size`` blocks whose sizes
    differ by at most one (the first ranks get fewer when the cut is uneven)."""
    return num_items * rank // world_size, num_items * (rank + 1) // world_size


def rank_prompts(prompts_per_step: int, steps: int, rank: int, world_size: int) -> list[int]:
    """Positions, in a rollout batch of ``steps`` optimizer steps of ``prompts_per_step`` prompts (step s owns
    positions [s·P, (s+1)·P)), of the prompts rank ``rank`` samples: its :func:`shard` of every step, in order. Each
    rank then holds the same number of prompts of every step, and a step's rows are a contiguous block of its
    rollout batch, as in one process."""
    first, stop = shard(prompts_per_step, rank, world_size)
    return [s * prompts_per_step + i for s in range(steps) for i in range(first, stop)]


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_world(device: str = "auto", timeout_s: float = 600.0) -> tuple[World, str]:
    """(World, device) of this process. Joins the process group torchrun set up in the environment (or the
    one already initialised); a process outside torchrun is the single process. ``device`` auto becomes
    cuda:LOCAL_RANK on GPUs. The group's timeout bounds every collective: a rank that waits longer on its
    peers raises (NCCL aborts the communicator), so a failed or stuck rank ends the job."""
    if not dist.is_available() or not (dist.is_initialized() or launched_by_torchrun()):
        return SINGLE, device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and device != "cpu" and not device.startswith("cpu")
    if cuda and device in ("auto", "cuda"):
        device = f"cuda:{local_rank}"
    if not dist.is_initialized():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (never enabled by longrl)
        timeout = datetime.timedelta(seconds=timeout_s)
        if cuda:
            torch.cuda.set_device(torch.device(device))
            dist.init_process_group("nccl", timeout=timeout, device_id=torch.device(device))
        else:
            dist.init_process_group("gloo", timeout=timeout)
    backend = dist.get_backend()
    comm = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    world = World(dist.get_rank(), dist.get_world_size(), local_rank, comm)
    if world.is_main:
        log.info("distributed: %d ranks (%s), timeout %.0f s", world.world_size, backend, timeout_s)
    return world, device


def unsupported_with_ranks(cfg, world: World) -> None:
    """ConfigError, before anything loads, for fewer prompts per step than ranks (each rank samples whole groups)."""
    from ..config.errors import ConfigError

    n = world.world_size
    if n > 1 and cfg.train.prompts_per_step < n:
        raise ConfigError(f"config key 'train.prompts_per_step': got {cfg.train.prompts_per_step}; allowed: at least "
                          f"the number of processes ({n}): each samples whole groups")


def shutdown() -> None:
    """Ends this process's group. A finished trainer's DDP/FSDP wrappers (kept by reference cycles) are collected
    first, so the group's C++ objects are freed now, while the interpreter is whole: freed later, during the
    interpreter's finalization, gloo's threads can abort the process (std::terminate) after a run that succeeded."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


# ----------------------------------------------------------------------------------------------- gradients

class LogprobModule(torch.nn.Module):
    """The policy's differentiable forward (``policy.sequence_logprobs``) as a module, so that DDP and FSDP2
    see it: DDP prepares its reducer and FSDP2 its root in ``forward``, and the LM head used outside the
    backbone is part of the wrapped module."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, prompt_ids, completion_ids, width, **kwargs):
        from ..models.policy import sequence_logprobs

        return sequence_logprobs(self.model, prompt_ids, completion_ids, width, **kwargs)


class CrossEntropyModule(torch.nn.Module):
    """The supervised loss's differentiable forward (``policy.token_cross_entropy``: the trained tokens'
    cross-entropy [N]) as a module, for DDP as :class:`LogprobModule` is for GRPO."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, seqs, loss_masks, **kwargs):
        from ..models.policy import token_cross_entropy

        return token_cross_entropy(self.model, seqs, loss_masks, **kwargs)


def _sum_allreduce_hook(process_group, bucket):
    """DDP communication hook: the bucket's gradients summed over ranks (DDP's default divides by N; the loss
    weights here are already normalised over the global step)."""
    group = process_group if process_group is not None else dist.group.WORLD
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def data_parallel(model, world: World, shard_weights: bool, wrapper: torch.nn.Module | None = None) -> torch.nn.Module:
    """The module whose forward the policy update calls: ``wrapper`` (default :class:`LogprobModule`; SFT's
    :class:`CrossEntropyModule`), wrapped for the world.

    One process: the model itself. Replicated weights (LoRA, a 4-bit base): DDP over the trainable
    parameters (the adapters), the frozen base left alone; rank 0's trainable weights are broadcast first.
    ``shard_weights`` (full-weight training): FSDP2 ``fully_shard`` on every decoder layer and on the root,
    float32 gradient reduction for 16-bit weights, parameters kept as DTensor shards between forwards."""
    wrapper = LogprobModule(model) if wrapper is None else wrapper
    if not world.distributed:
        return wrapper
    if shard_weights:
        if not isinstance(wrapper, LogprobModule):
            raise ValueError("FSDP2 sharding is built for the GRPO policy's LogprobModule")
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dtype = next(model.parameters()).dtype
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else None
        kw = {"mp_policy": mp} if mp is not None else {}
        for layer in decoder_layers(model):
            fully_shard(layer, **kw)
        fully_shard(wrapper, **kw)
        for unit in [*decoder_layers(model), wrapper]:  # (per unit: these setters do not recurse)
            unit.set_gradient_divide_factor(1.0)  # a sum: the loss weights are normalised globally
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no pre-multiplied sum)
        with torch.no_grad():  # FSDP2 finds its root at the first forward: through the root, before any rollout
            wrapper([[0]], [[0]], 1, pad_id=0)  # calls the layers on their own
        wrapper.reshard()  # the root keeps its parameters unsharded after a forward: the optimizer needs the shards
        return wrapper
    from torch.nn.parallel import DistributedDataParallel

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                buf = p.data.to(world.comm_device)
                dist.broadcast(buf, 0)
                p.data.copy_(buf)
    device_ids = [torch.device(world.comm_device).index] if world.comm_device.startswith("cuda") else None
    ddp = DistributedDataParallel(wrapper, device_ids=device_ids, init_sync=False, broadcast_buffers=False,
                                  find_unused_parameters=_vision_trains(model))
    ddp.register_comm_hook(None, _sum_allreduce_hook)
    return ddp


def _vision_trains(model) -> bool:
    """Whether a trainable parameter of ``model`` is in a vision-language model's vision tower or projector: a step
    may leave those unused (the tower on a rank whose micro-batches hold no image; a part the model never reads,
    such as LLaVA's post_layernorm with vision_feature_layer=-1), so DDP must find them (it then reduces zeros for
    them) rather than wait for their gradients."""
    family = vision_family(base_model(model).config)
    return family is not None and vision_trains(model, family)


def gradient_sync(policy: torch.nn.Module, last: bool):
    """Context for one micro-batch's forward and backward. DDP: gradients are reduced across ranks only at the
    step's last micro-batch (the others accumulate locally), so ranks may run different numbers of
    micro-batches. FSDP2 reduce-scatters at every micro-batch (gradients stay sharded; every rank runs the same
    number of forwards, see :func:`lockstep`)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(policy, DistributedDataParallel) and not last:
        return policy.no_sync()
    return contextlib.nullcontext()


def lockstep(policy, world: World, micro_batches: list[list[int]]) -> list[tuple[list[int], bool]]:
    """(micro-batch, counts) pairs to run. Under FSDP2 each forward all-gathers the layers' shards, so every rank
    runs as many as the rank with the most: the extra ones repeat the last micro-batch and do not count (their
    loss is multiplied by 0, their log-probs dropped). Otherwise the micro-batches as they are."""
    if not is_sharded(policy):
        return [(idx, True) for idx in micro_batches]
    rounds = int(world.max_floats({"micro_batches": len(micro_batches)})["micro_batches"])
    return [(micro_batches[min(k, len(micro_batches) - 1)], k < len(micro_batches)) for k in range(rounds)]


def is_sharded(policy) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(policy, FSDPModule)


@contextlib.contextmanager
def full_weights(policy):
    """Every sharded module's full parameters in place for the duration (the sampler reads plain tensors):
    unsharded once, resharded after; forwards inside do not reshard. A no-op for unsharded policies."""
    if not is_sharded(policy):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in policy.modules() if isinstance(m, FSDPModule)]
    layers = [m for m in modules if m is not policy]  # the root's forward is not called by the sampler
    for m in layers:
        m.set_reshard_after_forward(False, recurse=False)
    for m in modules:
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
        for m in layers:
            m.set_reshard_after_forward(True, recurse=False)


def grad_norm_value(norm: torch.Tensor) -> float:
    """A ``clip_grad_norm_`` result as a float (under FSDP2 a DTensor: its full value)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


# ----------------------------------------------------------------------------------------------- checkpoints
# Full weights under FSDP2: checkpoint-STEP holds the full model (model.safetensors, gathered on rank 0, read by
# `longrl export` as any checkpoint) and the optimizer as DCP shards (optimizer/), which torch.distributed.checkpoint
# reshards on load for any number of processes (one included).

def has_dtensor_parameters(model) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_model_state(model) -> dict:
    """The full weights on rank 0 (CPU tensors; empty on the other ranks). Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded_optimizer(model, optimizer, directory) -> None:
    """Every rank writes its shards of the optimizer state to ``directory`` (DCP); rank 0 writes the metadata
    once every rank's part is written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=str(directory))


def load_sharded_optimizer(directory, model, optimizer) -> None:
    """The optimizer state from DCP shards, resharded for this job's ranks (one process: read whole)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)  # the template: state tensors of this job's shapes
    dcp.load(state, checkpoint_id=str(directory))
    set_optimizer_state_dict(model, optimizer, state)


def load_full_weights(model, weights: dict) -> None:
    """Full weights (every rank holds them) into a sharded model: each rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))


def load_full_optimizer(saved: dict, model, optimizer) -> None:
    """A one-process ``optimizer.state_dict()`` (parameters by position: the trainer's optimizer holds the
    model's trainable parameters in order) into the optimizer of a sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    full = {"state": {names[i]: s for i, s in saved["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))
