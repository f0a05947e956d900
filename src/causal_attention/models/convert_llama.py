"""Exact converters between GPT and transformers' Llama family: LlamaForCausalLM,
Qwen2ForCausalLM and MistralForCausalLM (a model object or a save_pretrained directory, sharded
safetensors with model.safetensors.index.json included), and back.

q_proj | k_proj | v_proj are joined into ``attn.qkv`` (rows q | k | v) and gate_proj | up_proj into
``mlp.gate_up``; everything else is renamed. Every option GPT does not implement (a rope type other
than the default and llama3, partial rotary, a head_dim other than hidden_size / heads, Qwen2's
per-layer sliding windows, tensor-parallel pretraining slices) is an error naming it, as is every
missing, unexpected or misshapen tensor.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .checkpoint import CheckpointError, check_sizes, load_strict
from .config import LLAMA_DEFAULTS, GPTConfig, _json_text
from .gpt import GPT

__all__ = ["LLAMA_DEFAULTS", "MODEL_TYPES", "HfOptions", "config_from_huggingface_llama",
           "config_to_huggingface_llama", "from_huggingface_llama", "is_llama_family", "to_huggingface_llama",
           "to_huggingface_state_dict_llama"]

#: model_type -> the ForCausalLM class names it is read from.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# Rotary buffers some checkpoints hold: recomputed from the config.
_BUFFERS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


_REQUIRED = object()


class HfOptions:
    """config.json's values read as transformers' config classes hold them, with C++'s HfConfig
    rules and messages: an absent or null key takes the default (none given: "missing option"); a
    value of another JSON type is a CheckpointError naming the key (a string "64" is not an int)."""

    def __init__(self, values: Mapping[str, Any], *, source: str | None = None) -> None:
        self.values, self._prefix = values, "" if source is None else f"{source}: "

    def has(self, key: str) -> bool:
        return self.values.get(key) is not None

    def error(self, what: str) -> CheckpointError:
        return CheckpointError(self._prefix + what)

    def _value(self, key: str, default: Any) -> Any:
        if self.has(key):
            return self.values[key]
        if default is _REQUIRED:
            raise self.error(f"missing option {key}")
        return default

    def _wrong(self, key: str, what: str) -> CheckpointError:
        return self.error(f"{key} must be {what}; got {_json_text(self.values[key])}")

    def integer(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._value(key, default)
        if not self.has(key):
            return value
        # A whole number written as a float (32.0) is read as Python's int() (and C++) reads it.
        if isinstance(value, float) and math.isfinite(value) and value == int(value) and abs(value) < 9.0e18:
            return int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not -(2**63) <= value < 2**63:
            raise self._wrong(key, "an int")
        return value

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._value(key, default)
        if self.has(key) and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise self._wrong(key, "a number")
        return None if value is None else float(value)

    def boolean(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._value(key, default)
        if self.has(key) and not isinstance(value, bool):
            raise self._wrong(key, "true or false")
        return value

    def text(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._value(key, default)
        if self.has(key) and not isinstance(value, str):
            raise self._wrong(key, "a string")
        return value

    def object(self, key: str) -> dict[str, Any]:
        """A nested object (rope_parameters), {} where absent or null."""
        value = self._value(key, {})
        if not isinstance(value, Mapping):
            raise self._wrong(key, "an object")
        return dict(value)


def _rope(hf: HfOptions) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) as transformers (4 and 5) reads them: rope_scaling, where given,
    replaces rope_parameters (its rope_theta included), else rope_parameters (v5); a theta not in the
    chosen object is the top-level rope_theta, else 10000."""
    params, legacy = hf.object("rope_parameters"), hf.object("rope_scaling")
    chosen, name = (legacy, "rope_scaling") if legacy else (params, "rope_parameters")
    theta = chosen.get("rope_theta")
    if theta is None:
        theta = hf.number("rope_theta", 10000.0)
    elif isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise hf.error(f"{name}.rope_theta must be a number")
    kind = chosen.get("rope_type", chosen.get("type")) or "default"
    factor = chosen.get("partial_rotary_factor", hf.values.get("partial_rotary_factor"))
    if factor is not None and (isinstance(factor, bool) or factor != 1):
        raise hf.error(f"partial_rotary_factor={_json_text(factor)} is not supported (GPT rotates the whole head)")
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise hf.error(f"rope type {kind!r} is not supported (GPT implements 'default' and 'llama3')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in chosen]
    if missing:
        raise hf.error(f"rope type 'llama3' needs {missing}")
    return float(theta), {"rope_type": "llama3", **{k: chosen[k] for k in keys}}


def config_from_huggingface_llama(values: Mapping[str, Any], *, source: str | None = None) -> GPTConfig:
    """GPTConfig from a LlamaConfig / Qwen2Config / MistralConfig (as a dict); errors name source
    (config.json's path) where given."""
    hf = HfOptions(values, source=source)
    model_type = hf.values.get("model_type")
    if model_type not in MODEL_TYPES:
        raise hf.error(f"model_type {model_type!r} is not a Llama-family model ({sorted(MODEL_TYPES)})")
    dim, heads = hf.integer("hidden_size"), hf.integer("num_attention_heads")
    kv_heads = hf.integer("num_key_value_heads", 0) or heads  # 0 and null mean multi-head
    if heads <= 0 or dim % heads != 0:
        raise hf.error(f"num_attention_heads={heads} does not divide hidden_size={dim}")
    if hf.has("head_dim") and hf.integer("head_dim") != dim // heads:
        raise hf.error(f"head_dim={hf.integer('head_dim')} is not supported (GPT's head_dim is hidden_size / "
                       f"num_attention_heads = {dim // heads})")
    act = hf.text("hidden_act", "silu")
    if act != "silu":
        raise hf.error(f"hidden_act={act!r} is not supported (the Llama family's SwiGLU uses 'silu')")
    if hf.integer("pretraining_tp", 1) != 1:
        raise hf.error(f"pretraining_tp={hf.integer('pretraining_tp')} is not supported (1: the plain projections)")
    theta, scaling = _rope(hf)
    n_layers = hf.integer("num_hidden_layers")
    window = None
    if model_type == "mistral":
        window = hf.integer("sliding_window", None)
    elif (model_type == "qwen2" and hf.boolean("use_sliding_window", False)
          and hf.integer("max_window_layers", 0) < n_layers):
        # Qwen2 windows the layers from max_window_layers on; with none of them, every layer is full.
        raise hf.error("use_sliding_window=True is not supported for Qwen2 (per-layer windows from "
                       f"max_window_layers={hf.integer('max_window_layers', 0)})")
    layer_types = hf.values.get("layer_types")
    if layer_types:
        if not isinstance(layer_types, list):
            raise hf.error("layer_types must be a list")
        kinds = set(map(str, layer_types))
        expected = {"sliding_attention"} if window is not None else {"full_attention"}
        if kinds != expected:
            raise hf.error(f"layer_types {sorted(kinds)} are not supported (every layer must be "
                           f"{next(iter(expected))!r})")
    if model_type == "qwen2":
        qkv_bias, proj_bias, mlp_bias = True, False, False
    elif model_type == "llama":
        qkv_bias = proj_bias = hf.boolean("attention_bias", False)
        mlp_bias = hf.boolean("mlp_bias", False)
    else:
        qkv_bias = proj_bias = mlp_bias = False
    return GPTConfig(
        vocab_size=hf.integer("vocab_size"),
        max_len=hf.integer("max_position_embeddings", 2048),
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=None if kv_heads == heads else kv_heads,
        mlp_hidden=hf.integer("intermediate_size"),
        layer_norm_eps=hf.number("rms_norm_eps", 1e-6),
        activation="silu",
        bias=False,
        qkv_bias=qkv_bias or None,
        proj_bias=proj_bias or None,
        mlp_bias=mlp_bias or None,
        tie_head=hf.boolean("tie_word_embeddings", False),
        attn_dropout=hf.number("attention_dropout", 0.0),
        norm="rmsnorm",
        gated_mlp=True,
        positions="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=window,
    )


_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id")


def is_token_id(value: Any, vocab_size: int) -> bool:
    """Whether value is an int id in 0..vocab_size-1."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def token_ids(vocab_size: int, kwargs: Mapping[str, Any],
              defaults: Mapping[str, int]) -> dict[str, int | list[int] | None]:
    """bos_token_id and eos_token_id for a transformers config: the caller's (in kwargs; None or an
    id in 0..vocab_size-1, eos also a non-empty list of them as Llama 3's, else a CheckpointError
    naming it), else defaults' where the vocabulary holds it, else None. transformers' class defaults
    (GPT-2's 50256, Llama's 1 and 2) are ids of their tokenizers: written for a 13-token model they
    would point past its vocabulary."""
    out: dict[str, int | list[int] | None] = {}
    for key in _TOKEN_ID_KEYS:
        if key in kwargs:
            value = kwargs[key]
            listed = key == "eos_token_id" and isinstance(value, (list, tuple)) and len(value) > 0
            ids = list(value) if listed else [value]
            if value is not None and not all(is_token_id(i, vocab_size) for i in ids):
                what = "a token id or a non-empty list of them" if key == "eos_token_id" else "a token id"
                raise CheckpointError(f"{key} must be None or {what} in 0..vocab_size-1 = 0..{vocab_size - 1}; "
                                      f"got {value!r}")
            out[key] = ids if listed else value
        else:
            default = defaults.get(key)
            out[key] = default if default is not None and 0 <= default < vocab_size else None
    return out


def is_llama_family(config: GPTConfig) -> bool:
    return config.norm == "rmsnorm" and config.gated_mlp and config.positions == "rope"


def config_to_huggingface_llama(config: GPTConfig) -> tuple[str, dict[str, Any]]:
    """(model_type, the config class's keyword arguments) describing config: Mistral with a sliding
    window, Qwen2 for q/k/v biases alone, Llama otherwise."""
    if not is_llama_family(config) or config.bias or config.activation != "silu":
        raise CheckpointError("only Llama-family configs (rmsnorm, gated silu MLP, rope, no other biases) have a "
                              "Llama / Qwen2 / Mistral counterpart")
    qkv, proj, mlp = config.bias_of("qkv"), config.bias_of("proj"), config.bias_of("mlp")
    common: dict[str, Any] = dict(
        vocab_size=config.vocab_size, max_position_embeddings=config.max_len, hidden_size=config.dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads, num_key_value_heads=config.kv_heads,
        intermediate_size=config.hidden, rms_norm_eps=config.layer_norm_eps, hidden_act="silu",
        tie_word_embeddings=config.tie_head, attention_dropout=config.attn_dropout,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta} if config.rope_scaling is None
        else {**config.rope_scaling, "rope_theta": config.rope_theta},
    )
    if config.sliding_window is not None:
        if qkv or proj or mlp:
            raise CheckpointError("Mistral (the sliding window) has no biases")
        return "mistral", {**common, "sliding_window": config.sliding_window}
    if qkv and not proj and not mlp:
        return "qwen2", common
    if qkv != proj:
        raise CheckpointError("Llama's attention_bias covers q, k, v and o together")
    return "llama", {**common, "attention_bias": qkv, "mlp_bias": mlp}


def _pairs(config: GPTConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(our name, their names joined in order) for every tensor, head aside."""
    out: list[tuple[str, tuple[str, ...]]] = [("tok.weight", ("model.embed_tokens.weight",))]
    for i in range(config.n_layers):
        at, ours = f"model.layers.{i}.", f"blocks.{i}."
        out.append((ours + "ln1.weight", (at + "input_layernorm.weight",)))
        for kind in (["weight", "bias"] if config.bias_of("qkv") else ["weight"]):
            out.append((ours + f"attn.qkv.{kind}", tuple(at + f"self_attn.{p}_proj.{kind}" for p in "qkv")))
        for kind in (["weight", "bias"] if config.bias_of("proj") else ["weight"]):
            out.append((ours + f"attn.proj.{kind}", (at + f"self_attn.o_proj.{kind}",)))
        out.append((ours + "ln2.weight", (at + "post_attention_layernorm.weight",)))
        for kind in (["weight", "bias"] if config.bias_of("mlp") else ["weight"]):
            out.append((ours + f"mlp.gate_up.{kind}", (at + f"mlp.gate_proj.{kind}", at + f"mlp.up_proj.{kind}")))
            out.append((ours + f"mlp.down.{kind}", (at + f"mlp.down_proj.{kind}",)))
    out.append(("ln_f.weight", ("model.norm.weight",)))
    return out


def from_huggingface_llama(state: Mapping[str, Tensor], config: GPTConfig, source: str) -> GPT:
    """A GPT for config holding a Llama-family state_dict (their names), every tensor checked."""
    c = config
    check_sizes(state, [("model.embed_tokens.weight", (c.vocab_size, c.dim), f"vocab_size={c.vocab_size}, "
                         f"hidden_size={c.dim}"),
                        ("model.layers.0.mlp.gate_proj.weight", (c.hidden, c.dim),
                         f"intermediate_size={c.hidden}, hidden_size={c.dim}")],
                layer_keys=re.compile(r"model\.layers\.(\d+)\."), n_layers=c.n_layers,
                layers_option=f"num_hidden_layers={c.n_layers}", source=source)
    ours: dict[str, Tensor] = {}
    origin: dict[str, tuple[str, bool]] = {}
    used: set[str] = set()
    with torch.device("meta"):  # the shapes only
        expected = GPT(config).state_dict()
    for mine, theirs in _pairs(config):
        missing = [k for k in theirs if k not in state]
        if missing:
            raise CheckpointError(f"{source}: missing tensor {missing[0]!r}")
        parts = [state[k] for k in theirs]
        if len(parts) > 1:
            # Each part's share of the joined rows, checked before joining (an error names the part).
            rows = _part_rows(mine, config)
            for key, part, n in zip(theirs, parts, rows):
                want = (n, *expected[mine].shape[1:])
                if tuple(part.shape) != want:
                    raise CheckpointError(f"{source}: {key} has shape {tuple(part.shape)}; the model expects {want}")
            ours[mine] = torch.cat(parts, dim=0)
        else:
            ours[mine] = parts[0]
        origin[mine] = (theirs[0], False)
        used.update(theirs)
    head_key = "lm_head.weight"
    if head_key in state:
        used.add(head_key)
        if config.tie_head:
            if not torch.equal(state[head_key], state["model.embed_tokens.weight"]):
                raise CheckpointError(f"{source}: {head_key!r} differs from model.embed_tokens.weight but the head is tied")
        else:
            ours["head.weight"] = state[head_key]
            origin["head.weight"] = (head_key, False)
    elif not config.tie_head:
        raise CheckpointError(f"{source}: missing tensor {head_key!r} (the head is not tied)")
    unexpected = sorted(k for k in state if k not in used and not _BUFFERS.search(k))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    dtypes = {t.dtype for t in ours.values() if t.is_floating_point()}
    model = GPT.empty(config, dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32)
    return load_strict(model, ours, source=source, origin=origin)  # type: ignore[return-value]


def _part_rows(mine: str, config: GPTConfig) -> tuple[int, ...]:
    hd = config.head_dim
    if ".attn.qkv." in mine:
        return (config.n_heads * hd, config.kv_heads * hd, config.kv_heads * hd)
    return (config.hidden, config.hidden)  # mlp.gate_up


def to_huggingface_state_dict_llama(model: GPT) -> dict[str, Tensor]:
    """The LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM state_dict of model (the three
    share their names; lm_head.weight is the head, tied or not)."""
    config = model.config
    config_to_huggingface_llama(config)  # errors for what the family cannot hold
    state = model.state_dict()
    out: dict[str, Tensor] = {}
    for mine, theirs in _pairs(config):
        value = state[mine]
        if len(theirs) == 1:
            out[theirs[0]] = value.contiguous()
        else:
            for key, part in zip(theirs, value.split(_part_rows(mine, config), dim=0)):
                out[key] = part.contiguous()
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if config.tie_head else state["head.weight"]
    return out


def to_huggingface_llama(model: GPT, **kwargs: Any) -> Any:
    """A transformers LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM (config_to_huggingface_llama
    chooses) holding model's weights; kwargs go to its config (e.g. attn_implementation="sdpa")."""
    import transformers

    model_type, values = config_to_huggingface_llama(model.config)
    name = MODEL_TYPES[model_type]
    config_class = getattr(transformers, name.replace("ForCausalLM", "Config"))
    attn_implementation = kwargs.pop("attn_implementation", None)
    config = config_class(**{**values, **kwargs, **token_ids(model.config.vocab_size, kwargs, {})})
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    hf = getattr(transformers, name)(config).to(model.tok.weight.dtype)
    missing, unexpected = hf.load_state_dict(to_huggingface_state_dict_llama(model), strict=False)
    if unexpected or [k for k in missing if not _BUFFERS.search(k)]:
        raise CheckpointError(f"{name}: missing {missing}, unexpected {unexpected}")
    return hf
