"""The layer on torch.distributed: head-aligned tensor parallel for the fused qkv, DTensor sharding
rules for the engine's ops, and DCP checkpoints that survive resharding.

DDP and FSDP2 (``fully_shard``) need nothing from here: the layer's parameters are plain Linears
and its ops have autograd. Tensor parallel does, because ``qkv`` is one Linear whose output rows
are ``[q | k | v]``: cutting those rows contiguously (``ColwiseParallel``) gives rank 0 all of q
and half of k, which is wrong (pytorch/pytorch#140069). Here rank r of a mesh of W holds the q, k
and v rows of heads ``r*H/W .. (r+1)*H/W - 1``, i.e. rows ``[q_r | k_r | v_r]``: the DTensor
placement ``_StridedShard(0, split_factor=3)``, whose global view (``full_tensor()``,
``state_dict()``) is the ordinary ``[q | k | v]`` layout.

    mesh = init_device_mesh("cpu", (world_size,))
    parallelize_gpt(model, mesh)           # every block: attention by heads, MLP col/row
    save_checkpoint(model, "ckpt")          # DCP; loads into any other layout (or none)

Shapes: B batch, T tokens, H heads, hd head_dim, dim = H * hd, W = tensor-parallel ranks.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from ..attention import _ops
from ..attention.module import CausalSelfAttention

QKV_PARTS = 3  # the fused projection's output: [q | k | v]


def head_placement(dim: int) -> _StridedShard:
    """The placement of a qkv tensor sharded by heads along ``dim`` (its 3 * dim axis): each rank
    holds its heads' slice of q, of k and of v, concatenated."""
    return _StridedShard(dim, split_factor=QKV_PARTS)


def _is_head_sharded(placement: Placement, dim: int) -> bool:
    return isinstance(placement, _StridedShard) and placement.dim == dim and placement.split_factor == QKV_PARTS


# --------------------------------------------------------------------------------------------
# Sharding rules for torch.ops.causal_attention.attention_forward / attention_backward


class ShardingError(ValueError):
    """A DTensor layout the engine's ops refuse (rather than compute wrong)."""


def _check_no_dropout(dropout_p: float) -> None:
    if dropout_p > 0:
        raise ShardingError(
            f"causal_attention: dropout_p={dropout_p} with DTensor inputs is not supported: the engine's keep "
            "decisions are indexed by the local (batch, head) of each shard, so shards would repeat each other's "
            "dropout pattern; use dropout_p=0 or plain tensors"
        )


def _heads_can_shard(qkv: Any, n_heads: int, n_kv_heads: int | None) -> bool:
    """Head sharding is offered on a 1-D mesh whose size divides n_heads (every rank whole heads), for
    multi-head attention (grouped key/value heads are replicated or batch-sharded)."""
    mesh = qkv.mesh
    return n_kv_heads is None and mesh.ndim == 1 and n_heads % mesh.size(0) == 0


def _forward_sharding(
    qkv: Any, mask: Any, n_heads: int, dropout_p: float = 0.0, seed: Any = None, n_kv_heads: int | None = None
) -> list[tuple[list[Placement | None], list[Placement | None]]]:
    """attention_forward(qkv (B, T, 3*dim), mask (B, T)?, n_heads, dropout_p, seed?, n_kv_heads?) -> out
    (B, T, dim), lse (B, H, T): replicated, sharded on the batch, or sharded on heads (qkv head-aligned,
    mask replicated; out then holds the rank's heads' columns, lse its heads). n_kv_heads is given by
    position or not at all (_ops), so that the placements line up with the arguments."""
    _check_no_dropout(dropout_p)
    R = Replicate()
    kv = [] if n_kv_heads is None else [None]

    def opt(arg: Any, placement: Placement) -> Placement | None:
        return None if arg is None else placement

    rules = [
        ([R, R], [R, opt(mask, R), None, None, opt(seed, R), *kv]),
        ([Shard(0), Shard(0)], [Shard(0), opt(mask, Shard(0)), None, None, opt(seed, R), *kv]),
    ]
    if _heads_can_shard(qkv, n_heads, n_kv_heads):
        rules.append(([Shard(2), Shard(1)], [head_placement(2), opt(mask, R), None, None, opt(seed, R)]))
    return rules


