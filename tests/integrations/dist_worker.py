"""The distributed scenarios of tests/integrations/test_parallel.py, run by every rank of
``python -m torch.distributed.run --nproc-per-node 2 tests/integrations/dist_worker.py --out RESULT.json --dir TMP NAME...``.

Each scenario compares the distributed run with the same computation in one process (every rank
builds the same model from the same seed) and returns its largest errors, reduced to the maximum
over ranks; rank 0 writes {scenario: {"metrics": {...}} or {"error": traceback}} to RESULT.json.
The assertions (tolerances) are in test_parallel.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from causal_attention import CausalSelfAttention
from causal_attention.attention import _ops
from causal_attention.integrations import parallel as cad
from causal_attention.models import GPT, GPTConfig
from causal_attention.tools import launch
from key_bias import without_key_bias

torch.set_num_threads(1)
SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, float]]] = {}


def scenario(fn: Callable[[argparse.Namespace], dict[str, float]]) -> Callable[[argparse.Namespace], dict[str, float]]:
    SCENARIOS[fn.__name__] = fn
    return fn


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def max_err(a: Tensor, b: Tensor) -> float:
    if isinstance(a, DTensor):
        a = a.full_tensor()
    if isinstance(b, DTensor):
        b = b.full_tensor()
    return (a.detach() - b.detach()).abs().max().item()


def config(**overrides: object) -> GPTConfig:
    base: dict[str, object] = dict(vocab_size=11, max_len=10, dim=16, n_layers=2, n_heads=4, tie_head=True)
    base.update(overrides)
    return GPTConfig(**base)  # type: ignore[arg-type]


def gpt(dtype: torch.dtype, **overrides: object) -> GPT:
    torch.manual_seed(0)
    model = GPT(config(**overrides)).to(dtype)
    for p in model.parameters():  # not the default zero biases: every parameter matters
        nn.init.normal_(p, std=0.2)
    return model


def batch(B: int, T: int = 9, *, padded: bool = True, seed: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded (tokens, mask, targets), each (B, T); targets -100 at padding."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (B, T), generator=g)
    lengths = torch.randint(2, T + 1, (B, 1), generator=g) if padded else torch.full((B, 1), T)
    mask = torch.arange(T)[None, :] < lengths
    targets = torch.randint(0, 11, (B, T), generator=g).masked_fill(~mask, -100)
    return tokens, mask, targets


def loss_sum(model: nn.Module, tokens: Tensor, mask: Tensor, targets: Tensor) -> Tensor:
    logits = model(tokens, mask)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")


def data_parallel_loss(model: nn.Module, tokens: Tensor, mask: Tensor, targets: Tensor) -> Tensor:
    """This rank's share of the whole batch's mean loss, times the world size (DDP and FSDP2
    average gradients over ranks): the averaged gradient is the whole batch's."""
    n_total = int((targets != -100).sum())
    local = cad.local_batch([tokens, mask, targets], rank(), world())
    return loss_sum(model, *local) / n_total * world()


def grads(model: nn.Module) -> dict[str, Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name.replace("module.", "").replace("_orig_mod.", "")] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def params(model: nn.Module) -> dict[str, Tensor]:
    return {k.replace("module.", "").replace("_orig_mod.", ""): v for k, v in cad.full_state_dict(model).items()}


