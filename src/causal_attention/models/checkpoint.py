"""The project's own checkpoint files: model.safetensors + config.json (GPTConfig.to_dict()).

The header (names, dtypes, shapes) is checked against config.json before anything is allocated,
with the rules, order and messages of C++'s load_gpt.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from .config import FORMAT, GPTConfig, _listing, load_config


class CheckpointError(ValueError):
    """A checkpoint that does not match the model it is loaded into (names the tensor or option)."""


# ---------------------------------------------------------------------------------------------
# Loading a state dict into a GPT: strict, with errors that name the tensor.


def load_strict(model: nn.Module, state: Mapping[str, Tensor], *, source: str,
                origin: Mapping[str, tuple[str, bool]] | None = None) -> nn.Module:
    """Copies state (our names) into model; every tensor must be present, of the right shape, and
    nothing else may be there. Returns model. origin maps our names to the checkpoint's (key,
    transposed), so that an error names the tensor as the checkpoint has it."""
    expected = {name: p for name, p in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for name, target in expected.items():
        value = state[name]
        key, transposed = (repr(origin[name][0]), origin[name][1]) if origin and name in origin else (name, False)
        if not isinstance(value, Tensor):
            raise CheckpointError(f"{source}: {key} is a {type(value).__name__}, not a tensor")
        if tuple(value.shape) != tuple(target.shape):
            shape, want = tuple(value.shape), tuple(target.shape)
            if transposed:  # shown in the checkpoint's layout
                shape, want = shape[::-1], want[::-1]
            raise CheckpointError(f"{source}: {key} has shape {shape}; the model expects {want}")
        if not value.is_floating_point():
            raise CheckpointError(f"{source}: {key} has dtype {value.dtype}; expected a floating-point tensor")
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(state[name])
    return model


def check_sizes(state: Mapping[str, Tensor], expected: list[tuple[str, tuple[int, ...], str]], *,
                layer_keys: re.Pattern[str], n_layers: int, layers_option: str, source: str) -> None:
    """Checks a converter's config (nanoGPT's model_args, transformers' config.json) against the
    state dict it came with, before the model is built: each (key, shape, the options that set the
    shape) of `expected` (the embedding and one MLP weight: every other tensor's size follows from
    them and the heads) and the number of blocks (distinct group(1) of layer_keys). A config asking
    for more than the checkpoint holds is then an error naming the option, in no time or memory."""
    for key, shape, options in expected:
        if key not in state:
            raise CheckpointError(f"{source}: missing tensor {key!r}")
        value = state[key]
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        if got != shape:
            raise CheckpointError(f"{source}: {key!r} has shape {got}; the model expects {shape} ({options})")
    blocks = {match.group(1) for key in state if (match := layer_keys.match(key))}
    if len(blocks) != n_layers:
        raise CheckpointError(f"{source}: {layers_option} but the checkpoint holds {len(blocks)} blocks")


# ---------------------------------------------------------------------------------------------
# The project's own files.


def save(model: nn.Module, directory: Path) -> None:
    """Writes directory/model.safetensors (our names, the tied head stored once) and config.json."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": FORMAT})
    (directory / "config.json").write_text(json.dumps({"format": FORMAT, **model.config.to_dict()}, indent=2) + "\n")


def build_empty(model_type: Callable[[GPTConfig], nn.Module], config: GPTConfig, dtype: torch.dtype) -> nn.Module:
    """model_type(config) in dtype with uninitialised parameters, for a loader that fills every one:
    built on the meta device, then given CPU memory in dtype (no float32 twin of a half model, no
    init), on huge pages where a tensor spans one (huge_page_empty: a decode step streams them)."""
    from ..attention.cache import huge_page_empty

    with torch.device("meta"):
        model = model_type(config).to(dtype)
    for module in model.modules():  # as to_empty(device="cpu"), with the engine's allocation
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(huge_page_empty(tuple(p.shape), p.dtype), requires_grad=p.requires_grad))
    if any(b.is_meta for b in model.buffers()):  # GPT keeps none (its rotary frequencies are made on the CPU)
        raise TypeError(f"build_empty: {type(model).__name__} has buffers on the meta device; it fills parameters only")
    return model


def load(directory: Path, model_type: Callable[[GPTConfig], nn.Module]) -> nn.Module:
    """The model (model_type(config), i.e. GPT) that save() wrote into directory (the demo's --out
    directory too). The class is a parameter so that this module does not import gpt.py, which
    imports it.

    The file's header (names, dtypes, shapes) is checked against config.json before anything is
    allocated, as C++'s load_gpt does (the same rules, order and messages): every tensor of one
    floating dtype (the model's), none unexpected, none missing (when tensors are missing and the
    config's model needs more bytes than the file holds, the error says so, naming both files), each
    of the model's shape. Then the model is built empty in that dtype and filled tensor by tensor."""
    from safetensors import SafetensorError, safe_open

    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: GPT.load takes a directory written by GPT.save (or demo --out)")
    config = load_config(config_path)
    try:
        with safe_open(str(weights_path), framework="pt") as file:
            header = {name: (file.get_slice(name).get_dtype(), tuple(file.get_slice(name).get_shape()))
                      for name in file.keys()}
            dtype = check_header(config, header, config_source=str(config_path), source=str(weights_path))
            model = build_empty(model_type, config, dtype)
            with torch.no_grad():
                for name, target in model.state_dict().items():
                    target.copy_(file.get_tensor(name))
    except SafetensorError as exc:  # the safetensors library's own header checks
        raise CheckpointError(f"{weights_path}: {exc}") from None
    return model


