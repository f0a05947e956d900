"""GPT: packing of real tokens, last_logits, generation, compile, dropout and GPTConfig checks."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from causal_attention.models import GPT, GPTConfig
from helpers import rel_err

F64 = torch.float64
LENGTHS = [23, 17, 1, 9]  # right padding, T = 23


def small_config(**overrides: object) -> GPTConfig:
    values: dict[str, object] = dict(vocab_size=53, max_len=48, dim=48, n_layers=2, n_heads=4)
    values.update(overrides)
    return GPTConfig(**values)  # type: ignore[arg-type]


def random_gpt(config: GPTConfig | None = None, dtype: torch.dtype = F64) -> GPT:
    """A GPT with every parameter perturbed (biases away from 0, LayerNorm weights from 1)."""
    model = GPT(config or small_config()).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def right_padded(lengths: list[int], vocab: int = 53) -> tuple[Tensor, Tensor]:
    T = max(lengths)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    return torch.randint(0, vocab, (len(lengths), T)), mask


def test_packed_forward_equals_each_sequence_alone():
    """The padded batch takes the packed path (per-token work on real tokens only): its logits at
    real positions equal a run of each sequence alone, unpadded; padding logits are exactly 0;
    the gradients of a loss on real positions equal the sum of the per-sequence gradients."""
    model = random_gpt()
    tokens, mask = right_padded(LENGTHS)
    weights = torch.randn(*tokens.shape, 53, dtype=F64)
    logits = model(tokens, mask)
    assert logits.shape == (4, 23, 53)
    assert torch.count_nonzero(logits[~mask]) == 0
    (logits * weights)[mask].sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    model.zero_grad()
    total = torch.zeros((), dtype=F64)
    for b, n in enumerate(LENGTHS):
        alone = model(tokens[b : b + 1, :n])  # (1, n, V): no mask, nothing to pack
        assert rel_err(logits[b, :n], alone[0]) <= 1e-12, b
        total = total + (alone[0] * weights[b, :n]).sum()
    total.backward()
    for name, p in model.named_parameters():
        assert rel_err(packed_grads[name], p.grad) <= 1e-12, name


def test_padding_tokens_and_mask_types_do_not_matter():
    model = random_gpt()
    tokens, mask = right_padded(LENGTHS)
    with torch.no_grad():
        logits = model(tokens, mask)
        other = torch.where(mask, tokens, torch.randint(0, 53, tokens.shape))
        assert torch.equal(model(other, mask), logits)  # what sits at padding is never read
        assert torch.equal(model(tokens, mask.long()), logits)  # a tokenizer's attention_mask
        full = model(tokens, torch.ones_like(mask))  # all real: the unpacked path
        assert rel_err(full[0], model(tokens[:1])[0]) <= 1e-12


def test_any_padding_pattern_matches_the_unpacked_computation():
    """Padding not at the right end (position 0 real): the packed path against the unpacked one
    (return_attention runs every position through the reference)."""
    model = random_gpt()
    tokens = torch.randint(0, 53, (3, 19))
    mask = torch.rand(3, 19) < 0.6
    mask[:, 0] = True
    with torch.no_grad():
        packed = model(tokens, mask)
        unpacked, maps = model(tokens, mask, return_attention=True)
    assert len(maps) == 2 and maps[0].shape == (3, 4, 19, 19)
    assert rel_err(packed[mask], unpacked[mask]) <= 1e-12
    assert torch.count_nonzero(packed[~mask]) == 0 and torch.count_nonzero(unpacked[~mask]) == 0


def test_compiled_forward_with_padding_equals_eager():
    """torch.compile(fullgraph=True) keeps static shapes: it takes the unpacked path (every position
    computed, padding logits zeroed) and equals the eager packed path at real positions. The
    aot_eager backend traces through dynamo and AOTAutograd with the engine's fake kernels; inductor
    code generation for the ops is covered by test_kernel and test_compile."""
    torch._dynamo.reset()
    model = random_gpt(small_config(n_layers=1))
    tokens, mask = right_padded(LENGTHS)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = model(tokens, mask)
        out = compiled(tokens, mask)
    assert rel_err(out[mask], eager[mask]) <= 1e-12
    assert torch.count_nonzero(out[~mask]) == 0


def test_compiled_with_dynamic_shapes_does_not_recompile_around_the_decode_row_count():
    """torch.compile(dynamic=True) of the GPT under no_grad: batches of 2 x 3 tokens, then 3 x 5 and
    4 x 7 (6 rows, then over FEW_ROWS = 8) run on one graph. The decode path's row-count check is
    skipped while tracing before the count is compared (the comparison guarded on B * T, and every
    crossing of 8 recompiled)."""
    torch._dynamo.reset()
    model = random_gpt(small_config(n_layers=1))
    compiled = torch.compile(model, dynamic=True, backend="eager")
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for B, T in ((2, 3), (3, 5), (4, 7)):
            tokens = torch.randint(0, model.config.vocab_size, (B, T))
            assert rel_err(compiled(tokens), model(tokens)) <= 1e-12


@pytest.mark.parametrize("lengths", [LENGTHS, [23, 23, 23]], ids=["ragged", "full"])
def test_last_logits_are_the_logits_at_the_last_real_token(lengths):
    model = random_gpt()
    tokens, mask = right_padded(lengths)
    lens = torch.tensor(lengths)
    with torch.no_grad():
        last = model.last_logits(tokens, lens)  # (B, V)
        full = model(tokens, mask)
    assert last.shape == (len(lengths), 53)
    assert rel_err(last, full[torch.arange(len(lengths)), lens - 1]) <= 1e-12


def test_generate_with_and_without_cache_agree_and_do_not_depend_on_the_batch():
    model = random_gpt(small_config(vocab_size=97))
    prompts = [[5, 17, 3, 90, 42, 8, 8], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [60, 61]]
    cached = model.generate(prompts, 12)
    assert cached == model.generate(prompts, 12, use_cache=False)
    assert [len(g) for g in cached] == [12] * 4
    for p, g in zip(prompts, cached):
        assert model.generate([p], 12) == [g]
    # An eos that sequence 1 produces: it stops there, the others run on.
    eos = cached[1][2]
    stopped = model.generate(prompts, 12, eos_id=eos)
    for full, cut in zip(cached, stopped):
        n = full.index(eos) + 1 if eos in full else len(full)
        assert cut == full[:n]


def test_generate_argument_errors():
    model = random_gpt()
    with pytest.raises(ValueError, match="non-empty"):
        model.generate([[1], []], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate([[1]], 0)
    with pytest.raises(ValueError, match="top_k"):
        model.generate([[1]], 3, top_k=54)
    with pytest.raises(ValueError, match="exceeds max_len=48"):
        model.generate([[1] * 40], 10)
    # The C++ program's rule and message: 0 is not greedy (top_k=None is).
    for temperature in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature must be positive; got"):
            model.generate([[1]], 3, top_k=2, temperature=temperature)
    with pytest.raises(ValueError, match=r"prompts\[0\]\[1\] must be an int token id; got 12.5"):
        model.generate([[1, 12.5]], 3)
    with pytest.raises(ValueError, match=r"prompts\[1\]\[0\] must be an int token id; got True"):
        model.generate([[1], [True]], 3)
    with pytest.raises(ValueError, match="integer tensor; got torch.float32"):
        model.generate(torch.ones(2, 3), 3)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_token_ids_outside_the_vocabulary_name_the_argument(use_cache: bool):
    """eos_id, pad_id and prompt tokens must be ids of the model's vocabulary (0..52): each error
    names its argument and the range, before any work."""
    model = random_gpt()  # vocab_size 53
    for eos_id in (-5, 53, 1000):
        with pytest.raises(ValueError, match=rf"eos_id must be a token id in 0..vocab_size-1 = 0..52; got {eos_id}"):
            model.generate([[1]], 2, eos_id=eos_id, use_cache=use_cache)
    with pytest.raises(ValueError, match=r"pad_id must be a token id in 0..vocab_size-1 = 0..52; got 1000"):
        model.generate([[1], [1, 2]], 2, pad_id=1000, use_cache=use_cache)
    with pytest.raises(ValueError, match=r"eos_id must be a token id .*; got True"):
        model.generate([[1]], 2, eos_id=True, use_cache=use_cache)
    with pytest.raises(ValueError, match=r"prompts\[1\]\[2\] = 64 is not a token id: token ids are in "
                                         r"0..vocab_size-1 = 0..52"):
        model.generate([[1], [1, 2, 64]], 2, use_cache=use_cache)
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\] = -1 is not a token id"):
        model.generate(torch.tensor([[-1, 2]]), 2, use_cache=use_cache)
    # The range's ends are ids.
    assert len(model.generate([[0, 52]], 2, eos_id=52, pad_id=52, use_cache=use_cache)[0]) >= 1


def test_make_caches_refuses_a_max_len_past_the_models():
    """Positions past config.max_len do not exist: a cache longer than that is refused, naming max_len."""
    model = random_gpt()  # max_len 48
    assert [c.max_len for c in model.make_caches(2, 48)] == [48] * len(model.blocks)
    for max_len in (49, 0, -1, 2.5):
        with pytest.raises(ValueError, match=rf"max_len must be an int in 1..config.max_len=48; got {max_len}"):
            model.make_caches(2, max_len)


def test_generate_takes_a_tensor_of_prompts():
    model = random_gpt()
    prompts = torch.randint(0, 53, (3, 5))
    expected = model.generate(prompts.tolist(), 4)
    assert model.generate(prompts, 4) == expected
    assert model.generate(list(prompts), 4) == expected  # a list of 1-D tensors


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_prompt_of_max_len_tokens_gets_one_token(use_cache: bool):
    """The logits at the prompt's last position need no new position: max_len - n + 1 tokens fit."""
    model = random_gpt()  # max_len 48
    prompts = [torch.randint(0, 53, (48,)).tolist(), [3, 4]]
    with torch.no_grad():
        last = model(torch.tensor([prompts[0]]))[0, -1]
    assert model.generate(prompts, 1, use_cache=use_cache)[0] == [int(last.argmax())]
    out = model.generate([prompts[0][:40]], 9, use_cache=use_cache)
    assert len(out[0]) == 9


