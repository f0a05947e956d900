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

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .checkpoint import CheckpointError, load_strict
from .config import LLAMA_DEFAULTS, GPTConfig
from .gpt import GPT

__all__ = ["LLAMA_DEFAULTS", "MODEL_TYPES", "config_from_huggingface_llama", "config_to_huggingface_llama",
           "from_huggingface_llama", "is_llama_family", "to_huggingface_llama", "to_huggingface_state_dict_llama"]

#: model_type -> the ForCausalLM class names it is read from.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# Rotary buffers some checkpoints hold: recomputed from the config.
_BUFFERS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _rope(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers' rope_parameters (v5) or rope_theta / rope_scaling."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", legacy.get("rope_type", legacy.get("type", "default"))))
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise CheckpointError(f"partial_rotary_factor={factor} is not supported (GPT rotates the whole head)")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"rope type {kind!r} is not supported (GPT implements 'default' and 'llama3')")
    source = params if "factor" in params else legacy
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in source]
    if missing:
        raise CheckpointError(f"rope type 'llama3' needs {missing}")
    return theta, {"rope_type": "llama3", **{k: source[k] for k in keys}}


def config_from_huggingface_llama(hf: Mapping[str, Any]) -> GPTConfig:
    """GPTConfig from a LlamaConfig / Qwen2Config / MistralConfig (as a dict)."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"model_type {model_type!r} is not a Llama-family model ({sorted(MODEL_TYPES)})")
    dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    if dim % heads != 0:
        raise CheckpointError(f"num_attention_heads={heads} does not divide hidden_size={dim}")
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) != dim // heads:
        raise CheckpointError(f"head_dim={head_dim} is not supported (GPT's head_dim is hidden_size / "
                              f"num_attention_heads = {dim // heads})")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act={act!r} is not supported (the Llama family's SwiGLU uses 'silu')")
    if int(hf.get("pretraining_tp", 1) or 1) != 1:
        raise CheckpointError(f"pretraining_tp={hf['pretraining_tp']} is not supported (1: the plain projections)")
    theta, scaling = _rope(hf)
    window = None
    if model_type == "mistral":
        window = hf.get("sliding_window")
    elif (model_type == "qwen2" and hf.get("use_sliding_window")
          and int(hf.get("max_window_layers", 0)) < int(hf["num_hidden_layers"])):
        # Qwen2 windows the layers from max_window_layers on; with none of them, every layer is full.
        raise CheckpointError("use_sliding_window=True is not supported for Qwen2 (per-layer windows from "
                              f"max_window_layers={hf.get('max_window_layers')})")
    layer_types = hf.get("layer_types")
    if layer_types:
        kinds = set(layer_types)
        expected = {"sliding_attention"} if window is not None else {"full_attention"}
        if kinds != expected:
            raise CheckpointError(f"layer_types {sorted(kinds)} are not supported (every layer must be "
                                  f"{next(iter(expected))!r})")
    if model_type == "qwen2":
        qkv_bias, proj_bias, mlp_bias = True, False, False
    elif model_type == "llama":
        qkv_bias = proj_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
    else:
        qkv_bias = proj_bias = mlp_bias = False
    return GPTConfig(
        vocab_size=int(hf["vocab_size"]),
        max_len=int(hf.get("max_position_embeddings", 2048)),
        dim=dim,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=None if kv_heads == heads else kv_heads,
        mlp_hidden=int(hf["intermediate_size"]),
        layer_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation="silu",
        bias=False,
        qkv_bias=qkv_bias or None,
        proj_bias=proj_bias or None,
        mlp_bias=mlp_bias or None,
        tie_head=bool(hf.get("tie_word_embeddings", False)),
        attn_dropout=float(hf.get("attention_dropout", 0.0)),
        norm="rmsnorm",
        gated_mlp=True,
        positions="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=None if window is None else int(window),
    )


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
    config = config_class(**{**values, **kwargs})
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    hf = getattr(transformers, name)(config).to(model.tok.weight.dtype)
    missing, unexpected = hf.load_state_dict(to_huggingface_state_dict_llama(model), strict=False)
    if unexpected or [k for k in missing if not _BUFFERS.search(k)]:
        raise CheckpointError(f"{name}: missing {missing}, unexpected {unexpected}")
    return hf