def _backward_sharding(
    grad_out: Any, qkv: Any, mask: Any, out: Any, lse: Any, n_heads: int, dropout_p: float = 0.0, seed: Any = None,
    n_kv_heads: int | None = None,
) -> list[tuple[list[Placement | None], list[Placement | None]]]:
    """attention_backward(grad_out, qkv, mask?, out, lse, n_heads, dropout_p, seed?, n_kv_heads?) ->
    grad_qkv, with the forward's layouts."""
    _check_no_dropout(dropout_p)
    R = Replicate()
    kv = [] if n_kv_heads is None else [None]

    def opt(arg: Any, placement: Placement) -> Placement | None:
        return None if arg is None else placement

    S0 = Shard(0)
    rules = [
        ([R], [R, R, opt(mask, R), R, R, None, None, opt(seed, R), *kv]),
        ([S0], [S0, S0, opt(mask, S0), S0, S0, None, None, opt(seed, R), *kv]),
    ]
    if _heads_can_shard(qkv, n_heads, n_kv_heads):
        heads = head_placement(2)
        rules.append(([heads], [Shard(2), heads, opt(mask, R), Shard(2), Shard(1), None, None, opt(seed, R)]))
    return rules


def _local_heads(qkv_index: int, n_heads_index: int, input_specs: list[Any], schema: Any) -> Any:
    """The op's n_heads argument, rewritten to the heads of one shard when qkv is head-sharded (the
    local kernel sees 3 * dim / W columns); unchanged for batch sharding."""
    from torch.distributed.tensor._op_schema import OpSchema

    spec = input_specs[qkv_index]
    shards = 1
    for mesh_dim, placement in enumerate(spec.placements):
        if _is_head_sharded(placement, 2):
            shards *= spec.mesh.size(mesh_dim)
    args = list(schema.args_schema)
    if shards > 1:
        args[n_heads_index] = args[n_heads_index] // shards
    return OpSchema(schema.op, tuple(args), schema.kwargs_schema)


@functools.cache
def register_sharding_rules() -> bool:
    """Registers the engine ops' DTensor sharding rules (once); False when the engine is not loaded.

    Called on import of this module. Batch-sharded (``Shard(0)``) and head-sharded
    (``head_placement(2)`` on a 1-D mesh dividing n_heads) inputs run locally; anything else is
    redistributed by DTensor to one of these (or to replicated), never computed in place.
    """
    if not _ops.core_loaded():
        return False
    from torch.distributed.tensor.experimental import register_sharding

    forward = torch.ops.causal_attention.attention_forward.default
    backward = torch.ops.causal_attention.attention_backward.default
    register_sharding(forward)(_forward_sharding)
    register_sharding(backward)(_backward_sharding)
    # The local kernel must be told its own number of heads: DTensor's sharding propagator rewrites
    # scalar shape arguments through this table (as it does for group_norm's N, C, HxW).
    adjusters = DTensor._op_dispatcher.sharding_propagator.op_to_scalar_shape_adjuster
    adjusters[forward] = functools.partial(_local_heads, 0, 2)
    adjusters[backward] = functools.partial(_local_heads, 1, 5)
    return True


# --------------------------------------------------------------------------------------------
# Tensor parallel: the layer and the GPT