@pytest.mark.parametrize("field", ["resid_dropout", "embd_dropout"])
def test_dropout_acts_in_training_only(field):
    config = small_config(**{field: 0.3})
    model = random_gpt(config)
    plain = GPT(small_config()).double().eval()
    plain.load_state_dict(model.state_dict())
    tokens, mask = right_padded(LENGTHS)
    with torch.no_grad():
        reference = plain(tokens, mask)
        assert torch.equal(model(tokens, mask), model(tokens, mask))  # eval: deterministic
        assert rel_err(model(tokens, mask), reference) <= 1e-12  # and dropout-free
        model.train()
        a, b = model(tokens, mask), model(tokens, mask)
    assert rel_err(a[mask], reference[mask]) > 1e-3 and rel_err(a[mask], b[mask]) > 1e-3
    assert torch.count_nonzero(a[~mask]) == 0


def test_attention_dropout_acts_in_training_and_is_reproducible():
    """GPTConfig.attn_dropout reaches every layer's fused kernel: training outputs vary from call to
    call, torch.manual_seed reproduces them bitwise, eval mode is deterministic."""
    model = random_gpt(small_config(attn_dropout=0.3)).train()
    assert all(block.attn.dropout == 0.3 for block in model.blocks)
    tokens, mask = right_padded(LENGTHS)
    with torch.no_grad():
        a, b = model(tokens, mask), model(tokens, mask)
        torch.manual_seed(5)
        c = model(tokens, mask)
        torch.manual_seed(5)
        d = model(tokens, mask)
        model.eval()
        e, f = model(tokens, mask), model(tokens, mask)
    assert rel_err(a[mask], b[mask]) > 1e-3
    assert torch.equal(c, d) and torch.equal(e, f)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(vocab_size=0), "vocab_size"),
        (dict(max_len=-1), "max_len"),
        (dict(dim=True), "dim"),
        (dict(n_layers=2.0), "n_layers"),
        (dict(n_heads=5), "n_heads=5 must divide dim=48"),
        (dict(mlp_hidden=0), "mlp_hidden"),
        (dict(activation="relu"), "activation"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps"),
        (dict(layer_norm_eps=float("inf")), "layer_norm_eps must be a positive finite float; got inf"),
        (dict(layer_norm_eps=float("nan")), "layer_norm_eps must be a positive finite float; got nan"),
        (dict(positions="rope", rope_theta=float("inf")), "rope_theta must be a positive finite number; got inf"),
        (dict(positions="rope", rope_theta=float("nan")), "rope_theta must be a positive finite number; got nan"),
        (dict(rope_theta=float("-inf")), "rope_theta must be a positive finite number; got -inf"),
        (dict(attn_dropout=1.0), "attn_dropout"),
        (dict(resid_dropout=-0.1), "resid_dropout"),
        (dict(embd_dropout=True), "embd_dropout"),
        (dict(bias=1), "bias"),
        (dict(tie_head="yes"), "tie_head"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        small_config(**overrides)


def test_config_dict_round_trip_and_gpt2_defaults():
    config = small_config(mlp_hidden=80, activation="gelu_tanh", tie_head=False, resid_dropout=0.1)
    assert GPTConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown option.*'n_experts'"):
        GPTConfig.from_dict({**config.to_dict(), "n_experts": 2})
    gpt2 = GPTConfig.gpt2()
    assert (gpt2.vocab_size, gpt2.max_len, gpt2.dim, gpt2.n_layers, gpt2.n_heads, gpt2.hidden) == (50257, 1024, 768, 12, 12, 3072)
    assert gpt2.activation == "gelu_tanh" and gpt2.tie_head and gpt2.bias
    assert GPTConfig.gpt2(n_layers=2).n_layers == 2
    with pytest.raises(TypeError, match="GPTConfig"):
        GPT({"vocab_size": 11})  # type: ignore[arg-type]


def test_module_structure_follows_the_config():
    untied = GPT(small_config(tie_head=False, bias=False, mlp_hidden=80))
    names = set(untied.state_dict())
    assert "head.weight" in names and not any(n.endswith(".bias") for n in names)
    assert untied.blocks[0].mlp[0].weight.shape == (80, 48)
    assert untied.head_weight is untied.head.weight
    tied = GPT(small_config())
    assert "head.weight" not in tied.state_dict() and tied.head_weight is tied.tok.weight
    gelu = {type(m) for m in tied.modules()} & {nn.GELU}
    assert gelu and tied.blocks[0].mlp[1].approximate == "none"
    assert GPT(small_config(activation="gelu_tanh")).blocks[0].mlp[1].approximate == "tanh"
    with pytest.raises(ValueError, match="tokens must be an int64 or int32"):
        tied(torch.zeros(2, 3))


@pytest.mark.parametrize("layout", ["right", "left", "holes"])
def test_inference_logits_written_in_place_equal_the_autograd_path(layout: str):
    """Under no_grad a right-padded batch's logits are written per sequence by the head's product
    (other layouts scatter): the same values as with autograd, padding exactly 0."""
    model = random_gpt()
    tokens, mask = right_padded(LENGTHS)
    if layout == "left":
        mask = mask.flip(1)
    elif layout == "holes":
        mask = mask.clone()
        mask[0, 3] = mask[3, 1] = False
    with torch.no_grad():
        fast = model(tokens, mask)
    slow = model(tokens, mask)
    assert slow.requires_grad
    assert rel_err(fast[mask], slow.detach()[mask]) <= 1e-12
    assert torch.equal(fast[~mask], torch.zeros_like(fast[~mask]))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 1, 48), (1, 3, 48), (2, 7, 48)])