def compare(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(max_err(a[k], b[k]) for k in a)


def single_grads(model: GPT, data: tuple[Tensor, Tensor, Tensor]) -> dict[str, Tensor]:
    ref = copy.deepcopy(model)
    tokens, mask, targets = data
    (loss_sum(ref, tokens, mask, targets) / int((targets != -100).sum())).backward()
    return grads(ref)


def train(model: nn.Module, steps: int, loss_fn: Callable[..., Tensor], *, clip: bool = True) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(steps):
        data = batch(8, seed=100 + step)
        opt.zero_grad(set_to_none=True)
        loss_fn(model, *data).backward()
        if clip:
            cad.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def training_parity(make: Callable[[GPT], nn.Module], dist_loss: Callable[..., Tensor]) -> dict[str, float]:
    """5 AdamW steps with clipping, distributed in float64 against one process in float64; and
    distributed in float32, against one process in float32 and in
    float64 from the same initial weights. The float32 runs differ from float64 by rounding that
    Adam amplifies (its step is g / sqrt(v): a gradient near 0 has a relative rounding error of
    order 1), so a weight whose gradient is near 0 lands anywhere within about lr in each run (and
    barely matters to the model, for the same reason). What the trained model computes is compared
    (its logits on held-out tokens): the distributed run, which only sums in another order, must be
    as close to the float64 run as a single-process float32 run is; its weights, within a small
    fraction of how far the steps moved them. The float32 weight comparisons leave out the key bias
    (see key_bias.without_key_bias): its value after the steps is rounding noise in every run."""
    model64 = gpt(torch.float64)
    model32 = copy.deepcopy(model64).float()
    single64, distributed = copy.deepcopy(model64), make(model32)
    single32, halves32 = copy.deepcopy(model32), copy.deepcopy(model32)
    train(single64, 5, whole_batch_loss)
    train(single32, 5, whole_batch_loss)
    train(halves32, 5, halves_loss)
    train(distributed, 5, dist_loss)
    distributed64 = make(model64)
    train(distributed64, 5, dist_loss)
    p64 = without_key_bias({k: v.float() for k, v in params(single64).items()})
    p32, d32 = without_key_bias(params(single32)), without_key_bias(params(distributed))
    h32 = without_key_bias(params(halves32))
    return {
        "steps_f64": compare(params(distributed64), params(single64)),
        "steps_f32_vs_single_f32": compare(d32, p32),
        "steps_f32_vs_single_f64": compare(d32, p64),
        # One float32 process is one sample of the rounding noise: the larger of two that only sum in
        # another order (the whole batch's loss, and the sum of its halves' as data parallelism splits it).
        "steps_single_f32_vs_f64": max(compare(p32, p64), compare(h32, p64)),
        "out_f32_vs_single_f64": output_err(distributed, single64),
        "out_single_f32_vs_f64": max(output_err(single32, single64), output_err(halves32, single64)),
        "steps_moved": compare(p32, without_key_bias(params(model32))),  # the steps changed the weights
    }


def whole_batch_loss(model: nn.Module, tokens: Tensor, mask: Tensor, targets: Tensor) -> Tensor:
    return loss_sum(model, tokens, mask, targets) / int((targets != -100).sum())


def output_err(model: nn.Module, reference: nn.Module) -> float:
    """The largest error of model's logits against reference's on a held-out batch."""
    tokens, mask, _ = batch(8, seed=7)
    with torch.no_grad():
        got, want = model(tokens, mask), reference(tokens, mask)
    got = got.full_tensor() if isinstance(got, DTensor) else got
    return max_err(got.double(), want.double())


def halves_loss(model: nn.Module, tokens: Tensor, mask: Tensor, targets: Tensor) -> Tensor:
    """The whole batch's mean loss as the sum of its two halves' (in one process): the same gradient,
    summed in another order."""
    n_total = int((targets != -100).sum())
    return sum(loss_sum(model, *cad.local_batch([tokens, mask, targets], r, 2)) for r in range(2)) / n_total


# --------------------------------------------------------------------------------------------


@scenario
def ddp(args: argparse.Namespace) -> dict[str, float]:
    """DDP: one step's gradients (float64) and 5 AdamW steps' weights (float32) against one process."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = gpt(torch.float64)
    data = batch(8)
    ref = single_grads(model, data)
    ddp_model = DDP(copy.deepcopy(model))
    data_parallel_loss(ddp_model, *data).backward()
    out = {"grad_f64": compare(grads(ddp_model), ref)}

    out.update(training_parity(lambda m: DDP(copy.deepcopy(m)), data_parallel_loss))
    return out


def fsdp_model(model: GPT) -> GPT:
    return cad.fully_shard_gpt(copy.deepcopy(model))  # type: ignore[return-value]


@scenario
def fsdp(args: argparse.Namespace) -> dict[str, float]:
    """FSDP2 (fully_shard per block and on the root): gradients and 5 AdamW steps against one process."""
    model = gpt(torch.float64)
    data = batch(8)
    ref = single_grads(model, data)
    sharded = fsdp_model(model)
    data_parallel_loss(sharded, *data).backward()
    out = {"grad_f64": compare(grads(sharded), ref)}

    out.update(training_parity(fsdp_model, data_parallel_loss))
    return out


@scenario
def fsdp_generate(args: argparse.Namespace) -> dict[str, float]:
    """An FSDP2-sharded GPT generates with its KV caches the unsharded GPT's tokens (greedy, each
    rank the same prompts; the decode steps read the parameters FSDP2 gathers for each block)."""
    model = gpt(torch.float64)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    expected = model.generate(prompts, 5)
    sharded = fsdp_model(model)
    first = sharded.generate(prompts, 5)
    data = batch(4)
    logits = max_err(sharded(data[0], data[1]), model(data[0], data[1]))  # forward after generate
    return {"generate_differs": float(first != expected or sharded.generate(prompts, 5) != expected),
            "logits_after": logits}


@scenario
def fsdp_compile(args: argparse.Namespace) -> dict[str, float]:
    """torch.compile of the FSDP2-sharded model (aot_eager: dynamo + AOTAutograd with the engine's
    fake kernels): forward and gradients against eager single-process, float64, with padding."""
    torch._dynamo.reset()
    model = gpt(torch.float64)
    data = batch(8)
    ref = single_grads(model, data)
    sharded = fsdp_model(model)
    compiled = torch.compile(sharded, backend=args.compile_backend)
    data_parallel_loss(compiled, *data).backward()
    return {"grad_f64": compare(grads(sharded), ref)}


@scenario
def ddp_compile(args: argparse.Namespace) -> dict[str, float]:
    """torch.compile of the DDP-wrapped model: gradients against eager single-process, float64."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    model = gpt(torch.float64)
    data = batch(8)
    ref = single_grads(model, data)
    wrapped = DDP(copy.deepcopy(model))
    compiled = torch.compile(wrapped, backend=args.compile_backend)
    data_parallel_loss(compiled, *data).backward()
    return {"grad_f64": compare(grads(wrapped), ref)}


