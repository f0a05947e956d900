"""Exact converters between GPT and transformers' GPT-2 and nanoGPT (checkpoint.py holds the
project's own files).

- ``from_huggingface(src)``: a GPT2LMHeadModel / GPT2Model, its state_dict, or a save_pretrained
  directory (config.json + model.safetensors or its sharded index); ``to_huggingface_state_dict``.
  transformers' Conv1D stores weights (in, out): they are transposed into nn.Linear's (out, in).
- ``from_nanogpt(src)``: the dict nanoGPT's train.py saves ({'model', 'model_args', ...}), a path to
  it, or a state_dict; ``_orig_mod.`` prefixes (torch.compile) are removed and the causal-mask
  buffers ``attn.bias`` are checked and dropped; ``to_nanogpt_state_dict``.

Every copy is exact (transposes and renames only). Every mismatch is an error naming the key or
option: a missing or unexpected tensor, a wrong shape, heads that do not divide the width, an
architecture option GPT lacks. Nothing is downloaded: transformers is imported only to read a
model object's config or to build one (``to_huggingface``).
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import convert_llama
from .checkpoint import CheckpointError, check_sizes, load, load_strict, save
from .config import GPTConfig
from .gpt import GPT


def _model_like(config: GPTConfig, state: Mapping[str, Tensor]) -> GPT:
    """An empty GPT for config in the dtype of the checkpoint's weights (float32 if mixed)."""
    dtypes = {t.dtype for t in state.values() if isinstance(t, Tensor) and t.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return GPT.empty(config, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# transformers' GPT-2.

# GPT2Config options that GPT has no counterpart for, with the value GPT implements.
_HF_REQUIRED = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}
_HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def config_from_huggingface(values: Mapping[str, Any], *, source: str | None = None) -> GPTConfig:
    """GPTConfig from a GPT2Config, LlamaConfig, Qwen2Config or MistralConfig (as a dict); an option
    GPT cannot represent, or a value of the wrong JSON type, is an error naming it (and source, the
    config.json read, where given)."""
    hf = convert_llama.HfOptions(values, source=source)
    model_type = hf.text("model_type", "gpt2")
    if model_type in convert_llama.MODEL_TYPES:
        return convert_llama.config_from_huggingface_llama(values, source=source)
    if model_type != "gpt2":
        raise hf.error(f"model_type {model_type!r} is not supported: GPT reads GPT-2, Llama, Qwen2 and Mistral "
                       "checkpoints (model_type 'gpt2', 'llama', 'qwen2', 'mistral')")
    for option, value in _HF_REQUIRED.items():
        if hf.boolean(option, value) != value:
            raise hf.error(f"GPT-2 option {option}={values[option]!r} is not supported "
                           f"(GPT implements {option}={value})")
    activation = hf.text("activation_function", "gelu_new")
    if activation not in _HF_ACTIVATIONS:
        raise hf.error(f"GPT-2 option activation_function={activation!r} is not supported "
                       f"(one of {sorted(_HF_ACTIVATIONS)})")
    n_embd, n_head = hf.integer("n_embd", 768), hf.integer("n_head", 12)
    if n_head <= 0 or n_embd % n_head != 0:
        raise hf.error(f"GPT-2 config: n_head={n_head} does not divide n_embd={n_embd}")
    return GPTConfig(
        vocab_size=hf.integer("vocab_size", 50257),
        max_len=hf.integer("n_positions", 1024),
        dim=n_embd,
        n_layers=hf.integer("n_layer", 12),
        n_heads=n_head,
        mlp_hidden=hf.integer("n_inner", None),
        layer_norm_eps=hf.number("layer_norm_epsilon", 1e-5),
        activation=_HF_ACTIVATIONS[activation],  # type: ignore[arg-type]
        bias=True,
        tie_head=hf.boolean("tie_word_embeddings", True),
        attn_dropout=hf.number("attn_pdrop", 0.1),
        resid_dropout=hf.number("resid_pdrop", 0.1),
        embd_dropout=hf.number("embd_pdrop", 0.1),
    )


def config_to_huggingface(config: GPTConfig) -> dict[str, Any]:
    """The GPT2Config keyword arguments describing config (bias=False has no GPT-2 counterpart); for
    a Llama-family config, its LlamaConfig / Qwen2Config / MistralConfig's, with model_type."""
    if convert_llama.is_llama_family(config):
        model_type, values = convert_llama.config_to_huggingface_llama(config)
        return {"model_type": model_type, **values}
    if config.llama_options:
        raise CheckpointError(f"GPT-2 has none of the Llama family's options; this model sets {config.llama_options}")
    if config.activation not in ("gelu", "gelu_tanh"):
        raise CheckpointError(f"GPT-2 has no activation {config.activation!r} (gelu_new or gelu)")
    if not config.bias:
        raise CheckpointError("GPTConfig.bias=False has no GPT-2 counterpart (GPT-2 has biases everywhere)")
    return dict(
        vocab_size=config.vocab_size, n_positions=config.max_len, n_embd=config.dim, n_layer=config.n_layers,
        n_head=config.n_heads, n_inner=config.mlp_hidden, layer_norm_epsilon=config.layer_norm_eps,
        activation_function="gelu_new" if config.activation == "gelu_tanh" else "gelu",
        tie_word_embeddings=config.tie_head, attn_pdrop=config.attn_dropout, resid_pdrop=config.resid_dropout,
        embd_pdrop=config.embd_dropout,
    )


# (ours, theirs, transposed: Conv1D (in, out) <-> Linear (out, in)) for block i.
def _block_names(i: int, *, transpose: bool, bias: bool) -> list[tuple[str, str, bool]]:
    pairs = [("ln1", "ln_1", False), ("attn.qkv", "attn.c_attn", transpose), ("attn.proj", "attn.c_proj", transpose),
             ("ln2", "ln_2", False), ("mlp.0", "mlp.c_fc", transpose), ("mlp.2", "mlp.c_proj", transpose)]
    out = []
    for ours, theirs, t in pairs:
        out.append((f"blocks.{i}.{ours}.weight", f"h.{i}.{theirs}.weight", t))
        if bias:
            out.append((f"blocks.{i}.{ours}.bias", f"h.{i}.{theirs}.bias", False))
    return out


def _names(config: GPTConfig, *, transpose: bool) -> list[tuple[str, str, bool]]:
    """Our names against GPT-2's / nanoGPT's (without the 'transformer.' prefix, head aside)."""
    names = [("tok.weight", "wte.weight", False), ("pos.weight", "wpe.weight", False)]
    for i in range(config.n_layers):
        names += _block_names(i, transpose=transpose, bias=config.bias)
    names.append(("ln_f.weight", "ln_f.weight", False))
    if config.bias:
        names.append(("ln_f.bias", "ln_f.bias", False))
    return names


def _rename(state: Mapping[str, Tensor], config: GPTConfig, *, transpose: bool, prefix: str, source: str,
            head_key: str, ignore: re.Pattern[str] | None) -> tuple[dict[str, Tensor], dict[str, tuple[str, bool]]]:
    """Their state (with prefix) -> (ours, origin: our name -> (their key, transposed)); unexpected
    and missing keys are errors naming them."""
    ours: dict[str, Tensor] = {}
    origin: dict[str, tuple[str, bool]] = {}
    used: set[str] = set()
    for mine, theirs, t in _names(config, transpose=transpose):
        key = prefix + theirs
        if key not in state:
            raise CheckpointError(f"{source}: missing tensor {key!r}")
        value = state[key]
        ours[mine] = value.t() if t else value
        origin[mine] = (key, t)
        used.add(key)
    if head_key in state:
        used.add(head_key)
        head = state[head_key]
        if config.tie_head:
            if not torch.equal(head, state[prefix + "wte.weight"]):
                raise CheckpointError(f"{source}: {head_key!r} differs from {prefix}wte.weight but the head is tied")
        else:
            ours["head.weight"] = head
            origin["head.weight"] = (head_key, False)
    elif not config.tie_head:
        raise CheckpointError(f"{source}: missing tensor {head_key!r} (the head is not tied)")
    unexpected = sorted(k for k in state if k not in used and not (ignore is not None and ignore.search(k)))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    return ours, origin


# GPT-2 checkpoints written by older transformers hold the causal mask as buffers.
_HF_BUFFERS = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$")


def _check_mask_buffers(state: Mapping[str, Tensor], pattern: re.Pattern[str], source: str) -> None:
    """Stored causal-mask buffers must be the causal mask (anything else is an architecture GPT lacks)."""
    for key, value in state.items():
        if pattern.search(key) and key.endswith(".bias") and value.dim() >= 2:
            T = value.shape[-1]
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            if not torch.equal(value.reshape(-1, T, T)[0].bool(), causal):
                raise CheckpointError(f"{source}: {key!r} is not the causal mask; GPT implements causal attention only")


def _converted(state: Mapping[str, Tensor], config: GPTConfig, *, transpose: bool, prefix: str, source: str,
               buffers: re.Pattern[str]) -> GPT:
    """A GPT for config holding their state (GPT-2's or nanoGPT's names; causal-mask buffers
    matching `buffers` checked, then dropped), every tensor checked and named in their layout."""
    _check_mask_buffers(state, buffers, source)
    ours, origin = _rename(state, config, transpose=transpose, prefix=prefix, source=source,
                           head_key="lm_head.weight", ignore=buffers)
    return load_strict(_model_like(config, ours), ours, source=source, origin=origin)


def _hf_prefix(state: Mapping[str, Tensor]) -> str:
    return "transformer." if any(k.startswith("transformer.") for k in state) else ""


def _config_from_shapes(state: Mapping[str, Tensor], prefix: str, n_heads: int | None, *, transpose: bool,
                        source: str) -> dict[str, Any]:
    """vocab, positions, width, layers, MLP width and bias from the tensors; heads default to
    width // 64 (every GPT-2 size) unless given."""
    try:
        vocab, dim = state[prefix + "wte.weight"].shape
        max_len = state[prefix + "wpe.weight"].shape[0]
        fc = state[prefix + "h.0.mlp.c_fc.weight"]
    except KeyError as exc:
        raise CheckpointError(f"{source}: missing tensor {exc.args[0]!r}") from None
    layers = {int(m.group(1)) for k in state if (m := re.match(re.escape(prefix) + r"h\.(\d+)\.", k))}
    hidden = fc.shape[1] if transpose else fc.shape[0]
    heads = n_heads if n_heads is not None else max(1, dim // 64)
    return dict(vocab_size=vocab, max_len=max_len, dim=dim, n_layers=len(layers), n_heads=heads,
                mlp_hidden=None if hidden == 4 * dim else hidden, bias=prefix + "ln_f.bias" in state)


def _hf_state_and_config(source: Any, n_heads: int | None) -> tuple[dict[str, Tensor], GPTConfig | None, str]:
    """(state_dict, config or None, a name for errors) from a model, a state_dict or a directory."""
    if isinstance(source, (str, Path)):
        directory = Path(source)
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory}: not a directory (from_huggingface takes a save_pretrained directory)")
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found (from_huggingface takes a save_pretrained directory)")
        hf = json.loads(config_path.read_text())
        config = config_from_huggingface(hf, source=str(config_path))  # before the weights: no read if unsupported
        return _read_safetensors_dir(directory), config, str(directory)
    if isinstance(source, Mapping):
        return dict(source), None, "state_dict"
    config = getattr(source, "config", None)
    if config is not None and hasattr(source, "state_dict"):
        name = type(source).__name__
        if name not in ("GPT2LMHeadModel", "GPT2Model", *convert_llama.MODEL_TYPES.values()):
            raise CheckpointError(f"from_huggingface reads GPT2LMHeadModel, GPT2Model, "
                                  f"{', '.join(convert_llama.MODEL_TYPES.values())}; got {name}")
        return dict(source.state_dict()), config_from_huggingface(config.to_dict()), name
    raise TypeError(
        f"from_huggingface takes a GPT2LMHeadModel / GPT2Model, a Llama / Qwen2 / Mistral ForCausalLM, a state_dict "
        f"or a directory; got {type(source).__name__}"
    )


def _read_safetensors_dir(directory: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        state: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(load_file(str(directory / shard)))
        missing = sorted(set(weight_map) - set(state))
        if missing:
            raise CheckpointError(f"{index}: tensor(s) {missing[:8]} listed but not in the shards")
        return state
    raise FileNotFoundError(f"{directory}: no model.safetensors (or model.safetensors.index.json); only safetensors is read")


def from_huggingface(source: Any, *, n_heads: int | None = None) -> GPT:
    """A GPT holding transformers' GPT-2, Llama, Qwen2 or Mistral weights, exactly (see the module
    docstring and convert_llama.py), in eval mode as from_pretrained's models are (GPT-2's configs
    carry dropout 0.1). A bare state_dict is read as GPT-2's (the Llama family's options are not in
    its tensors: pass the model or its directory)."""
    return _from_huggingface(source, n_heads).eval()


def _from_huggingface(source: Any, n_heads: int | None) -> GPT:
    state, config, name = _hf_state_and_config(source, n_heads)
    if config is not None and convert_llama.is_llama_family(config):
        if n_heads is not None and n_heads != config.n_heads:
            raise CheckpointError(f"n_heads={n_heads} contradicts the checkpoint's config "
                                  f"(num_attention_heads={config.n_heads})")
        return convert_llama.from_huggingface_llama(state, config, name)
    if any(k.startswith("model.layers.") for k in state):
        raise CheckpointError(f"{name}: a Llama-family state_dict; from_huggingface needs its config (pass the model "
                              "or its save_pretrained directory)")
    prefix = _hf_prefix(state)
    if config is None:
        config = GPTConfig.gpt2(**{**_config_from_shapes(state, prefix, n_heads, transpose=True, source=name),
                                   "tie_head": "lm_head.weight" not in state
                                   or torch.equal(state["lm_head.weight"], state[prefix + "wte.weight"])})
    else:
        if n_heads is not None and n_heads != config.n_heads:
            raise CheckpointError(f"n_heads={n_heads} contradicts the checkpoint's config (n_head={config.n_heads})")
        c = config
        # Before the model is built: the config against the tensors, naming the option.
        check_sizes(state, [(prefix + "wte.weight", (c.vocab_size, c.dim), f"config vocab_size={c.vocab_size}, "
                             f"n_embd={c.dim}"),
                            (prefix + "wpe.weight", (c.max_len, c.dim), f"config n_positions={c.max_len}, "
                             f"n_embd={c.dim}"),
                            (prefix + "h.0.mlp.c_fc.weight", (c.dim, c.hidden), f"config n_embd={c.dim}, "
                             f"n_inner={c.mlp_hidden}")],
                    layer_keys=re.compile(re.escape(prefix) + r"h\.(\d+)\."), n_layers=c.n_layers,
                    layers_option=f"config n_layer={c.n_layers}", source=name)
    if not config.bias:
        raise CheckpointError(f"{name}: GPT-2 has biases everywhere; ln_f.bias is missing")
    return _converted(state, config, transpose=True, prefix=prefix, source=name, buffers=_HF_BUFFERS)


def to_huggingface_state_dict(model: GPT) -> dict[str, Tensor]:
    """GPT2LMHeadModel's state_dict (Conv1D weights (in, out); lm_head.weight is the head); for a
    Llama-family model, its LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM state_dict."""
    if convert_llama.is_llama_family(model.config):
        return convert_llama.to_huggingface_state_dict_llama(model)
    config_to_huggingface(model.config)  # errors for what GPT-2 cannot hold
    state = model.state_dict()
    out = {}
    for mine, theirs, t in _names(model.config, transpose=True):
        value = state[mine]
        out["transformer." + theirs] = (value.t() if t else value).contiguous()
    out["lm_head.weight"] = out["transformer.wte.weight"] if model.config.tie_head else state["head.weight"]
    return out


def to_huggingface(model: GPT, **kwargs: Any) -> Any:
    """A transformers GPT2LMHeadModel holding model's weights (kwargs go to GPT2Config, e.g.
    attn_implementation="sdpa"); for a Llama-family model, convert_llama.to_huggingface_llama's."""
    if convert_llama.is_llama_family(model.config):
        return convert_llama.to_huggingface_llama(model, **kwargs)
    from transformers import GPT2Config, GPT2LMHeadModel

    attn_implementation = kwargs.pop("attn_implementation", None)
    # GPT-2's tokenizer's <|endoftext|> (50256) stays the default where the vocabulary holds it.
    ids = convert_llama.token_ids(model.config.vocab_size, kwargs, {"bos_token_id": 50256, "eos_token_id": 50256})
    config = GPT2Config(**{**config_to_huggingface(model.config), **kwargs, **ids})
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    hf = GPT2LMHeadModel(config).to(model.tok.weight.dtype)
    missing, unexpected = hf.load_state_dict(to_huggingface_state_dict(model), strict=False)
    if unexpected or [k for k in missing if not _HF_BUFFERS.search(k)]:
        raise CheckpointError(f"GPT2LMHeadModel: missing {missing}, unexpected {unexpected}")
    return hf


# ---------------------------------------------------------------------------------------------
# nanoGPT (karpathy/nanoGPT model.py and train.py).

_NANO_BUFFERS = re.compile(r"(^|\.)h\.\d+\.attn\.bias$")
_NANO_ARGS = {"n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout"}


def _nanogpt_state(source: Any) -> tuple[dict[str, Tensor], dict[str, Any] | None, str]:
    name = "nanoGPT checkpoint"
    if isinstance(source, (str, Path)):
        name = str(source)
        try:
            source = torch.load(str(source), map_location="cpu", weights_only=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError) as exc:
            # A truncated zip archive is torch's RuntimeError, an empty or text file pickle's errors.
            lines = str(exc).strip().splitlines()
            raise CheckpointError(f"{name}: not a nanoGPT checkpoint (torch.load: "
                                  f"{lines[0] if lines else type(exc).__name__})") from None
    if not isinstance(source, Mapping):
        raise TypeError(f"from_nanogpt takes a checkpoint dict, a path to one, or a state_dict; got {type(source).__name__}")
    if "model" in source and isinstance(source["model"], Mapping):
        state, args = dict(source["model"]), source.get("model_args")
    else:
        state, args = dict(source), None
    unwrapped = {}
    for key, value in state.items():
        while key.startswith("_orig_mod."):  # torch.compile's wrapper, as nanoGPT's train.py strips it
            key = key[len("_orig_mod."):]
        unwrapped[key] = value
    return unwrapped, (dict(args) if args is not None else None), name


def from_nanogpt(source: Any, *, n_heads: int | None = None) -> GPT:
    """A GPT holding a nanoGPT model's weights, exactly (exact GELU, LayerNorm eps 1e-5)."""
    state, args, name = _nanogpt_state(source)
    prefix = "transformer."
    if args is not None:
        unknown = sorted(set(args) - _NANO_ARGS)
        if unknown:
            raise CheckpointError(f"{name}: unknown model_args {unknown} (nanoGPT's are {sorted(_NANO_ARGS)})")
        lacking = sorted(_NANO_ARGS - {"bias", "dropout"} - set(args))  # bias and dropout have defaults
        if lacking:
            raise CheckpointError(f"{name}: model_args lacks {lacking} (nanoGPT's are {sorted(_NANO_ARGS)})")
        options = convert_llama.HfOptions(args, source=f"{name}: model_args")
        n_embd, n_head = options.integer("n_embd"), options.integer("n_head")
        if n_heads is not None and n_heads != n_head:
            raise CheckpointError(f"n_heads={n_heads} contradicts model_args n_head={n_head}")
        if n_head <= 0 or n_embd % n_head != 0:
            raise CheckpointError(f"{name}: model_args n_head={n_head} does not divide n_embd={n_embd}")
        p = options.number("dropout", 0.0)
        try:
            config = GPTConfig(vocab_size=options.integer("vocab_size"), max_len=options.integer("block_size"),
                               dim=n_embd, n_layers=options.integer("n_layer"), n_heads=n_head,
                               bias=options.boolean("bias", True), attn_dropout=p, resid_dropout=p, embd_dropout=p)
        except ValueError as exc:  # a value out of range: GPTConfig's message, naming its field
            raise CheckpointError(f"{name}: model_args: {exc}") from None
        c = config
        # Before the model is built: model_args against the tensors, naming the option.
        check_sizes(state, [(prefix + "wte.weight", (c.vocab_size, c.dim), f"model_args vocab_size={c.vocab_size}, "
                             f"n_embd={c.dim}"),
                            (prefix + "wpe.weight", (c.max_len, c.dim), f"model_args block_size={c.max_len}, "
                             f"n_embd={c.dim}"),
                            (prefix + "h.0.mlp.c_fc.weight", (c.hidden, c.dim), f"model_args n_embd={c.dim}: "
                             "nanoGPT's MLP is 4 * n_embd wide")],
                    layer_keys=re.compile(re.escape(prefix) + r"h\.(\d+)\."), n_layers=c.n_layers,
                    layers_option=f"model_args n_layer={c.n_layers}", source=name)
    else:
        config = GPTConfig(**_config_from_shapes(state, prefix, n_heads, transpose=False, source=name))
    if prefix + "lm_head.weight" in state:
        raise CheckpointError(f"{name}: unexpected tensor 'transformer.lm_head.weight'")
    return _converted(state, config, transpose=False, prefix=prefix, source=name, buffers=_NANO_BUFFERS)


def to_nanogpt_state_dict(model: GPT) -> dict[str, Tensor]:
    """nanoGPT's GPT.state_dict() (without the attn.bias buffers, which its flash path lacks too)."""
    config = model.config
    if config.llama_options:
        raise CheckpointError(f"nanoGPT has none of the Llama family's options; this model sets {config.llama_options}")
    if config.activation != "gelu":
        raise CheckpointError(f"nanoGPT uses the exact GELU; this model's activation is {config.activation!r}")
    if config.mlp_hidden not in (None, 4 * config.dim) or abs(config.layer_norm_eps - 1e-5) > 0:
        raise CheckpointError("nanoGPT's MLP is 4 * dim wide with LayerNorm eps 1e-5; this model differs")
    if not config.tie_head:
        raise CheckpointError("nanoGPT ties its head to the token embedding; this model's head is untied")
    state = model.state_dict()
    out = {"transformer." + theirs: state[mine] for mine, theirs, _ in _names(config, transpose=False)}
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def nanogpt_model_args(model: GPT) -> dict[str, Any]:
    """The 'model_args' nanoGPT's train.py stores (dropout: attention's; nanoGPT has one rate)."""
    c = model.config
    if c.llama_options:
        raise CheckpointError(f"nanoGPT has none of the Llama family's options; this model sets {c.llama_options}")
    if not c.attn_dropout == c.resid_dropout == c.embd_dropout:
        raise CheckpointError(
            f"nanoGPT has one dropout rate; this model has attn_dropout={c.attn_dropout}, "
            f"resid_dropout={c.resid_dropout}, embd_dropout={c.embd_dropout}"
        )
    return dict(n_layer=c.n_layers, n_head=c.n_heads, n_embd=c.dim, block_size=c.max_len, bias=c.bias,
                vocab_size=c.vocab_size, dropout=c.attn_dropout)


# ---------------------------------------------------------------------------------------------
# python -m causal_attention convert


def _source_token_ids(src: Path, source_format: str, vocab_size: int) -> dict[str, int | list[int]]:
    """The bos/eos token ids src names for its model: a GPT.save directory's tokenizer.json (the
    demo's: bos_id, eos_id), a save_pretrained directory's config.json (eos also a list, as Llama
    3's); only ids in its vocabulary."""
    path, keys = {"ours": (src / "tokenizer.json", ("bos_id", "eos_id")),
                  "huggingface": (src / "config.json", ("bos_token_id", "eos_token_id"))}.get(source_format, (None, ()))
    if path is None or not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text())
    except ValueError:
        return {}  # not ours to judge: the model was read without it
    out: dict[str, int | list[int]] = {}
    for key, target in zip(keys, _TOKEN_ID_KEYS):
        value = values.get(key) if isinstance(values, dict) else None
        if convert_llama.is_token_id(value, vocab_size):
            out[target] = value
        elif target == "eos_token_id" and isinstance(value, list):
            listed = [i for i in value if convert_llama.is_token_id(i, vocab_size)]
            if listed:
                out[target] = listed
    return out


_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id")


def convert(src: Path, out: Path, *, source_format: str, target_format: str = "ours", n_heads: int | None = None) -> GPT:
    """Reads src (huggingface: a save_pretrained directory; nanogpt: a ckpt.pt or state dict file;
    ours: a GPT.save directory) and writes out in target_format; prints what it wrote."""
    readers = {
        "huggingface": lambda: from_huggingface(src, n_heads=n_heads),
        "nanogpt": lambda: from_nanogpt(src, n_heads=n_heads),
        "ours": lambda: load(src, GPT),
    }
    if source_format not in readers:
        raise ValueError(f"source_format must be one of {sorted(readers)}; got {source_format!r}")
    model = readers[source_format]()
    if target_format == "ours":
        save(model, out)
        written = [out / "model.safetensors", out / "config.json"]
    elif target_format == "huggingface":
        ids = _source_token_ids(src, source_format, model.config.vocab_size)
        to_huggingface(model, **ids).save_pretrained(str(out))
        written = sorted(out.iterdir())
    elif target_format == "nanogpt":
        checkpoint = {"model": to_nanogpt_state_dict(model), "model_args": nanogpt_model_args(model)}
        path = out if out.suffix == ".pt" else out / "ckpt.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint, str(path))
        written = [path]
    else:
        raise ValueError(f"target_format must be 'ours', 'huggingface' or 'nanogpt'; got {target_format!r}")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"read {source_format} {src}: {n_params:,} parameters, {model.config}")
    print("wrote " + ", ".join(str(p) for p in written))
    return model