class _HeadAlignedColwise(ColwiseParallel):
    """ColwiseParallel for the fused qkv: weight and bias sharded by heads (``[q_r | k_r | v_r]``),
    output handed on as the local (..., 3 * dim / W) tensor of the rank's heads."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters():
            sharded = distribute_tensor(param, device_mesh, [head_placement(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(  # type: ignore[override]
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: DTensor, device_mesh: DeviceMesh
    ) -> Tensor:
        expected = head_placement(outputs.ndim - 1)
        if tuple(outputs.placements) != (expected,):
            raise RuntimeError(f"qkv under head-aligned tensor parallel: expected output placement {expected}; "
                               f"got {outputs.placements}")
        return outputs.to_local()  # (..., 3 * dim / W): the rank's heads, [q_r | k_r | v_r]


def _check_mesh(tp_mesh: object) -> DeviceMesh:
    if not isinstance(tp_mesh, DeviceMesh):
        raise TypeError(f"tp_mesh must be a DeviceMesh; got {type(tp_mesh).__name__}")
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D (the tensor-parallel ranks); got a {tp_mesh.ndim}-D mesh")
    return tp_mesh


def parallelize_attention(module: CausalSelfAttention, tp_mesh: DeviceMesh) -> CausalSelfAttention:
    """Shards a CausalSelfAttention by heads over ``tp_mesh`` (1-D, W ranks), in place.

    Rank r keeps the q, k and v rows of heads ``r*H/W .. (r+1)*H/W - 1`` of ``qkv`` (a DTensor
    placed ``_StridedShard(0, split_factor=3)``: its global view is the usual [q | k | v]) and the
    matching columns of ``proj`` (row-wise parallel: one all-reduce of the output). The input
    x (B, T, dim) is replicated; the engine runs the rank's H/W heads on local tensors, so
    ``module.n_heads`` becomes H/W (the heads of this rank, as a KV cache of this rank needs);
    the output (B, T, dim) is replicated. Every rank must pass the same x and mask.

    Raises ValueError when W does not divide n_heads, for attention dropout (each rank would draw
    the same keep decisions for its local heads), and for grouped-query layers (n_kv_heads below
    n_heads): their qkv rows [q | k | v] have parts of unequal width, and no DTensor placement of the
    one weight gives each rank its heads' rows of all three (shard those with FSDP2 or DDP).
    """
    if not isinstance(module, CausalSelfAttention):
        raise TypeError(f"module must be a CausalSelfAttention; got {type(module).__name__}")
    mesh = _check_mesh(tp_mesh)
    if isinstance(module.qkv.weight, DTensor):
        raise ValueError("module is already distributed (qkv.weight is a DTensor)")
    world = mesh.size(0)
    if module.n_heads % world != 0:
        raise ValueError(
            f"parallelize_attention: n_heads (got {module.n_heads}) must be divisible by the tensor-parallel "
            f"mesh size (got {world}): each rank holds whole heads"
        )
    if module.dropout > 0:
        raise ValueError(
            f"parallelize_attention: attention dropout (got {module.dropout}) is not supported under tensor "
            "parallel: every rank would draw the same keep decisions for its local heads"
        )
    if module.kv_heads != module.n_heads:
        raise ValueError(
            f"parallelize_attention: grouped-query attention (n_kv_heads={module.n_kv_heads}, "
            f"n_heads={module.n_heads}) is not supported under tensor parallel: the fused qkv's parts q | k | v "
            "differ in width, and no DTensor placement of one weight gives each rank its heads' rows of all three; "
            "use FSDP2 or DDP for this layer"
        )
    parallelize_module(module, mesh, {"qkv": _HeadAlignedColwise(), "proj": RowwiseParallel()})
    module.n_heads = module.n_heads // world
    if module.n_kv_heads is not None:  # (= n_heads: multi-head, its parts of equal width)
        module.n_kv_heads = module.n_heads
    return module


def parallelize_gpt(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Tensor parallel for every block of a GPT (gpt.py), in place: the attention by heads
    (parallelize_attention), the MLP column-wise then row-wise (``mlp.0`` ColwiseParallel,
    ``mlp.2`` RowwiseParallel: one all-reduce). Embeddings, LayerNorms and the head stay
    replicated plain tensors, so every rank must feed the same batch and use the same seed."""
    from ..models.gpt import GPT

    if not isinstance(model, GPT):
        raise TypeError(f"model must be a GPT; got {type(model).__name__}")
    if model.config.llama_options:  # (rotary blocks keep their head counts; the gated MLP has other names)
        raise ValueError(f"parallelize_gpt shards GPT-2-architecture models; this one sets the Llama family's "
                         f"{model.config.llama_options}, which it does not shard yet")
    mesh = _check_mesh(tp_mesh)
    if model.config.hidden % mesh.size(0) != 0:
        raise ValueError(f"parallelize_gpt: the MLP width (got {model.config.hidden}) must be divisible by the "
                         f"tensor-parallel mesh size (got {mesh.size(0)})")
    for block in model.blocks:
        parallelize_attention(block.attn, mesh)
        parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def fully_shard_gpt(model: nn.Module, **fsdp_options: Any) -> nn.Module:
    """FSDP2 for a GPT, in place: ``fully_shard`` on every block and on the root (options passed on,
    e.g. ``mesh``). Blocks also get their packed forward (``forward_packed``, taken for padded
    batches) registered, and the root its ``generate``, so that FSDP2 gathers their parameters for
    them too."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from ..models.gpt import GPT

    if not isinstance(model, GPT):
        raise TypeError(f"model must be a GPT; got {type(model).__name__}")
    for block in model.blocks:
        fully_shard(block, **fsdp_options)
        register_fsdp_forward_method(block, "forward_packed")
    fully_shard(model, **fsdp_options)
    # generate() reaches the root's parameters (embeddings, final LayerNorm, head) without calling
    # forward, whose hook would gather them.
    register_fsdp_forward_method(model, "generate")
    return model


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float) -> Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm) for a model whose parameters mix DTensors (the
    sharded ones, their norm reduced over the mesh) and plain tensors (replicated on every rank,
    as parallelize_gpt leaves the embeddings and LayerNorms). Returns the total norm."""
    from torch.nn.utils import get_total_norm

    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    squares = []
    for group in (sharded, plain):
        if group:
            norm = get_total_norm(group, 2.0)
            squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    if not squares:
        return torch.tensor(0.0)
    total = torch.stack(squares).sum().sqrt()
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


