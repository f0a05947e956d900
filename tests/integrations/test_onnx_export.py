"""ONNX: ``torch.onnx.export(model, args, dynamo=True)`` of the layer and the GPT, as users call it,
runs in onnxruntime (CPU) and equals eager (float32, <= 1e-5) at every position.

While the exporter traces, the layer writes the engine's attention as torch's SDPA
(backends.onnx_exporting), which the exporter translates: standard primitive ops at its default
opset, ONNX ``Attention`` at opset 23. Both are run here, at the exported shape and at another batch
size and length (dynamic axes), with right padding and with masks whose first key is padding (query
rows with no allowed key: 0 in our contract, compared too).
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort  # installed by make test's set-up (with onnx and onnxscript, the exporter's)
import pytest
import torch
from torch import Tensor

from causal_attention import CausalSelfAttention
from causal_attention.integrations.torch_export import dynamic_shapes
from causal_attention.models import GPT, GPTConfig


DIM, HEADS, VOCAB, MAX_LEN = 32, 4, 61, 64
OPSETS = [None, 23]  # None: the exporter's default (primitive ops); 23: ONNX Attention


def masks(B: int, T: int, seed: int) -> dict[str, Tensor]:
    """Right padding (one sequence of length 1) and an arbitrary mask whose sequence 0 starts with
    padding, so that its first query rows have no allowed key."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[-1] = 1
    right = torch.arange(T)[None, :] < lengths[:, None]
    arbitrary = torch.rand(B, T, generator=g) < 0.6
    arbitrary[0, :3] = False
    return {"right": right, "arbitrary": arbitrary}


def session(program: torch.onnx.ONNXProgram) -> ort.InferenceSession:
    return ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])


def run(sess: ort.InferenceSession, *inputs: Tensor) -> Tensor:
    names = [i.name for i in sess.get_inputs()]
    assert len(names) == len(inputs), names
    return torch.from_numpy(sess.run(None, {n: t.numpy() for n, t in zip(names, inputs)})[0])