# --------------------------------------------------------------------------------------------


def attention_case(padded: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    """qkv (B=4, T=7, 3 * dim) with H=4 heads of 3, a mask, and an upstream gradient (B, T, dim), float64."""
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(4, 7, 36, generator=g, dtype=torch.float64)
    mask = (torch.arange(7)[None, :] < torch.tensor([[7], [3], [5], [1]])) if padded else None
    grad = torch.randn(4, 7, 12, generator=g, dtype=torch.float64)
    return qkv, mask, grad


@scenario
def op_rules(args: argparse.Namespace) -> dict[str, float]:
    """The engine's ops on DTensors: replicated, batch-sharded and head-sharded inputs run locally
    (no communication in the forward), other layouts are redistributed; outputs and qkv gradients
    equal plain tensors (float64), with and without padding."""
    mesh = init_device_mesh("cpu", (world(),))
    layouts = {
        "replicate": Replicate(),
        "batch": Shard(0),
        "heads": cad.head_placement(2),
        "columns": Shard(2),  # contiguous columns: not head-aligned, must be redistributed
        "time": Shard(1),
    }
    out: dict[str, float] = {}
    for padded in (False, True):
        qkv, mask, grad = attention_case(padded)
        leaf = qkv.clone().requires_grad_()
        expected = _ops.attention(leaf, mask, 4)
        expected.backward(grad)
        for name, placement in layouts.items():
            mask_placement = Shard(0) if name == "batch" else Replicate()
            q = distribute_tensor(qkv, mesh, [placement]).requires_grad_()
            m = None if mask is None else distribute_tensor(mask, mesh, [mask_placement])
            with CommDebugMode() as comm:
                y = _ops.attention(q, m, 4)
            tag = f"{name}_{'padded' if padded else 'full'}"
            out[f"out_{tag}"] = max_err(y, expected)
            out[f"comms_{tag}"] = float(comm.get_total_counts())
            y.backward(distribute_tensor(grad, mesh, list(y.placements)))
            out[f"grad_{tag}"] = max_err(q.grad, leaf.grad)
    # Dropout with DTensors is refused, naming it.
    q = distribute_tensor(attention_case(False)[0], mesh, [Shard(0)])
    try:
        _ops.attention(q, None, 4, 0.1)
        out["dropout_refused"] = 0.0
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        out["dropout_refused"] = float("dropout_p=0.1" in str(exc))
    return out


def layer_and_copy(dtype: torch.dtype = torch.float64, n_heads: int = 4,
                   n_kv_heads: int | None = None) -> tuple[CausalSelfAttention, CausalSelfAttention]:
    torch.manual_seed(3)
    layer = CausalSelfAttention(12, n_heads, dtype=dtype, n_kv_heads=n_kv_heads)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.3)
    return layer, copy.deepcopy(layer)


