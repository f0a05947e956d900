"""torch.export and AOTInductor: the exported layer, GPT forward and decode step equal eager.

Exported programs run the same kernels as eager, so the comparison is tight (float64 1e-10,
float32 1e-5) at the example's shapes and at another batch size and length (dynamic B and T).
AOTInductor packages are compiled once per module (slow on 2 cores) at tiny sizes.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import Tensor

from causal_attention import CausalSelfAttention
from causal_attention.integrations.torch_export import CachedGPT, dynamic_shapes
from causal_attention.models import GPT, GPTConfig

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DIM, HEADS, VOCAB, MAX_LEN = 32, 4, 61, 64


def right_mask(lengths: list[int], T: int) -> Tensor:
    """(B, T) bool, True = real: right padding to each length."""
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def max_err(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def make_layer(dtype: torch.dtype) -> CausalSelfAttention:
    torch.manual_seed(0)
    return CausalSelfAttention(DIM, HEADS, dtype=dtype).eval()


def make_gpt(dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(1)
    config = GPTConfig(vocab_size=VOCAB, max_len=MAX_LEN, dim=DIM, n_layers=2, n_heads=HEADS, activation="gelu_tanh")
    return GPT(config).to(dtype).eval()


def layer_inputs(B: int, T: int, lengths: list[int] | None, dtype: torch.dtype) -> tuple[Tensor, ...]:
    x = torch.randn(B, T, DIM, dtype=dtype)
    return (x,) if lengths is None else (x, right_mask(lengths, T))


def gpt_inputs(B: int, T: int, lengths: list[int] | None) -> tuple[Tensor, ...]:
    tokens = torch.randint(0, VOCAB, (B, T))
    return (tokens,) if lengths is None else (tokens, right_mask(lengths, T))


# The example's shapes, then another B and T (and other lengths: a padded row with no real key
# beyond position 0 included).
EXAMPLE = dict(B=2, T=8, lengths=[8, 5])
OTHER = dict(B=3, T=13, lengths=[13, 1, 7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_exported_layer_equals_eager(strict: bool, padded: bool, dtype: torch.dtype) -> None:
    layer = make_layer(dtype)
    example = layer_inputs(EXAMPLE["B"], EXAMPLE["T"], EXAMPLE["lengths"] if padded else None, dtype)
    ep = torch.export.export(layer, example, dynamic_shapes=dynamic_shapes(with_mask=padded), strict=strict)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    if not strict:  # strict export wraps the autograd.Function's call in a no-grad higher-order op
        assert "causal_attention.attention_forward.default" in targets
    exported = ep.module()
    for shape in (EXAMPLE, OTHER):
        inputs = layer_inputs(shape["B"], shape["T"], shape["lengths"] if padded else None, dtype)
        with torch.no_grad():
            assert max_err(exported(*inputs), layer(*inputs)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_exported_gpt_forward_equals_eager(strict: bool, padded: bool, dtype: torch.dtype) -> None:
    model = make_gpt(dtype)
    example = gpt_inputs(EXAMPLE["B"], EXAMPLE["T"], EXAMPLE["lengths"] if padded else None)
    shapes = dynamic_shapes(with_mask=padded, max_len=MAX_LEN)
    ep = torch.export.export(model, example, dynamic_shapes=shapes, strict=strict)
    exported = ep.module()
    for shape in (EXAMPLE, OTHER):
        inputs = gpt_inputs(shape["B"], shape["T"], shape["lengths"] if padded else None)
        with torch.no_grad():
            got, want = exported(*inputs), model(*inputs)  # eager packs the real tokens; the graph does not
        assert max_err(got, want) <= TOL[dtype]
        if padded:  # padding positions: zero logits in both
            assert bool((got[~inputs[1]] == 0).all())


def test_exported_program_checks_the_mask_values() -> None:
    """An integer mask's values are checked inside the graph (the engine's mask_to_bool op)."""
    layer = make_layer(torch.float32)
    x, mask = layer_inputs(2, 8, [8, 5], torch.float32)
    exported = torch.export.export(layer, (x, mask.long()), dynamic_shapes=dynamic_shapes(with_mask=True)).module()
    with torch.no_grad():
        assert max_err(exported(x, mask.long()), layer(x, mask)) <= 1e-5
        with pytest.raises(Exception, match="only 0 .padding. and 1"):
            exported(x, mask.long() * 2)


# ---------------------------------------------------------------------------------------------
# The decode step with the static cache: CachedGPT's buffers are mutated by the exported program.


PROMPTS = [[5, 9, 2, 7, 1, 3], [4, 4, 8], [11]]


def _prefilled(model: GPT, max_len: int) -> tuple[CachedGPT, Tensor]:
    """CachedGPT with PROMPTS prefilled eagerly; returns it and each prompt's last logits (B, V)."""
    step = CachedGPT(model, batch_size=len(PROMPTS), max_len=max_len)
    T0 = max(len(p) for p in PROMPTS)
    tokens = torch.zeros(len(PROMPTS), T0, dtype=torch.int64)
    for b, p in enumerate(PROMPTS):
        tokens[b, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in PROMPTS])
    with torch.no_grad():
        logits = step(tokens, right_mask(lengths.tolist(), T0))  # (B, T0, V)
    return step, logits[torch.arange(len(PROMPTS)), lengths - 1]


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_exported_decode_step_mutates_the_cache_and_equals_eager(strict: bool) -> None:
    model = make_gpt()
    eager, last = _prefilled(model, max_len=24)
    with torch.no_grad():
        ep = torch.export.export(copy.deepcopy(eager), (last.argmax(-1)[:, None],), strict=strict)
    mutated = set(ep.run_decompositions().graph_signature.buffers_to_mutate.values())
    assert {f"{kind}{i}" for kind in ("k", "v", "lengths") for i in range(2)} <= mutated
    exported = ep.module()
    for name, buffer in eager.named_buffers():  # the exported module starts from the prefilled cache
        dict(exported.named_buffers())[name].copy_(buffer)
    nxt = last.argmax(-1)[:, None]  # (B, 1), greedy
    for _ in range(6):
        with torch.no_grad():
            want, got = eager(nxt), exported(nxt)  # (B, 1, V)
        assert max_err(got, want) <= 1e-5
        for name, buffer in eager.named_buffers():
            assert max_err(dict(exported.named_buffers())[name], buffer) <= 1e-5, name
        nxt = want[:, -1].argmax(-1)[:, None]
    # and the tokens equal GPT.generate's (greedy, ragged prompts)
    fresh, last = _prefilled(model, max_len=24)
    for name, buffer in fresh.named_buffers():
        dict(exported.named_buffers())[name].copy_(buffer)
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    nxt = last.argmax(-1)[:, None]
    for _ in range(5):
        for b, t in enumerate(nxt[:, 0].tolist()):
            tokens[b].append(t)
        with torch.no_grad():
            nxt = exported(nxt)[:, -1].argmax(-1)[:, None]
    assert tokens == model.generate(PROMPTS, 5)