def test_few_rows_linear_equals_nn_linear(bias: bool, shape: tuple[int, int, int]):
    """The decode step's Linear (W x^T for a few rows, inference) equals nn.Linear; with autograd or
    more rows it is nn.Linear itself."""
    from causal_attention.attention.decode import FEW_ROWS, few_rows_linear

    layer = nn.Linear(48, 80, bias=bias, dtype=F64)
    x = torch.randn(*shape, dtype=F64)
    with torch.no_grad():
        fast = few_rows_linear(layer, x)
    assert fast.shape == (*shape[:2], 80)
    assert rel_err(fast, layer(x).detach()) <= 1e-14
    assert (shape[0] * shape[1] <= FEW_ROWS) or torch.equal(fast, layer(x).detach())
    assert few_rows_linear(layer, x).requires_grad  # autograd: nn.Linear's path


# ---------------------------------------------------------------------------------------------
# float32 logits of half models


def _tied_head_gpt(dtype: torch.dtype, prompt: list[int]) -> GPT:
    """A half GPT (untied head) whose logits for tokens 0 and 1 after `prompt` differ by less than
    dtype's step at their size: token 1 is the larger in float32 and float64, but both round to the
    same value in dtype, where argmax takes the first (token 0). Head row 1 is row 0 with one
    element one step further along h's sign, at the first coordinate (by |h|) that keeps the tie."""
    torch.manual_seed(3)
    model = random_gpt(small_config(vocab_size=40, tie_head=False), dtype)
    with torch.no_grad():
        h, _ = model.hidden_states(torch.tensor([prompt]))
        last = h[0, -1]  # (dim,)
        head = model.head.weight
        head.mul_(0.1)
        head[0] = (last.double() / last.double().norm() * 2).to(dtype)  # logit about 2 |h|: the largest
        for j in last.abs().argsort(descending=True).tolist():
            head[1] = head[0]
            toward = float("inf") if last[j] > 0 else float("-inf")  # raises h . head[1]
            head[1, j] = torch.nextafter(head[0, j].float(), torch.tensor(toward)).to(dtype)
            if head[1, j] == head[0, j]:  # float32's next value rounds back: one step of dtype instead
                step = torch.finfo(dtype).eps * max(float(head[0, j].abs()), torch.finfo(dtype).tiny)
                head[1, j] = head[0, j] + step * (1 if toward > 0 else -1)
            rounded = model.logits(last[None])[0]
            if rounded[0] == rounded[1] and float(last.double() @ (head[1].double() - head[0].double())) > 0:
                return model
    raise AssertionError("no coordinate keeps the rounded logits tied")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_generate_chooses_from_float32_logits_of_a_half_model(dtype: torch.dtype):
    """Greedy generate of a bfloat16/half model follows the head's float32 sums by default: two
    logits that round to the same half value are told apart as the float64 truth tells them."""
    prompt = [5, 17, 3, 30, 2]
    model = _tied_head_gpt(dtype, prompt)
    with torch.no_grad():
        h, _ = model.hidden_states(torch.tensor([prompt]))
        exact = h[0, -1].double() @ model.head.weight.double().t()  # (V,)
        rounded = model.logits(h[0, -1:])[0]
        unrounded = model.logits(h[0, -1:], float32=True)[0]
    assert exact.argmax() == 1 and exact[1] > exact[0]
    assert rounded.dtype == dtype and rounded[0] == rounded[1]  # the tie the rounding makes
    assert unrounded.dtype == torch.float32 and unrounded[1] > unrounded[0]
    for use_cache in (True, False):
        assert model.generate([prompt], 1, use_cache=use_cache) == [[1]]
        assert model.generate([prompt], 1, use_cache=use_cache, float32_logits=False) == [[0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_float32_logits_are_the_heads_sums_before_rounding(dtype: torch.dtype):
    """forward(float32_logits=True) of a half model: float32 logits within float32's summation
    bound of the float64 product of the same hidden states, zeros at padding, on every path (packed
    padding, full batch, caches, autograd); rounded to the dtype, within a step of the default."""
    model = random_gpt(small_config(), dtype)
    tokens, mask = right_padded(LENGTHS)
    dim = model.config.dim

    def check(logits: Tensor, h: Tensor) -> None:  # h (..., dim) -> logits (..., V)
        assert logits.dtype == torch.float32
        exact = h.double() @ model.head_weight.double().t()
        bound = (dim + 1) * torch.finfo(torch.float32).eps * (h.double().abs() @ model.head_weight.double().abs().t())
        assert bool(((logits.double() - exact).abs() <= bound).all())

    with torch.no_grad():
        h, packing = model.hidden_states(tokens, mask)
        assert packing is not None
        padded = model(tokens, mask, float32_logits=True)  # (B, T, V)
        check(padded[mask], h)
        assert torch.equal(padded[~mask], torch.zeros_like(padded[~mask]))
        default = model(tokens, mask)
        step = torch.finfo(dtype).eps * default[mask].float().abs() + torch.finfo(dtype).tiny
        assert bool(((padded[mask].to(dtype).float() - default[mask].float()).abs() <= step).all())
        full_h, _ = model.hidden_states(tokens)
        check(model(tokens, float32_logits=True), full_h)
        lengths = mask.sum(1)
        check(model.last_logits(tokens, lengths, float32_logits=True), h.index_select(0, lengths.cumsum(0) - 1))
    train = model(tokens, mask, float32_logits=True)  # autograd: F.linear on the widenings
    assert train.requires_grad and train.dtype == torch.float32
    (g,) = torch.autograd.grad(train[mask].sum(), model.head_weight)
    assert g.dtype == dtype and bool(g.isfinite().all()) and bool((g != 0).any())


def test_float32_logits_of_a_decode_step_and_under_autocast():
    """A cached decode step's float32 logits (the streamed head, unrounded), and the same under CPU
    autocast, which must not round the product back to bfloat16."""
    model = random_gpt(small_config(), torch.bfloat16)
    tokens, _ = right_padded([9, 9])
    with torch.no_grad():
        caches = model.make_caches(2, 16)
        model.hidden_states(tokens, caches=caches)
        step = torch.tensor([[3], [7]])
        h, _ = model.hidden_states(step, caches=caches)  # (2, 1, dim): a decode step
    with torch.no_grad():
        logits = model.logits(h[:, 0], float32=True)
        exact = h[:, 0].double() @ model.head_weight.double().t()
        bound = 49 * torch.finfo(torch.float32).eps * (h[:, 0].double().abs() @ model.head_weight.double().abs().t())
        assert logits.dtype == torch.float32 and bool(((logits.double() - exact).abs() <= bound).all())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model.logits(h[:, 0], float32=True).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(tokens, float32_logits=True).dtype == torch.float32


def test_float32_logits_leave_float_models_alone():
    model = random_gpt(small_config(), torch.float32)
    tokens, mask = right_padded(LENGTHS)
    with torch.no_grad():
        assert torch.equal(model(tokens, mask, float32_logits=True), model(tokens, mask))