@scenario
def tp_layer(args: argparse.Namespace) -> dict[str, float]:
    """parallelize_attention on 2 ranks and on a 1-rank mesh: outputs, input and parameter gradients
    equal the unsharded layer (float64), with and without padding; state_dict() is the global layout."""
    out: dict[str, float] = {}
    meshes = {"tp2": init_device_mesh("cpu", (world(),)),
              "tp1": init_device_mesh("cpu", (world(), 1), mesh_dim_names=("dp", "tp"))["tp"]}
    for mesh_name, mesh in meshes.items():
        for padded, kv in ((False, None), (True, None), (True, 4)):
            # kv 4: n_kv_heads given, equal to n_heads (multi-head, the op called with n_kv_heads)
            tag = f"{mesh_name}_{'padded' if padded else 'full'}{'_kv' if kv else ''}"
            layer, sharded = layer_and_copy(n_kv_heads=kv)
            cad.parallelize_attention(sharded, mesh)
            g = torch.Generator().manual_seed(11)
            x = torch.randn(3, 6, 12, generator=g, dtype=torch.float64)
            mask = (torch.arange(6)[None, :] < torch.tensor([[6], [2], [4]])) if padded else None
            grad = torch.randn(3, 6, 12, generator=g, dtype=torch.float64)
            x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
            y1, y2 = layer(x1, mask), sharded(x2, mask)
            y1.backward(grad)
            y2.backward(grad)
            out[f"out_{tag}"] = max_err(y2, y1)
            out[f"grad_x_{tag}"] = max_err(x2.grad, x1.grad)
            out[f"grad_params_{tag}"] = compare(grads(sharded), grads(layer))
            out[f"state_dict_{tag}"] = compare(cad.full_state_dict(sharded), layer.state_dict())
    # The local weights are the rank's heads' rows of q, k and v (not a contiguous cut).
    layer, sharded = layer_and_copy()
    cad.parallelize_attention(sharded, meshes["tp2"])
    rows = 12 // world()
    expected = torch.cat([layer.qkv.weight[i * 12 + rank() * rows : i * 12 + (rank() + 1) * rows] for i in range(3)])
    out["local_rows"] = max_err(sharded.qkv.weight.to_local(), expected)
    # The naive cut (ColwiseParallel on qkv: contiguous rows) is wrong, which these checks would catch.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layer, naive = layer_and_copy()
    parallelize_module(naive, meshes["tp2"], {"qkv": ColwiseParallel(), "proj": RowwiseParallel()})
    naive.n_heads //= world()
    x = torch.randn(3, 6, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out["naive_colwise_out"] = max_err(naive(x), layer(x))
    # Heads not divisible by the ranks: a clear error naming both numbers.
    try:
        cad.parallelize_attention(CausalSelfAttention(12, 3, dtype=torch.float64), meshes["tp2"])
        out["indivisible_refused"] = 0.0
    except ValueError as exc:
        out["indivisible_refused"] = float("n_heads (got 3)" in str(exc) and f"(got {world()})" in str(exc))
    # Grouped-query heads: refused by name, before anything is sharded (not cut into wrong rows).
    gqa = CausalSelfAttention(12, 4, n_kv_heads=2, dtype=torch.float64)
    try:
        cad.parallelize_attention(gqa, meshes["tp2"])
        out["gqa_refused"] = 0.0
    except ValueError as exc:
        out["gqa_refused"] = float("grouped-query" in str(exc) and "n_kv_heads=2" in str(exc)
                                   and not isinstance(gqa.qkv.weight, DTensor))
    return out


@scenario
def tp_decode(args: argparse.Namespace) -> dict[str, float]:
    """Generation under tensor parallel: the sharded layer's cached steps (a prefill, then steps of
    one token without a mask, the module's lean path, and with one) equal the unsharded layer's
    (float64), its cache holding the rank's heads; a tensor-parallel GPT generates the unsharded
    GPT's tokens (greedy, KV cache). The projections' parallel hooks make the step call them as
    modules rather than stream their sharded weights."""
    out: dict[str, float] = {}
    mesh = init_device_mesh("cpu", (world(),))
    layer, sharded = layer_and_copy()
    cad.parallelize_attention(sharded, mesh)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(3, 8, 12, generator=g, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        cache, local = layer.make_cache(3, 8), sharded.make_cache(3, 8)
        out["cache_heads"] = float(local.k.shape[1] == 4 // world())
        errors = [max_err(sharded(x[:, :5], cache=local), layer(x[:, :5], cache=cache))]
        for t in (5, 6):
            errors.append(max_err(sharded(x[:, t : t + 1], cache=local), full[:, t : t + 1]))  # no mask: the lean path
        mask = torch.ones(3, 1, dtype=torch.bool)
        errors.append(max_err(sharded(x[:, 7:8], mask, cache=local), full[:, 7:8]))
    out["steps"] = max(errors)
    model = gpt(torch.float64)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    expected = model.generate(prompts, 5)
    out["generate_differs"] = float(tp_gpt_model(model).generate(prompts, 5) != expected)
    return out


def tp_gpt_model(model: GPT) -> GPT:
    mesh = init_device_mesh("cpu", (world(),))
    return cad.parallelize_gpt(copy.deepcopy(model), mesh)  # type: ignore[return-value]


@scenario
def tp_gpt(args: argparse.Namespace) -> dict[str, float]:
    """parallelize_gpt: logits and gradients equal the unsharded GPT (float64; padded batches take
    the packed path, full ones the unpacked one); 5 AdamW steps with clipping (float32)."""
    out: dict[str, float] = {}
    model = gpt(torch.float64)
    for padded in (False, True):
        tag = "padded" if padded else "full"
        data = batch(4, padded=padded)
        sharded = tp_gpt_model(model)
        ref = copy.deepcopy(model)
        out[f"logits_{tag}"] = max_err(sharded(data[0], data[1]), ref(data[0], data[1]))
        whole_batch_loss(sharded, *data).backward()
        whole_batch_loss(ref, *data).backward()
        out[f"grad_{tag}"] = compare(grads(sharded), grads(ref))
    out.update(training_parity(tp_gpt_model, whole_batch_loss))
    return out


@scenario
def tp_compile(args: argparse.Namespace) -> dict[str, float]:
    """torch.compile of the tensor-parallel GPT: logits and gradients against eager unsharded (float64)."""
    torch._dynamo.reset()
    model = gpt(torch.float64)
    data = batch(4, padded=True)
    sharded = tp_gpt_model(model)
    compiled = torch.compile(sharded, backend=args.compile_backend)
    ref = copy.deepcopy(model)
    out = {"logits": max_err(compiled(data[0], data[1]), ref(data[0], data[1]))}
    whole_batch_loss(compiled, *data).backward()
    whole_batch_loss(ref, *data).backward()
    out["grad"] = compare(grads(sharded), grads(ref))
    return out


# --------------------------------------------------------------------------------------------


@scenario
def dcp(args: argparse.Namespace) -> dict[str, float]:
    """DCP checkpoints across layouts: TP=2 -> unsharded, unsharded -> TP=2, FSDP2 -> TP=2 and
    unsharded; every load equals the saved global state exactly (errors are 0)."""
    root = Path(args.dir)
    original = gpt(torch.float32)
    expected = original.state_dict()
    blank = lambda: GPT(original.config)  # noqa: E731 - other weights (seed-dependent init)
    out: dict[str, float] = {}

    tp = tp_gpt_model(original)
    cad.save_checkpoint(tp, str(root / "tp"))
    plain = blank()
    cad.load_checkpoint(plain, str(root / "tp"))
    out["tp_to_plain"] = compare(plain.state_dict(), expected)

    cad.save_checkpoint(original, str(root / "plain"))
    tp2 = tp_gpt_model(blank())
    cad.load_checkpoint(tp2, str(root / "plain"))
    out["plain_to_tp"] = compare(cad.full_state_dict(tp2), expected)
    rows = 16 // world()
    w = original.blocks[0].attn.qkv.weight
    local = torch.cat([w[i * 16 + rank() * rows : i * 16 + (rank() + 1) * rows] for i in range(3)])
    out["plain_to_tp_local_rows"] = max_err(tp2.blocks[0].attn.qkv.weight.to_local(), local)

    sharded = fsdp_model(original)
    cad.save_checkpoint(sharded, str(root / "fsdp"))
    tp3 = tp_gpt_model(blank())
    cad.load_checkpoint(tp3, str(root / "fsdp"))
    out["fsdp_to_tp"] = compare(cad.full_state_dict(tp3), expected)
    plain2 = blank()
    cad.load_checkpoint(plain2, str(root / "fsdp"))
    out["fsdp_to_plain"] = compare(plain2.state_dict(), expected)
    # The models really differed before loading (so a no-op load would fail).
    out["blank_differs"] = compare(blank().state_dict(), expected)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--compile-backend", default="aot_eager")
    parser.add_argument("names", nargs="+", choices=sorted(SCENARIOS))
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results: dict[str, dict[str, object]] = {}
    for name in args.names:
        try:
            result: dict[str, object] = {"metrics": SCENARIOS[name](args)}
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            result = {"error": f"rank {rank()}: " + traceback.format_exc()}
            print(result["error"], flush=True)
        per_rank: list[dict[str, object]] = [{}] * world()
        dist.all_gather_object(per_rank, result)
        errors = [r["error"] for r in per_rank if "error" in r]
        if errors:
            results[name] = {"error": "\n".join(map(str, errors))}
        else:  # each figure: the largest over ranks
            metrics = [r["metrics"] for r in per_rank]
            results[name] = {"metrics": {k: max(float(m[k]) for m in metrics) for k in metrics[0]}}  # type: ignore[index]
    if rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    launch.finish()  # frees the scenarios' FSDP modules, waits for every rank, destroys the group


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