# --------------------------------------------------------------------------------------------
# DCP checkpoints


def _dcp_entry(value: Tensor) -> Tensor:
    """A state_dict value as DCP can save and load it. A head-sharded DTensor's local rows are
    three separate chunks of the global tensor (q_r, k_r, v_r), which DCP's one-chunk-per-rank
    description of a DTensor gets wrong (it reports overlapping chunks): hand DCP the three chunks,
    as views of the local tensor (loading writes through them)."""
    if not isinstance(value, DTensor) or not any(isinstance(p, _StridedShard) for p in value.placements):
        return value
    if value.device_mesh.ndim != 1 or not _is_head_sharded(value.placements[0], 0):
        raise NotImplementedError(f"checkpointing a DTensor placed {value.placements} is not supported")
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    local = value.to_local()  # (3 * rows, ...): [q_r | k_r | v_r]
    rows = local.shape[0] // QKV_PARTS
    part = value.shape[0] // QKV_PARTS  # rows of q (of k, of v) in the global tensor
    rank = value.device_mesh.get_local_rank(0)
    tail = (0,) * (local.dim() - 1)
    chunks = [local[i * rows : (i + 1) * rows] for i in range(QKV_PARTS)]
    offsets = [(i * part + rank * rows, *tail) for i in range(QKV_PARTS)]
    wrapper = LocalShardsWrapper(chunks, offsets)
    return DTensor.from_local(wrapper, value.device_mesh, [Shard(0)], run_check=False, shape=value.shape,
                              stride=value.stride())


def checkpoint_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` ready for ``torch.distributed.checkpoint`` (save or load in place),
    whatever the layout: plain, DDP, FSDP2, or tensor parallel. Keys and global shapes are those
    of the unsharded model (qkv.weight: the global [q | k | v] rows)."""
    return {key: _dcp_entry(value) if isinstance(value, Tensor) else value for key, value in model.state_dict().items()}


def save_checkpoint(model: nn.Module, checkpoint_id: str | Any) -> None:
    """Saves the model with DCP (collective: every rank calls it). ``checkpoint_id``: a directory."""
    import torch.distributed.checkpoint as dcp

    dcp.save(checkpoint_state_dict(model), checkpoint_id=checkpoint_id)


def load_checkpoint(model: nn.Module, checkpoint_id: str | Any) -> None:
    """Loads a DCP checkpoint saved from any layout into the model's own layout, in place
    (collective when the model is distributed)."""
    import torch.distributed.checkpoint as dcp

    state = checkpoint_state_dict(model)
    dcp.load(state, checkpoint_id=checkpoint_id)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's state as plain full tensors on every rank (DTensors gathered: collective)."""
    return {
        key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in model.state_dict().items()
    }


def local_batch(tensors: Sequence[Tensor], rank: int, world_size: int) -> list[Tensor]:
    """Each (B, ...) tensor's rows for one data-parallel rank: contiguous blocks, B divisible by
    world_size (an error otherwise)."""
    out = []
    for t in tensors:
        if t.shape[0] % world_size != 0:
            raise ValueError(f"batch size (got {t.shape[0]}) must be divisible by the world size (got {world_size})")
        n = t.shape[0] // world_size
        out.append(t[rank * n : (rank + 1) * n])
    return out


register_sharding_rules()
