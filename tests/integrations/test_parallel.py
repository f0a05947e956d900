"""DDP, FSDP2, head-aligned tensor parallel, the engine ops' DTensor sharding rules and DCP
checkpoints, each against one process (or the unsharded layer), on 2 gloo processes.

The scenarios run in tests/integrations/dist_worker.py, launched once per group by torch.distributed.run (2
processes, 1 thread each); every rank compares the distributed result with the same computation
done in one process and reports its largest errors, which are asserted here.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from causal_attention.attention import _ops
from causal_attention.tools import demo
from key_bias import key_biases, without_key_bias

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")

WORKER = Path(__file__).with_name("dist_worker.py")
F64 = 1e-10  # float64: the bound (observed: ~1e-16, rounding of the reduction order)
TIMEOUT_S = 240


def launch(tmp: Path, *names: str, nproc: int = 2) -> dict[str, Any]:
    """Runs the named scenarios on nproc processes; returns {name: result}."""
    out = tmp / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER),
           "--out", str(out), "--dir", str(tmp), *names]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def metrics(results: dict[str, Any], name: str) -> dict[str, float]:
    result = results[name]
    assert "error" not in result, result.get("error")
    return result["metrics"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not _ops.core_loaded():
        pytest.fail(f"the compiled engine is not loaded: {_ops.load_error()}")
    tmp = tmp_path_factory.mktemp("dist")
    return launch(tmp, "op_rules", "tp_layer", "tp_decode", "tp_gpt", "ddp", "fsdp", "fsdp_generate", "dcp",
                  "fsdp_compile", "ddp_compile", "tp_compile")


def check_training(m: dict[str, float], *, grads: bool = True) -> None:
    if grads:
        assert m["grad_f64"] <= F64
    assert m["steps_f64"] <= F64
    # float32: the trained model's outputs as close to the float64 run's as one float32 process's
    # (observed 1.6e-7 .. 2.2e-7 for all of them). Its weights: Adam amplifies rounding (its step is
    # g / sqrt(v)), so a weight whose gradient is near 0 is rounding noise of up to about lr in any
    # float32 run (observed: one process 3e-7 .. 1.5e-6, tensor parallel 5e-6, after steps that moved
    # the weights by 5e-2); a distributed bug (a gradient not reduced, a shard misplaced) moves them
    # by the order of lr = 1e-2. So: within 1e-3 of how far the steps moved them.
    assert m["out_f32_vs_single_f64"] <= 2 * m["out_single_f32_vs_f64"]
    assert m["steps_f32_vs_single_f64"] <= 1e-3 * m["steps_moved"]
    assert m["steps_moved"] > 100 * m["steps_single_f32_vs_f64"]  # the comparison is not vacuous


def test_ddp_gradients_and_training_equal_one_process(results):
    check_training(metrics(results, "ddp"))


def test_fsdp2_gradients_and_training_equal_one_process(results):
    check_training(metrics(results, "fsdp"))


@pytest.mark.parametrize("name", ["fsdp_compile", "ddp_compile"])
def test_compiled_data_parallel_gradients_equal_one_process(results, name):
    assert metrics(results, name)["grad_f64"] <= F64


@pytest.mark.parametrize("padded", ["full", "padded"])
@pytest.mark.parametrize("layout", ["replicate", "batch", "heads", "columns", "time"])
def test_ops_on_dtensors_equal_plain_tensors(results, layout, padded):
    """Replicated, batch- and head-sharded inputs run locally (no communication in the forward);
    contiguous column shards (not head-aligned) and time shards are redistributed, never computed
    in place; every output and gradient equals the plain op's."""
    m = metrics(results, "op_rules")
    assert m[f"out_{layout}_{padded}"] <= F64
    assert m[f"grad_{layout}_{padded}"] <= F64
    if layout in ("replicate", "batch", "heads"):
        assert m[f"comms_{layout}_{padded}"] == 0
    else:
        assert m[f"comms_{layout}_{padded}"] >= 1


def test_ops_refuse_dropout_on_dtensors(results):
    assert metrics(results, "op_rules")["dropout_refused"] == 1.0


@pytest.mark.parametrize("padded", ["full", "padded", "padded_kv"])
@pytest.mark.parametrize("mesh", ["tp1", "tp2"])
def test_tensor_parallel_layer_equals_unsharded(results, mesh, padded):
    m = metrics(results, "tp_layer")
    for what in ("out", "grad_x", "grad_params"):
        assert m[f"{what}_{mesh}_{padded}"] <= F64, what
    assert m[f"state_dict_{mesh}_{padded}"] == 0.0  # the global [q | k | v] layout, exactly


def test_tensor_parallel_layer_holds_its_heads_rows_and_refuses_indivisible_heads(results):
    m = metrics(results, "tp_layer")
    assert m["local_rows"] == 0.0
    assert m["naive_colwise_out"] > 0.1  # ColwiseParallel's contiguous cut of [q | k | v] is wrong
    assert m["indivisible_refused"] == 1.0
    assert m["gqa_refused"] == 1.0


def test_tensor_parallel_generation_equals_unsharded(results):
    """Cached steps of a tensor-parallel layer (the lean one without a mask, and with one) and a
    tensor-parallel GPT's generate() against the unsharded ones. (The lean step had called the
    fused op with the projections' DTensor weights and a plain x: an error.)"""
    m = metrics(results, "tp_decode")
    assert m["cache_heads"] == 1.0  # the rank's heads only
    assert m["steps"] <= F64
    assert m["generate_differs"] == 0.0