def test_exported_prefill_of_right_padded_prompts_equals_eager() -> None:
    model = make_gpt()
    T0 = 6
    tokens = torch.randint(0, VOCAB, (3, T0))
    mask = right_mask([6, 3, 1], T0)
    eager = CachedGPT(model, batch_size=3, max_len=16)
    with torch.no_grad():  # the cache is inference-only
        ep = torch.export.export(copy.deepcopy(eager), (tokens, mask))
    exported = ep.module()
    with torch.no_grad():
        assert max_err(exported(tokens, mask), eager(tokens, mask)) <= 1e-5
    for name, buffer in eager.named_buffers():
        assert max_err(dict(exported.named_buffers())[name], buffer) <= 1e-5, name
    assert eager.lengths0.tolist() == [6, 3, 1]


def test_cached_gpt_length_is_static() -> None:
    """The number of new tokens is an int of the engine's cache_end op, so t cannot be dynamic:
    the documented reason why prefill and decode are two programs."""
    model = make_gpt()
    step = CachedGPT(model, batch_size=2, max_len=16)
    tokens = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad(), pytest.raises(Exception, match="specialized it to be a constant"):
        torch.export.export(step, (tokens,), dynamic_shapes=({1: torch.export.Dim("t", max=16)},))


def test_cached_gpt_refuses_a_max_len_past_the_models() -> None:
    """Positions past the model's max_len do not exist: a longer cache is refused, naming max_len."""
    model = make_gpt()
    limit = model.config.max_len
    assert CachedGPT(model, batch_size=1, max_len=limit).k0.shape[2] == limit
    with pytest.raises(ValueError, match=rf"max_len must be an int in 1..config.max_len={limit}; got {2 * limit}"):
        CachedGPT(model, batch_size=1, max_len=2 * limit)


