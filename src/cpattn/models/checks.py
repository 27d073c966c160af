"""Checks of a checkpoint's config fields and safetensors headers, before any weight is read.

Two halves, both cheap (no tensor data is read or allocated):

- :func:`check_fields`: each family's ``from_hf`` states the type of every
  config.json field it reads (a positive integer, a number, a boolean ...),
  and the relations between them (``num_key_value_heads`` divides
  ``num_attention_heads``); a field that breaks one raises
  :class:`ConfigFieldError` (a ``ValueError``) naming the field, the value
  seen and what was expected.
- :func:`read_header`: a safetensors file's header (8-byte little-endian
  length, then a JSON object ``{name: {"dtype", "shape", "data_offsets"}}``),
  with every tensor's bytes checked to lie inside the file (a truncated
  file is refused here, not met as a bus error when mapped).

:func:`cpattn.models.checkpoint.check_checkpoint` combines them with the
names and shapes the family expects.

Example
-------
>>> check_fields({"hidden_size": 64, "rms_norm_eps": 1e-6}, {"hidden_size": "int>0", "rms_norm_eps": "num>0?"})
>>> check_fields({"hidden_size": -128}, {"hidden_size": "int>0"})
Traceback (most recent call last):
...
cpattn.models.checks.ConfigFieldError: config field 'hidden_size' is -128; expected a positive integer
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# rule -> what the message says was expected; a trailing "?" lets the field be absent or null
_KINDS = {
    "int>0": "a positive integer",
    "int>=0": "a non-negative integer",
    "num>0": "a positive number",
    "num>=0": "a non-negative number",
    "num": "a finite number",
    "bool": "true or false",
    "ints": "a list of integers",
    "strs": "a list of strings",
    "str": "a string",
}

# safetensors dtype -> element size in bytes (the ones a checkpoint may hold)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
INT_DTYPES = ("I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64")


class ConfigFieldError(ValueError):
    """A config field of the wrong type or value: ``field`` (its name) and ``detail`` (the sentence, no file)."""

    def __init__(self, field: str, detail: str, *, missing: bool = False):
        super().__init__(f"config {detail}")
        self.field, self.detail, self.missing = field, detail, missing


def shown(value: Any) -> str:
    """A value as a message shows it: its repr, cut to 60 characters, with its type when that is the problem.

    >>> shown("128"), shown(True), shown(list(range(40)))[-17:]
    ("'128' (a string)", 'True (a boolean)', '15, ...] (a list)')
    """
    text = repr(value)
    if len(text) > 60:
        text = text[:55] + "...]" if text.startswith("[") else text[:56] + "..."
    kind = {str: "a string", bool: "a boolean", list: "a list", dict: "an object"}.get(type(value))
    return f"{text} ({kind})" if kind else text


def bad(field: str, value: Any, expected: str) -> ConfigFieldError:
    """The error for ``field`` holding ``value`` where ``expected`` was expected."""
    return ConfigFieldError(field, f"field {field!r} is {shown(value)}; expected {expected}")


def _fits(kind: str, v: Any) -> bool:
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "str":
        return isinstance(v, str)
    if kind in ("ints", "strs"):
        item = str if kind == "strs" else int
        return isinstance(v, (list, tuple)) and all(isinstance(x, item) and not isinstance(x, bool) for x in v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if kind.startswith("int"):
        return isinstance(v, int) and (v > 0 if kind == "int>0" else v >= 0)
    if not math.isfinite(v):
        return False
    return {"num>0": v > 0, "num>=0": v >= 0, "num": True}[kind]


def check_fields(d: Mapping[str, Any], rules: Mapping[str, str]) -> None:
    """Every field named in ``rules`` has the type and sign its rule says (``"int>0"``, ``"num>0?"`` ...).

    A rule ending in ``?`` lets the field be absent or null; otherwise it is
    required. Raises :class:`ConfigFieldError` for the first field that breaks its rule.

    >>> check_fields({"head_dim": None}, {"head_dim": "int>0?"})
    >>> check_fields({"head_dim": 0}, {"head_dim": "int>0?"})
    Traceback (most recent call last):
    ...
    cpattn.models.checks.ConfigFieldError: config field 'head_dim' is 0; expected a positive integer or null
    """
    for name, rule in rules.items():
        optional, kind = rule.endswith("?"), rule.rstrip("?")
        v = d.get(name)
        if v is None:
            if name not in d and not optional:
                raise ConfigFieldError(name, f"lacks {name!r} ({_KINDS[kind]})", missing=True)
            if not optional:
                raise bad(name, v, _KINDS[kind])
            continue
        if not _fits(kind, v):
            raise bad(name, v, _KINDS[kind] + (" or null" if optional else ""))


def check_divides(d: Mapping[str, Any], small: str, big: str, *, default_small: Any = None) -> None:
    """``d[small]`` (or ``default_small``) divides ``d[big]``: e.g. KV heads into query heads.

    >>> check_divides({"num_key_value_heads": 3, "num_attention_heads": 4}, "num_key_value_heads",
    ...               "num_attention_heads")
    Traceback (most recent call last):
    ...
    cpattn.models.checks.ConfigFieldError: config field 'num_key_value_heads' is 3; expected a divisor of num_attention_heads = 4 (1, 2, 4)
    """
    s, b = d.get(small, default_small), d.get(big)
    if s is None or b is None or b % s == 0:
        return
    divisors = ", ".join(str(k) for k in range(1, b + 1) if b % k == 0) if b <= 4096 else "..."
    raise bad(small, s, f"a divisor of {big} = {b} ({divisors})")


def check_at_most(d: Mapping[str, Any], small: str, big: str) -> None:
    """``d[small] <= d[big]`` when both are given (e.g. experts per token <= experts)."""
    s, b = d.get(small), d.get(big)
    if s is not None and b is not None and s > b:
        raise bad(small, s, f"at most {big} = {b}")


def check_choices(d: Mapping[str, Any], name: str, choices, *, length: int | None = None) -> None:
    """Field ``name`` (a list, if given) holds only ``choices``, ``length`` of them when given."""
    v = d.get(name)
    if v is None:
        return
    if not isinstance(v, (list, tuple)) or any(x not in choices for x in v):
        raise bad(name, v, f"a list of {', '.join(map(repr, choices))}")
    if isinstance(length, int) and len(v) < length:
        raise bad(name, v, f"one entry per layer (num_hidden_layers = {length}); it has {len(v)}")


def check_rope(rope: Mapping[str, Any], field: str = "rope_parameters") -> None:
    """RoPE settings (as :func:`cpattn.models.common.rope_parameters` folds them) cpattn can run:
    type ``default`` or ``yarn``, a positive ``rope_theta``, YaRN's ``factor`` and original length.

    >>> check_rope({"rope_type": "linear", "rope_theta": 1e4})
    Traceback (most recent call last):
    ...
    cpattn.models.checks.ConfigFieldError: config field 'rope_parameters' has rope_type 'linear'; expected 'default' or 'yarn' (the RoPE types cpattn runs)
    """
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "yarn"):
        raise ConfigFieldError(field, f"field {field!r} has rope_type {kind!r}; expected 'default' or 'yarn' "
                                      "(the RoPE types cpattn runs)")
    if not _fits("num>0", rope.get("rope_theta")):
        raise ConfigFieldError(field, f"field {field!r} has rope_theta {shown(rope.get('rope_theta'))}; "
                                      "expected a positive number")
    if kind == "yarn":
        for name, rule in (("factor", "num>0"), ("original_max_position_embeddings", "int>0")):
            v = rope.get(name)
            if v is not None and not _fits(rule, v):
                raise ConfigFieldError(field, f"field {field!r} has {name} {shown(v)}; expected {_KINDS[rule]}")


# -- safetensors headers -----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorHeader:
    """One tensor of a safetensors file, from its header alone: file, name, dtype (safetensors spelling), shape."""

    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]


def read_header(file: str) -> dict[str, TensorHeader]:
    """The tensors a safetensors file declares, checked against the file's size; no tensor data is read.

    Raises ValueError naming the file (and the tensor) when the header is not
    valid safetensors or a tensor's bytes lie past the end of the file.

    >>> import tempfile, torch
    >>> from safetensors.torch import save_file
    >>> f = tempfile.mkdtemp() + "/m.safetensors"
    >>> save_file({"w": torch.zeros(2, 3)}, f)
    >>> read_header(f)["w"].shape
    (2, 3)
    """
    size = os.path.getsize(file)
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{file} is not a readable safetensors file ({size} bytes, shorter than the 8-byte "
                             "header length)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{file} is not a readable safetensors file (header length {n} is past the end of a "
                             f"{size}-byte file): truncated, or not safetensors")
        try:
            meta = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{file} is not a readable safetensors file (its header is not JSON: {e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{file} is not a readable safetensors file (its header is a JSON {type(meta).__name__}, "
                         "not an object)")
    data = size - 8 - n
    out: dict[str, TensorHeader] = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        if isinstance(info, dict) and str(info.get("dtype", "")).startswith(("F4", "F6", "F8")) \
                and info["dtype"] not in DTYPE_BYTES:
            raise ValueError(f"{file}: tensor {name!r} is {info['dtype']} (a quantized dtype); quantized "
                             "checkpoints are not supported: dequantize to bf16/fp32 first")
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            ok = dtype in DTYPE_BYTES and all(isinstance(s, int) and s >= 0 for s in shape)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{file}: tensor {name!r} has a malformed header entry {shown(info)}; "
                             "expected a known dtype, a shape and data_offsets")
        want = math.prod(shape) * DTYPE_BYTES[dtype]
        if end - start != want:
            raise ValueError(f"{file}: tensor {name!r} ({dtype}, shape {list(shape)}) spans {end - start} bytes; "
                             f"its shape needs {want}")
        if end > data:
            raise ValueError(f"{file}: tensor {name!r} ends at byte {end} of the data but the file holds {data}; "
                             "the file is truncated: copy it again")
        out[name] = TensorHeader(file, name, dtype, shape)
    return out
