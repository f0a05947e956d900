"""GPTConfig: the architecture options of GPT, and config.json's rules (shared with C++'s
GPTConfig::from_json: the same checks, order and messages)."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

Activation = Literal["gelu", "gelu_tanh", "silu"]
Norm = Literal["layernorm", "rmsnorm"]
Positions = Literal["learned", "rope"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The architecture of a GPT (all keyword-only).

    vocab_size: tokens; max_len: positions (GPT-2's n_positions, nanoGPT's block_size); dim: width;
    n_layers, n_heads (must divide dim); mlp_hidden: the MLP's inner width (None = 4 * dim);
    layer_norm_eps: the norms' epsilon (LayerNorm's, or RMSNorm's rms_norm_eps); activation:
    ``"gelu"`` (exact, nanoGPT), ``"gelu_tanh"`` (GPT-2's gelu_new) or ``"silu"``; bias: biases in
    every Linear and LayerNorm (nanoGPT's bias=False removes them); tie_head: the output head is the
    token embedding; attn_dropout, resid_dropout, embd_dropout: GPT-2's attn_pdrop, resid_pdrop,
    embd_pdrop (training mode only).

    The Llama family's options (their defaults are GPT-2's architecture): n_kv_heads: grouped-query
    attention's key/value heads (a divisor of n_heads; None = n_heads); norm: ``"layernorm"`` or
    ``"rmsnorm"`` (Llama's: the mean square in float32, as transformers computes it); gated_mlp:
    down(activation(gate(x)) * up(x)) (SwiGLU with activation ``"silu"``) instead of
    fc2(activation(fc1(x))); positions: ``"learned"`` (an embedding of max_len positions) or
    ``"rope"`` (rotary, rotate-half layout, over the whole head); rope_theta: the rotary base;
    rope_scaling: None or Llama 3's frequency scaling, ``{"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``; qkv_bias,
    proj_bias, mlp_bias: the attention's q/k/v, its output and the MLP's biases (None: as bias;
    Qwen2 has bias=False, qkv_bias=True); sliding_window: keys each query sees, its own included
    (Mistral), or None.
    """

    vocab_size: int
    max_len: int
    dim: int = 128
    n_layers: int = 3
    n_heads: int = 4
    mlp_hidden: int | None = None
    layer_norm_eps: float = 1e-5
    activation: Activation = "gelu"
    bias: bool = True
    tie_head: bool = True
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    embd_dropout: float = 0.0
    n_kv_heads: int | None = None
    norm: Norm = "layernorm"
    gated_mlp: bool = False
    positions: Positions = "learned"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool | None = None
    proj_bias: bool | None = None
    mlp_bias: bool | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "dim", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int; got {value!r}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"GPTConfig: n_heads={self.n_heads} must divide dim={self.dim}")
        if self.mlp_hidden is not None and (
            not isinstance(self.mlp_hidden, int) or isinstance(self.mlp_hidden, bool) or self.mlp_hidden <= 0
        ):
            raise ValueError(f"GPTConfig.mlp_hidden must be None or a positive int; got {self.mlp_hidden!r}")
        if self.activation not in ("gelu", "gelu_tanh", "silu"):
            raise ValueError(f"GPTConfig.activation must be 'gelu', 'gelu_tanh' or 'silu'; got {self.activation!r}")
        # inf passes "> 0" but makes every norm's output 0 (and the rotary angles NaN for rope_theta).
        eps = self.layer_norm_eps
        if not (isinstance(eps, float) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"GPTConfig.layer_norm_eps must be a positive finite float; got {self.layer_norm_eps!r}")
        for name in ("attn_dropout", "resid_dropout", "embd_dropout"):
            p = getattr(self, name)
            if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p < 1.0:
                raise ValueError(f"GPTConfig.{name} must be a probability in [0, 1); got {p!r}")
        for name in ("bias", "tie_head", "gated_mlp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be a bool; got {getattr(self, name)!r}")
        self._check_llama_options()

    def _check_llama_options(self) -> None:
        for name in ("n_kv_heads", "sliding_window"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"GPTConfig.{name} must be None or a positive int; got {value!r}")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"GPTConfig: n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"GPTConfig.norm must be 'layernorm' or 'rmsnorm'; got {self.norm!r}")
        if self.positions not in ("learned", "rope"):
            raise ValueError(f"GPTConfig.positions must be 'learned' or 'rope'; got {self.positions!r}")
        if self.positions == "rope" and self.head_dim % 2 != 0:
            raise ValueError(f"GPTConfig: rotary positions need an even head_dim; got {self.head_dim}")
        if not (isinstance(self.rope_theta, (int, float)) and not isinstance(self.rope_theta, bool)
                and math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"GPTConfig.rope_theta must be a positive finite number; got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            if self.positions != "rope":
                raise ValueError("GPTConfig.rope_scaling needs positions='rope'")
            _check_rope_scaling(self.rope_scaling)
        for name in ("qkv_bias", "proj_bias", "mlp_bias"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"GPTConfig.{name} must be None or a bool; got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """The key/value heads: n_kv_heads, or n_heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def llama_options(self) -> list[str]:
        """The Llama family's options this config sets away from their defaults (GPT-2's
        architecture), by name: what GPT-2-only paths (nanoGPT, GPT-2 export, tensor parallelism)
        refuse."""
        return [key for key, default in LLAMA_DEFAULTS.items() if getattr(self, key) != default]

    def bias_of(self, part: Literal["qkv", "proj", "mlp"]) -> bool:
        """Whether the attention's qkv, its output projection or the MLP's Linears have biases."""
        value = getattr(self, f"{part}_bias")
        return self.bias if value is None else value

    @property
    def hidden(self) -> int:
        """The MLP's inner width."""
        return self.mlp_hidden if self.mlp_hidden is not None else 4 * self.dim

    @classmethod
    def gpt2(cls, **overrides: Any) -> GPTConfig:
        """GPT-2 small (124M): 50257 tokens, 1024 positions, 12 layers of width 768 with 12 heads,
        tanh GELU, tied head, dropout 0.1; keywords override any field."""
        base: dict[str, Any] = dict(vocab_size=50257, max_len=1024, dim=768, n_layers=12, n_heads=12,
                                    activation="gelu_tanh", attn_dropout=0.1, resid_dropout=0.1, embd_dropout=0.1)
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        """Every option, except the Llama family's where they hold their defaults (GPT-2's files, which
        C++'s reader takes, stay as they were)."""
        out = asdict(self)
        for key, default in LLAMA_DEFAULTS.items():
            if out[key] == default:
                del out[key]
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> GPTConfig:
        """From config.json's values (to_dict's output, with "format" = FORMAT optional); strict, as
        the C++ GPTConfig::from_json: an unknown key, a missing one, a JSON type other than the
        field's (true is not an int, 2.0 is not an int) is a ValueError naming `source` and the key.

        An older version's file (the demo's ``mlp_ratio``, before the other options existed) is read
        as the model that version built: the options it lacks take LEGACY_DEFAULTS, named in a warning.
        """
        checked = _config_values(values, source=source)
        try:
            return cls(**checked)
        except ValueError as exc:  # a value out of range (__post_init__)
            raise ValueError(f"{source}: {exc}") from None


#: What config.json's "format" key holds (GPT.save writes it; a file may omit it).
FORMAT = "causal_attention.gpt"
_INT_OPTIONS = ("vocab_size", "max_len", "dim", "n_layers", "n_heads")
_NUMBER_OPTIONS = ("layer_norm_eps", "attn_dropout", "resid_dropout", "embd_dropout", "rope_theta")
_BOOL_OPTIONS = ("bias", "tie_head", "gated_mlp")
_OPTIONAL_INT_OPTIONS = ("mlp_hidden", "n_kv_heads", "sliding_window")
_OPTIONAL_BOOL_OPTIONS = ("qkv_bias", "proj_bias", "mlp_bias")
_OPTIONS = tuple(f.name for f in fields(GPTConfig))
#: The Llama family's options and their defaults (GPT-2's architecture): config.json holds them only
#: where they differ, and a file may omit them.
LLAMA_DEFAULTS: dict[str, Any] = {"n_kv_heads": None, "norm": "layernorm", "gated_mlp": False, "positions": "learned",
                                  "rope_theta": 10000.0, "rope_scaling": None, "qkv_bias": None, "proj_bias": None,
                                  "mlp_bias": None, "sliding_window": None}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _check_rope_scaling(scaling: Any) -> None:
    """Llama 3's frequency scaling is the one rope_scaling implemented; anything else names itself."""
    if not isinstance(scaling, dict):
        raise ValueError(f"GPTConfig.rope_scaling must be None or a dict; got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"GPTConfig.rope_scaling: rope_type {kind!r} is not supported (only 'llama3')")
    unknown = sorted(set(scaling) - {"rope_type", "type", *_LLAMA3_KEYS})
    missing = [key for key in _LLAMA3_KEYS if key not in scaling]
    if unknown or missing:
        raise ValueError(f"GPTConfig.rope_scaling (llama3): needs {', '.join(_LLAMA3_KEYS)}; "
                         f"missing {missing}, unknown {unknown}")
    for key in _LLAMA3_KEYS:
        value = scaling[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"GPTConfig.rope_scaling: {key} must be a positive number; got {value!r}")
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError("GPTConfig.rope_scaling: high_freq_factor must exceed low_freq_factor")
#: An older version's config.json (the demo's, with mlp_ratio) holds these keys; the options it
#: lacks take the values of the model that version built.
LEGACY_REQUIRED = ("vocab_size", "max_len", "dim", "n_layers", "n_heads", "mlp_ratio")
LEGACY_DEFAULTS: dict[str, Any] = {"layer_norm_eps": 1e-5, "activation": "gelu", "bias": True, "tie_head": True,
                                   "attn_dropout": 0.0, "resid_dropout": 0.0, "embd_dropout": 0.0}


def _json_text(value: Any) -> str:
    """A value as JSON writes it compactly (as nlohmann's dump(), so both sides' messages agree)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _is_int64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _listing(names: list[str]) -> str:
    """['a', 'b'] (at most 8 names, then ', ...')."""
    shown = ", ".join(f"'{n}'" for n in names[:8])
    return f"[{shown}{', ...' if len(names) > 8 else ''}]"


def _config_values(values: dict[str, Any], *, source: str) -> dict[str, Any]:
    """GPTConfig's keyword arguments from config.json's values, checked in the order C++'s
    GPTConfig::from_json checks them: unknown keys, format, missing keys, each key's JSON type."""
    unknown = sorted(set(values) - set(_OPTIONS) - {"format", "mlp_ratio"})
    if unknown:
        raise ValueError(f"{source}: unknown option(s) {_listing(unknown)}; known: {', '.join(sorted(_OPTIONS + ('format',)))}")
    if "format" in values and values["format"] != FORMAT:
        raise ValueError(f'{source}: format must be "{FORMAT}"; got {_json_text(values["format"])}')
    legacy = "mlp_ratio" in values
    if legacy and "mlp_hidden" in values:
        raise ValueError(f"{source}: mlp_ratio (an older version's option) and mlp_hidden cannot both be given")
    required = LEGACY_REQUIRED if legacy else tuple(o for o in _OPTIONS if o not in LLAMA_DEFAULTS)
    missing = sorted(set(required) - set(values))
    if missing:
        raise ValueError(f"{source}: missing option(s) {_listing(missing)} (GPT.save writes every option)")
    out: dict[str, Any] = {}
    for key in _OPTIONS:
        if key not in values:
            continue
        value = values[key]
        if key in _INT_OPTIONS:
            ok, what = _is_int64(value), "an int"
        elif key in _OPTIONAL_INT_OPTIONS:
            ok, what = value is None or _is_int64(value), "an int or null"
        elif key in _OPTIONAL_BOOL_OPTIONS:
            ok, what = value is None or isinstance(value, bool), "true, false or null"
        elif key == "rope_scaling":
            ok, what = value is None or isinstance(value, dict), "an object or null"
        elif key in _NUMBER_OPTIONS:
            ok, what = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
            value = float(value) if ok else value
        elif key in _BOOL_OPTIONS:
            ok, what = isinstance(value, bool), "true or false"
        else:  # activation, norm, positions
            ok, what = isinstance(value, str), "a string"
        if not ok:
            raise ValueError(f"{source}: {key} must be {what}; got {_json_text(values[key])}")
        out[key] = value
    if legacy:
        ratio = values["mlp_ratio"]
        if not _is_int64(ratio):
            raise ValueError(f"{source}: mlp_ratio must be an int; got {_json_text(ratio)}")
        if ratio <= 0:
            raise ValueError(f"{source}: mlp_ratio must be a positive int; got {ratio}")
        out["mlp_hidden"] = None if ratio == 4 else ratio * out["dim"]
        taken = {key: value for key, value in LEGACY_DEFAULTS.items() if key not in out}
        if taken:
            warnings.warn(f"{source}: an older version's file (mlp_ratio); the options it lacks take that version's "
                          f"values: {', '.join(f'{k}={_json_text(v)}' for k, v in taken.items())}", UserWarning,
                          stacklevel=3)
        out = {**taken, **out}
    return out




def load_config(path: Path) -> GPTConfig:
    """GPTConfig from a config.json written by GPT.save (or the demo): GPTConfig.from_dict's rules,
    and a ValueError naming the file for anything else (JSON not well-formed, NaN included, or not an
    object; a field out of range)."""

    def no_constant(name: str) -> Any:  # NaN and Infinity are not JSON (nor accepted by C++)
        raise ValueError(f"{name} is not a JSON value")

    try:
        values = json.loads(path.read_text(), parse_constant=no_constant)
    except ValueError as exc:  # json.JSONDecodeError included
        raise ValueError(f"{path}: not well-formed JSON ({exc})") from None
    if not isinstance(values, dict):
        kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(values), "null")
        raise ValueError(f"{path}: must be a JSON object; got {kind}")
    return GPTConfig.from_dict(values, source=str(path))