# safetensors' floating dtypes the model can run in, with their sizes in bytes.
_FLOAT_DTYPES = {"F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
                 "BF16": (torch.bfloat16, 2)}
_INT64_MAX = 2**63 - 1


def parameter_layout(config: GPTConfig) -> tuple[list[tuple[str, tuple[int, ...]]], ...]:
    """GPT(config).state_dict()'s names and shapes without building it, in its order, as three
    lists: before the blocks, one block's (names after "blocks.{i}."), after the blocks."""
    d, h = config.dim, config.hidden

    def with_bias(name: str, shape: tuple[int, ...], b: bool = config.bias) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{name}.weight", shape)] + ([(f"{name}.bias", shape[:1])] if b else [])

    def norm(name: str) -> list[tuple[str, tuple[int, ...]]]:
        return with_bias(name, (d,), config.bias and config.norm == "layernorm")

    qkv_rows = (config.n_heads + 2 * config.kv_heads) * config.head_dim
    before = [("tok.weight", (config.vocab_size, d))]
    if config.positions == "learned":
        before.append(("pos.weight", (config.max_len, d)))
    mlp_bias = config.bias_of("mlp")
    if config.gated_mlp:
        mlp = with_bias("mlp.gate_up", (2 * h, d), mlp_bias) + with_bias("mlp.down", (d, h), mlp_bias)
    else:
        mlp = with_bias("mlp.0", (h, d), mlp_bias) + with_bias("mlp.2", (d, h), mlp_bias)
    block = (norm("ln1") + with_bias("attn.qkv", (qkv_rows, d), config.bias_of("qkv"))
             + with_bias("attn.proj", (d, d), config.bias_of("proj")) + norm("ln2") + mlp)
    after = norm("ln_f") + ([] if config.tie_head else [("head.weight", (config.vocab_size, d))])
    return before, block, after


def _count_text(n: int) -> str:
    """n, or "more than 18446744073709551615" from 2**64 on (C++ counts in 64 bits, saturating)."""
    return str(n) if n < 2**64 else f"more than {2**64 - 1}"


def check_header(config: GPTConfig, header: Mapping[str, tuple[str, tuple[int, ...]]], *, config_source: str,
                 source: str) -> torch.dtype:
    """Checks a safetensors header (name -> (safetensors dtype, shape)) against config; returns the
    model's dtype. Costs time and memory in the header's size, whatever config asks for."""
    names = sorted(header)
    for name in names:
        if header[name][0] not in _FLOAT_DTYPES:
            raise CheckpointError(f"{source}: tensor '{name}' has dtype {header[name][0]}; expected a floating dtype "
                                  "(F64, F32, F16 or BF16)")
    for name in names:
        if header[name][0] != header[names[0]][0]:
            raise CheckpointError(f"{source}: tensors of different dtypes: '{names[0]}' is {header[names[0]][0]}, "
                                  f"'{name}' is {header[name][0]} (every tensor must share one floating dtype)")

    before, block, after = parameter_layout(config)
    for name, shape in before + block + after:
        if math.prod(shape) > _INT64_MAX:
            raise CheckpointError(f"{config_source} describes tensors too large to address (tensor '{name}')")
    outside = dict(before + after)
    per_block = dict(block)

    def expected_shape(name: str) -> tuple[int, ...] | None:
        if name in outside:
            return outside[name]
        match = re.fullmatch(r"blocks\.(0|[1-9][0-9]*)\.(.+)", name)
        if match is None or int(match.group(1)) >= config.n_layers:
            return None
        return per_block.get(match.group(2))

    def expected_names() -> Iterator[str]:
        yield from (name for name, _ in before)
        for i in range(config.n_layers):
            yield from (f"blocks.{i}.{name}" for name, _ in block)
        yield from (name for name, _ in after)

    unexpected = [name for name in names if expected_shape(name) is None]
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) {_listing(unexpected)} (not in the model that "
                              f"{config_source} describes)")
    # Every name in the file is expected: the missing ones are found within len(header) + 9 names.
    if len(header) < len(outside) + config.n_layers * len(per_block):
        missing = list(itertools.islice((n for n in expected_names() if n not in header), 9))
        n_params = (sum(math.prod(s) for _, s in before + after)
                    + config.n_layers * sum(math.prod(s) for _, s in block))
        held = sum(math.prod(shape) * _FLOAT_DTYPES[dtype][1] for dtype, shape in header.values())
        dtype_name = header[names[0]][0] if names else "F32"
        needed = n_params * _FLOAT_DTYPES[dtype_name][1]
        if needed > held:  # a config asking for more than the file holds (n_layers = 10**6, say)
            raise CheckpointError(
                f"{config_source} describes a model of {_count_text(n_params)} parameters ({_count_text(needed)} "
                f"bytes as {dtype_name}) but {source} holds {held} bytes; missing tensor(s) {_listing(missing)}"
            )
        raise CheckpointError(f"{source}: missing tensor(s) {_listing(missing)}")
    # Now the file holds every name of the model and no other: a shape that differs is the only
    # way left for it to hold fewer (or more) bytes than the model needs.
    for name in expected_names():
        shape, want = header[name][1], expected_shape(name)
        if shape != want:
            raise CheckpointError(f"{source}: tensor '{name}' has shape {shape}; the model ({config_source}) expects {want}")
    return _FLOAT_DTYPES[header[names[0]][0]][0]