def max_err(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def op_types(program: torch.onnx.ONNXProgram) -> set[str]:
    graph = program.model_proto.graph
    assert all(n.domain in ("", "ai.onnx") for n in graph.node), {n.domain for n in graph.node}
    assert not program.model_proto.functions, "the graph must be standard ONNX, with no custom functions"
    return {n.op_type for n in graph.node}


@pytest.fixture(scope="module")
def layer() -> CausalSelfAttention:
    torch.manual_seed(0)
    return CausalSelfAttention(DIM, HEADS).eval()


@pytest.fixture(scope="module")
def gpt() -> GPT:
    torch.manual_seed(1)
    config = GPTConfig(vocab_size=VOCAB, max_len=MAX_LEN, dim=DIM, n_layers=2, n_heads=HEADS, activation="gelu_tanh")
    return GPT(config).eval()


_sessions: dict[tuple[str, bool, int | None], ort.InferenceSession] = {}


def exported(model: torch.nn.Module, kind: str, padded: bool, opset: int | None) -> ort.InferenceSession:
    """The model exported once per (kind, padded, opset) at B=2, T=8, as a user calls it."""
    key = (kind, padded, opset)
    if key not in _sessions:
        first = torch.randn(2, 8, DIM) if kind == "layer" else torch.randint(0, VOCAB, (2, 8))
        args = (first, masks(2, 8, seed=0)["right"]) if padded else (first,)
        shapes = dynamic_shapes(with_mask=padded, max_len=MAX_LEN if kind == "gpt" else None)
        program = torch.onnx.export(model, args, dynamo=True, opset_version=opset, dynamic_shapes=shapes)
        types = op_types(program)
        if opset == 23:
            assert "Attention" in types
        else:
            assert "Attention" not in types and "Softmax" in types
        _sessions[key] = session(program)
    return _sessions[key]


SHAPES = [(2, 8), (3, 13), (1, 40)]  # the exported shape, then other B and T


@pytest.mark.parametrize("opset", OPSETS, ids=["default_opset", "opset23"])
@pytest.mark.parametrize("B,T", SHAPES)
def test_layer_without_mask(layer: CausalSelfAttention, opset: int | None, B: int, T: int) -> None:
    sess = exported(layer, "layer", False, opset)
    x = torch.randn(B, T, DIM)
    with torch.no_grad():
        assert max_err(run(sess, x), layer(x)) <= 1e-5


@pytest.mark.parametrize("mask_kind", ["right", "arbitrary"])
@pytest.mark.parametrize("opset", OPSETS, ids=["default_opset", "opset23"])
@pytest.mark.parametrize("B,T", SHAPES)
def test_layer_with_mask(layer: CausalSelfAttention, opset: int | None, B: int, T: int, mask_kind: str) -> None:
    sess = exported(layer, "layer", True, opset)
    x = torch.randn(B, T, DIM)
    mask = masks(B, T, seed=B * T)[mask_kind]
    with torch.no_grad():
        want = layer(x, mask)
    assert max_err(run(sess, x, mask), want) <= 1e-5  # every position, padding and empty rows too
    if mask_kind == "arbitrary":  # the rows with no allowed key: out = proj.bias, as eager
        assert max_err(run(sess, x, mask)[0, 0], layer.proj.bias.detach()) <= 1e-6


@pytest.mark.parametrize("opset", OPSETS, ids=["default_opset", "opset23"])
@pytest.mark.parametrize("B,T", SHAPES)
def test_gpt_without_mask(gpt: GPT, opset: int | None, B: int, T: int) -> None:
    sess = exported(gpt, "gpt", False, opset)
    tokens = torch.randint(0, VOCAB, (B, T))
    with torch.no_grad():
        assert max_err(run(sess, tokens), gpt(tokens)) <= 1e-5


@pytest.mark.parametrize("mask_kind", ["right", "arbitrary"])
@pytest.mark.parametrize("opset", OPSETS, ids=["default_opset", "opset23"])
@pytest.mark.parametrize("B,T", SHAPES)
def test_gpt_with_mask(gpt: GPT, opset: int | None, B: int, T: int, mask_kind: str) -> None:
    sess = exported(gpt, "gpt", True, opset)
    tokens = torch.randint(0, VOCAB, (B, T))
    mask = masks(B, T, seed=B * T)[mask_kind]
    with torch.no_grad():
        want = gpt(tokens, mask)  # zeros at padding
    got = run(sess, tokens, mask)
    assert max_err(got, want) <= 1e-5
    assert bool((got[~mask] == 0).all())


def test_integer_attention_mask(gpt: GPT) -> None:
    """A tokenizer's int64 attention_mask exports as well (its 0/1 check is dropped from the ONNX
    graph, as the exporter drops every assertion)."""
    tokens = torch.randint(0, VOCAB, (2, 8))
    mask = masks(2, 8, seed=3)["right"].long()
    shapes = dynamic_shapes(with_mask=True, max_len=MAX_LEN)
    program = torch.onnx.export(gpt, (tokens, mask), dynamo=True, dynamic_shapes=shapes)
    sess = session(program)
    tokens, mask = torch.randint(0, VOCAB, (3, 11)), masks(3, 11, seed=4)["right"].long()
    with torch.no_grad():
        assert max_err(run(sess, tokens, mask), gpt(tokens, mask)) <= 1e-5


def test_eager_and_torch_export_keep_the_engine(layer: CausalSelfAttention) -> None:
    """The ONNX path is taken only inside torch.onnx.export: torch.export keeps the engine's op."""
    x = torch.randn(2, 8, DIM)
    ep = torch.export.export(layer, (x,))
    assert "causal_attention.attention_forward.default" in {str(n.target) for n in ep.graph.nodes}


def test_bench_deploy_quick(tmp_path: Path) -> None:
    """The bench's rows at tiny sizes (onnxruntime only here: AOTI compiles are covered by
    test_export.py): one row per case, the peer equal to eager, the files written."""
    from causal_attention.tools.bench import deploy as bench_deploy

    report = bench_deploy.main(out_dir=tmp_path, repeats=1, quick=True, peers=("onnxruntime",))
    rows = report["rows"]
    assert [r["peer"] for r in rows] == ["onnxruntime"] * 3
    assert all(r["max_err"] <= 1e-5 and r["ours_ms"] > 0 and r["theirs_ms"] > 0 for r in rows)
    assert (tmp_path / "bench_deploy.json").stat().st_size > 0
    assert (tmp_path / "bench_deploy.png").stat().st_size > 0
    with pytest.raises(ValueError, match="peers must be a non-empty selection"):
        bench_deploy.main(out_dir=tmp_path, repeats=1, quick=True, peers=("tensorrt",))


# ---------------------------------------------------------------------------------------------
# A torch.export program holds the engine's ops: causal_attention.integrations.onnx_export.translation_table().


@pytest.mark.parametrize("kind", ["layer", "gpt"])
def test_exported_program_with_the_translation_table(layer: CausalSelfAttention, gpt: GPT, kind: str) -> None:
    from causal_attention.integrations.onnx_export import translation_table

    model: torch.nn.Module = layer if kind == "layer" else gpt
    first = torch.randn(2, 8, DIM) if kind == "layer" else torch.randint(0, VOCAB, (2, 8))
    mask = masks(2, 8, seed=0)["right"]
    if kind == "gpt":
        mask = mask.long()  # the graph holds the engine's mask_to_bool too
    ep = torch.export.export(model, (first, mask), dynamic_shapes=dynamic_shapes(
        with_mask=True, max_len=MAX_LEN if kind == "gpt" else None))
    held = {str(n.target) for n in ep.graph.nodes}
    assert "causal_attention.attention_forward.default" in held
    with pytest.raises(Exception, match="No ONNX function found for .*causal_attention"):
        torch.onnx.export(ep, dynamo=True, verbose=False)  # no translation without the table
    program = torch.onnx.export(ep, dynamo=True, verbose=False, custom_translation_table=translation_table())
    op_types(program)
    sess = session(program)
    for B, T in SHAPES:
        first = torch.randn(B, T, DIM) if kind == "layer" else torch.randint(0, VOCAB, (B, T))
        for mask_kind, m in masks(B, T, seed=B + T).items():
            m = m if kind == "layer" else m.long()
            with torch.no_grad():
                assert max_err(run(sess, first, m), model(first, m)) <= 1e-5, (B, T, mask_kind)