def test_fsdp_gpt_generates_the_unsharded_tokens(results):
    """fully_shard_gpt registers generate() with FSDP2, which gathers the root's parameters for it
    (it had failed on the embedding's sharded weight: 'got mixed torch.Tensor and DTensor'); twice,
    then a forward."""
    m = metrics(results, "fsdp_generate")
    assert m["generate_differs"] == 0.0
    assert m["logits_after"] <= F64


def test_tensor_parallel_gpt_equals_unsharded(results):
    m = metrics(results, "tp_gpt")
    for key in ("logits_full", "logits_padded", "grad_full", "grad_padded", "steps_f64"):
        assert m[key] <= F64, key
    check_training(m, grads=False)


def test_compiled_tensor_parallel_gpt_equals_unsharded(results):
    m = metrics(results, "tp_compile")
    assert m["logits"] <= F64 and m["grad"] <= F64


@pytest.mark.parametrize("route", ["tp_to_plain", "plain_to_tp", "plain_to_tp_local_rows", "fsdp_to_tp",
                                   "fsdp_to_plain"])
def test_dcp_checkpoints_survive_resharding(results, route):
    m = metrics(results, "dcp")
    assert m[route] == 0.0
    assert m["blank_differs"] > 0.1  # the models loaded into started from other weights


DEMO_ARGS = ["demo", "--steps", "8", "--seed", "3", "--n-eval", "8"]


def run_demo(out: Path, *prefix: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *prefix, "-m", "causal_attention", *DEMO_ARGS, "--out", str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def single_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("demo_single")
    return run_demo(out, extra=()), out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_demo_command_trains_like_one_process(single_demo, tmp_path, strategy):
    """``torchrun --nproc-per-node 2 -m causal_attention demo --distributed S``: the same batches
    and initial weights, so the loss curve and the saved weights are the single process's up to
    float32 rounding of the reduction order (amplified by Adam: see dist_worker.training_parity)."""
    from safetensors.torch import load_file

    single, single_dir = single_demo
    metrics = run_demo(tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       extra=("--distributed", strategy))
    assert metrics["distributed"] == strategy and metrics["world_size"] == 2
    assert abs(metrics["final_loss"] - single["final_loss"]) <= 1e-4 * single["final_loss"]
    assert metrics["accuracy"] == single["accuracy"]
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(single_dir / "model.safetensors")
    assert ours.keys() == theirs.keys()
    # The key bias's gradient is rounding residue (zero in exact arithmetic), which Adam turns
    # into steps of at most about lr: each run's key bias is its initial value plus noise of that
    # size, so the two agree within 2 * steps * lr (a NaN, an unsaved or misplaced bias fails).
    # Every other weight, the q and v biases included, within lr / 10: tensor parallelism sums each
    # row-parallel product in two halves, and Adam amplifies that rounding in weights whose gradient
    # is small (observed after 8 steps: tp 1.6e-4 in one entry of blocks.0.mlp.2.weight, ddp 1.6e-5),
    # where a distributed bug (a gradient not reduced, a shard misplaced) moves weights by about lr
    # at every step.
    lr = inspect.signature(demo.train).parameters["lr"].default
    steps = int(DEMO_ARGS[DEMO_ARGS.index("--steps") + 1])
    k_ours, k_theirs = key_biases(ours), key_biases(theirs)
    assert max((k_ours[k] - k_theirs[k]).abs().max().item() for k in k_ours) <= 2 * steps * lr
    ours, theirs = without_key_bias(ours), without_key_bias(theirs)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= lr / 10


TEARDOWN_PROBE = """
import gc, json, sys
from pathlib import Path
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from causal_attention.tools import demo

out = Path(sys.argv[1])
destroy = dist.destroy_process_group
def probe(*args, **kwargs):
    live = sum(isinstance(o, FSDPModule) for o in gc.get_objects())  # no collection here: what is left
    (out / f"live{dist.get_rank()}.json").write_text(json.dumps(live))
    destroy(*args, **kwargs)
dist.destroy_process_group = probe
demo.main(steps=2, seed=3, out=out, load=None, n_eval=2, distributed_strategy="fsdp")
"""


def test_demo_frees_fsdp_modules_before_the_group_goes(tmp_path):
    """FSDP2's modules are reference cycles: left to the interpreter's shutdown, they (and the gloo
    work they hold) were destroyed after the process group, and once in CI a rank aborted there
    ("terminate called without an active exception") after writing all its files. The demo frees
    them first (distributed.finish): when the group is destroyed, no FSDP module is alive."""
    script = tmp_path / "probe.py"
    script.write_text(TEARDOWN_PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert [json.loads((tmp_path / f"live{r}.json").read_text()) for r in range(2)] == [0, 0]


def test_demo_distributed_needs_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "causal_attention", *DEMO_ARGS, "--out", str(tmp_path),
                           "--distributed", "ddp"], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode != 0
    assert "runs under torchrun" in proc.stderr


def test_bad_arguments_are_named():
    """Argument errors that need no process group: each names the argument and what was expected."""
    from causal_attention import CausalSelfAttention
    from causal_attention.integrations import parallel as cad
    from causal_attention.tools import launch

    with pytest.raises(TypeError, match="tp_mesh must be a DeviceMesh; got str"):
        cad.parallelize_attention(CausalSelfAttention(8, 2), "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="module must be a CausalSelfAttention; got Linear"):
        cad.parallelize_attention(torch.nn.Linear(2, 2), "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model must be a GPT; got Linear"):
        cad.parallelize_gpt(torch.nn.Linear(2, 2), "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"strategy must be one of \('ddp', 'fsdp', 'tp'\); got 'zero'"):
        launch.start("zero")
    with pytest.raises(ValueError, match=r"batch size \(got 5\) must be divisible by the world size \(got 2\)"):
        cad.local_batch([torch.zeros(5, 3)], 0, 2)