def test_cached_gpt_rejects_a_model_that_is_not_a_gpt() -> None:
    with pytest.raises(TypeError, match="model must be a causal_attention.GPT"):
        CachedGPT(torch.nn.Linear(2, 2), batch_size=1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# AOTInductor: packages with the engine's ops inside, loaded back in Python.


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Four packages (layer and GPT, with and without a mask input), compiled once."""
    out = tmp_path_factory.mktemp("aoti")
    built: dict[str, tuple[torch.nn.Module, Path]] = {}
    for padded in (False, True):
        layer = make_layer(torch.float32)
        example = layer_inputs(2, 8, [8, 5] if padded else None, torch.float32)
        model = make_gpt()
        gpt_example = gpt_inputs(2, 8, [8, 5] if padded else None)
        for name, module, args, shapes in (
            ("layer", layer, example, dynamic_shapes(with_mask=padded)),
            ("gpt", model, gpt_example, dynamic_shapes(with_mask=padded, max_len=MAX_LEN)),
        ):
            with torch.no_grad():
                ep = torch.export.export(module, args, dynamic_shapes=shapes)
                path = torch._inductor.aoti_compile_and_package(ep, package_path=str(out / f"{name}_{padded}.pt2"))
            built[f"{name}_{'mask' if padded else 'no_mask'}"] = (module, Path(path))
    return built


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("kind", ["layer", "gpt"])
def test_aoti_package_equals_eager(packages: dict[str, tuple[torch.nn.Module, Path]], kind: str, padded: bool) -> None:
    module, path = packages[f"{kind}_{'mask' if padded else 'no_mask'}"]
    loaded = torch._inductor.aoti_load_package(str(path))
    for shape in (EXAMPLE, OTHER, dict(B=1, T=40, lengths=[29])):
        lengths = shape["lengths"] if padded else None
        if kind == "layer":
            inputs = layer_inputs(shape["B"], shape["T"], lengths, torch.float32)
        else:
            inputs = gpt_inputs(shape["B"], shape["T"], lengths)
        with torch.no_grad():
            assert max_err(loaded(*inputs), module(*inputs)) <= 1e-5


def test_aoti_decode_step_mutates_user_managed_caches(tmp_path: Path) -> None:
    """The decode step as an AOTInductor package: its cache buffers are constants, replaced by the
    caller's tensors (load_constants(user_managed=True)), which each call updates in place."""
    model = make_gpt()
    eager, last = _prefilled(model, max_len=24)
    nxt = last.argmax(-1)[:, None]  # (B, 1)
    with torch.no_grad():
        ep = torch.export.export(copy.deepcopy(eager), (nxt,))
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "decode.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    caches = {name: buffer.clone() for name, buffer in eager.named_buffers()}  # the prefilled state
    loaded.load_constants(caches, check_full_update=False, user_managed=True)
    for _ in range(4):
        with torch.no_grad():
            want, got = eager(nxt), loaded(nxt)
        assert max_err(got, want) <= 1e-5
        for name, buffer in eager.named_buffers():
            assert max_err(caches[name], buffer) <= 1e-5, name
        nxt = want[:, -1].argmax(-1)[:, None]
    assert caches["lengths0"].tolist() == [len(p) + 4 for p in PROMPTS]
