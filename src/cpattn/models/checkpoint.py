"""Loading a local Hugging Face checkpoint directory, checked before any weight is read.

:func:`check_checkpoint` reads config.json and the safetensors headers only
(no tensor data) and refuses, in one line naming the file and the field or
tensor, what cpattn would otherwise run as a different model or fail on
late:

1. config.json missing, not JSON, or not an object; a ``model_type`` no
   family serves; a ``quantization_config``;
2. a header that is not safetensors or whose tensors lie past the end of
   the file (a truncated copy);
3. quantized tensors (FP8 dtypes, ``weight_scale`` / ``weight_scale_inv``
   and the other scale / zero-point names);
4. config fields of the wrong type or sign, or breaking a relation (the
   family's ``from_hf`` checks them: :mod:`cpattn.models.checks`);
5. ``num_hidden_layers`` against the layers the checkpoint holds (a count
   too large fails here, before anything is sized by it);
6. every tensor the family expects -- names and shapes from
   ``init_params`` on the meta device (nothing allocated), checkpoint names
   through the family's ``rename`` -- present, of that shape, floating point
   where the model computes with it; no unexpected tensor inside a layer
   (a config that disagrees with its weights).

:func:`load_checked` (what :func:`cpattn.models.load_checkpoint` runs) then
reads exactly the tensors the family names and normalizes them (experts
stacked, the family's dtype rule).

Example
-------
>>> import json, tempfile, torch
>>> from safetensors.torch import save_file
>>> from cpattn.models import qwen3
>>> d = tempfile.mkdtemp()
>>> cfg = qwen3.Qwen3Config(vocab_size=8, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
...                         num_attention_heads=2, num_key_value_heads=1, head_dim=2)
>>> params = qwen3.init_params(cfg)
>>> save_file(params, d + "/model.safetensors")
>>> conf = dict(model_type="qwen3", vocab_size=8, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
...             num_attention_heads=2, num_key_value_heads=1, head_dim=2)
>>> _ = open(d + "/config.json", "w").write(json.dumps(conf))
>>> check_checkpoint(d)
>>> _ = open(d + "/config.json", "w").write(json.dumps({**conf, "vocab_size": 9}))
>>> check_checkpoint(d)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: .../model.safetensors: tensor 'model.embed_tokens.weight' has shape [8, 4] but config.json gives [9, 4] (from vocab_size = 9); ...
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.models.checks import FLOAT_DTYPES, INT_DTYPES, ConfigFieldError, TensorHeader, read_header, shown
from cpattn.models.common import _EXPERT_KEY, normalize_params, quantized_part

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointFileError(ValueError, FileNotFoundError):
    """A checkpoint file that is missing: a ValueError (as every refusal) and a FileNotFoundError."""


def read_config(file: str) -> dict[str, Any]:
    """config.json as a dict; ValueError naming the file when it is not JSON or not an object.

    >>> import tempfile
    >>> f = tempfile.mkdtemp() + "/config.json"
    >>> _ = open(f, "w").write("[1, 2]")
    >>> read_config(f)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: .../config.json holds a JSON list; expected a JSON object of the model's settings ...
    """
    try:
        with open(file, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise CheckpointFileError(f"{file} does not exist; pass a Hugging Face checkpoint directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" ({e.msg} at line {e.lineno} column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise ValueError(f"{file} is not valid JSON{where}; expected a JSON object of the model's settings") \
            from None
    if not isinstance(d, dict):
        kind = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(d), "null")
        raise ValueError(f"{file} holds a JSON {kind}; expected a JSON object of the model's settings "
                         '(e.g. {"model_type": "qwen3", "hidden_size": ...})')
    return d


@dataclass(frozen=True)
class Checked:
    """What :func:`check_checkpoint` found: the config, its family and family config, and the tensors to
    load: checkpoint name -> (its header, its params name)."""

    config: dict[str, Any]
    family: Any
    cfg: Any
    tensors: dict[str, tuple[TensorHeader, str]]


def check_checkpoint(path: str | os.PathLike) -> None:
    """Refuse a checkpoint directory cpattn cannot load as its config.json says, before any weight is read.

    Reads config.json and the safetensors headers only. Raises ValueError
    (one line, naming the file and the field or tensor) for everything listed
    in the module doc; returns None when :func:`cpattn.models.load_checkpoint`
    will load it.
    """
    inspect_checkpoint(path)


def inspect_checkpoint(path: str | os.PathLike) -> Checked:
    """:func:`check_checkpoint`, returning what it found (:class:`Checked`)."""
    from cpattn.models.family import FAMILY_MODULES, get_family

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointFileError(f"{path!r} is not a directory; pass a Hugging Face checkpoint directory "
                                  "(config.json + *.safetensors)")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise CheckpointFileError(f"{path!r} has no config.json; pass a Hugging Face checkpoint directory")
    config = read_config(cfg_file)
    if config.get("quantization_config"):
        q = config["quantization_config"]
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise ValueError(f"{cfg_file}: field 'quantization_config' says quant_method {shown(method)}; quantized "
                         "checkpoints are not supported: dequantize to bf16/fp32 first")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILY_MODULES:
        raise ValueError(f"{cfg_file}: model_type {model_type!r} is not supported; expected one of "
                         f"{sorted(FAMILY_MODULES)} (the families cpattn runs)")
    family = get_family(config)
    cfg = _family_config(cfg_file, family, config)
    headers = _headers(path)
    _refuse_quantized(headers)
    renamed = {name: (h, family.param_name(name)) for name, h in headers.items()}
    renamed = {name: (h, p) for name, (h, p) in renamed.items() if p is not None}
    _check_layers(cfg_file, config, renamed)
    by_param: dict[str, tuple[str, TensorHeader]] = {}
    for name, (h, p) in renamed.items():
        if p in by_param:
            raise ValueError(f"{h.file}: tensor {name!r} and {by_param[p][0]!r} both load as {p!r} (two spellings "
                             "of one weight); expected one of them")
        by_param[p] = (name, h)
    expected = _expected(family, cfg, by_param)
    _check_tensors(cfg_file, family, cfg, expected, by_param)
    return Checked(config, family, cfg, renamed)


def load_checked(path: str | os.PathLike, *, dtype: torch.dtype | None = None
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, params) of a checkpoint directory :func:`check_checkpoint` accepts; only the
    tensors the family names are read (one file at a time, no whole-file copy)."""
    from safetensors import safe_open

    checked = inspect_checkpoint(path)
    state: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name, (h, param) in checked.tensors.items():
        by_file.setdefault(h.file, []).append((name, param))
    for file, names in sorted(by_file.items()):
        with safe_open(file, framework="pt") as f:
            for name, param in names:
                state[param] = f.get_tensor(name)
    return checked.config, normalize_params(state, dtype=dtype, load_dtype=checked.family.load_dtype)


# -- the steps -------------------------------------------------------------------------------------


def _family_config(cfg_file: str, family, config: dict):
    """``family.config_class.from_hf(config)``, its refusals as one line naming config.json."""
    try:
        return family.config_class.from_hf(config)
    except ConfigFieldError as e:
        if e.missing:
            raise ValueError(f"{cfg_file} {e.detail}, which a {family.name} config needs") from None
        raise ValueError(f"{cfg_file}: {e.detail}") from None
    except KeyError as e:
        raise ValueError(f"{cfg_file} lacks {e.args[0]!r}, which a {family.name} config needs") from None
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from None
    except TypeError as e:
        raise ValueError(f"{cfg_file}: not a valid {family.name} config ({e})") from None


def _headers(path: str) -> dict[str, TensorHeader]:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointFileError(f"{path!r} has no *.safetensors files; only safetensors checkpoints are supported")
    out: dict[str, TensorHeader] = {}
    for f in files:
        for name, h in read_header(os.path.join(path, f)).items():
            if name in out:
                raise ValueError(f"{h.file}: tensor {name!r} is also in {out[name].file}; "
                                 "expected each tensor in one file (remove the stale shard)")
            out[name] = h
    return out


def _refuse_quantized(headers: dict[str, TensorHeader]) -> None:
    for name, h in headers.items():
        if quantized_part(name):
            raise ValueError(f"{h.file}: tensor {name!r} is a quantization {name.rsplit('.', 1)[-1]} (FP8 / "
                             "compressed-tensors format); quantized checkpoints are not supported: dequantize to "
                             "bf16/fp32 first")
    for name, h in headers.items():
        if h.dtype.startswith("F8"):
            raise ValueError(f"{h.file}: tensor {name!r} is {h.dtype} (FP8); quantized checkpoints are not "
                             "supported: dequantize to bf16/fp32 first")


def _layer_ranges(ids: list[int]) -> str:
    """'0..1, 5' for [0, 1, 5]."""
    runs, start = [], None
    for i, k in enumerate(ids):
        if start is None:
            start = k
        if i + 1 == len(ids) or ids[i + 1] != k + 1:
            runs.append(str(start) if start == k else f"{start}..{k}")
            start = None
    return ", ".join(runs[:6]) + (", ..." if len(runs) > 6 else "") if runs else "none"


def _check_layers(cfg_file: str, config: dict, renamed: dict[str, tuple[TensorHeader, str]]) -> None:
    """num_hidden_layers against the layers the checkpoint holds (before anything is sized by it); a composite
    config (Qwen3.5's Hub form) gives it in its nested ``text_config``."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    n = config.get("num_hidden_layers", text.get("num_hidden_layers"))
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"{cfg_file}: field 'num_hidden_layers' is {shown(n)}; expected a positive integer")
    mtp = max((v for v in (config.get("num_nextn_predict_layers"), config.get("num_mtp_layers"))
               if isinstance(v, int) and not isinstance(v, bool) and v > 0), default=0)
    where: dict[int, TensorHeader] = {}
    for h, param in renamed.values():
        m = _LAYER.match(param)
        if m:
            where.setdefault(int(m.group(1)), h)
    held = sorted(where)
    files = sorted({h.file for h, _ in renamed.values()})
    source = files[0] if len(files) == 1 else f"the {len(files)} *.safetensors files of {os.path.dirname(files[0])}"
    missing = next((i for i in range(n) if i not in where), None)  # at most len(held) + 1 steps
    if missing is not None:
        more = f" (and {n - missing - 1} more)" if n - missing > 1 else ""
        fix = f"num_hidden_layers = {len(held)}" if held == list(range(len(held))) and held else "the missing weights"
        raise ValueError(f"{source}: no tensor of layer {missing} (model.layers.{missing}.*){more}; config.json field "
                         f"'num_hidden_layers' is {n} but the checkpoint holds layers {_layer_ranges(held)}; "
                         f"expected {fix}")
    extra = [i for i in held if i >= n + mtp]
    if extra:
        h = where[extra[0]]
        raise ValueError(f"{h.file}: holds layer {extra[0]} (model.layers.{extra[0]}.*) but config.json field "
                         f"'num_hidden_layers' is {n}" + (f" (+ {mtp} MTP)" if mtp else "") +
                         f"; expected layers 0..{n + mtp - 1}: the checkpoint and its config.json disagree")


def _expected(family, cfg, present: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
    """params name -> (shape, floating point?) the family expects, per-expert names where the checkpoint
    holds experts one by one (``present``: params names of the checkpoint). Nothing is allocated."""
    with torch.device("meta"):
        params = family.init_params(cfg, dtype=torch.float32)
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    for name, t in params.items():
        shape, is_float = tuple(t.shape), t.is_floating_point()
        prefix, _, part = name.rpartition(".")
        if prefix.endswith(".experts") and part in ("gate_up_proj", "down_proj") and name not in present:
            e, rows, cols = shape
            if part == "gate_up_proj":
                for i in range(e):
                    out[f"{prefix}.{i}.gate_proj.weight"] = ((rows // 2, cols), is_float)
                    out[f"{prefix}.{i}.up_proj.weight"] = ((rows // 2, cols), is_float)
            else:
                for i in range(e):
                    out[f"{prefix}.{i}.down_proj.weight"] = ((rows, cols), is_float)
            continue
        out[name] = (shape, is_float)
    return out


def _check_tensors(cfg_file: str, family, cfg, expected: dict, by_param: dict) -> None:
    missing = [p for p in expected if p not in by_param]
    if missing:
        p = missing[0]
        shape, _ = expected[p]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        hint = ""
        if p == "lm_head.weight":
            hint = " (or set tie_word_embeddings: true in config.json if the head is the embedding)"
        files = sorted({h.file for _, h in by_param.values()})
        raise ValueError(f"{files[0] if len(files) == 1 else os.path.dirname(cfg_file)}: no tensor {p!r}{more}; "
                         f"a {family.name} model with this config.json needs it, shape {list(shape)}{hint}")
    for p, (shape, is_float) in expected.items():
        name, h = by_param[p]
        if h.shape != shape:
            fields = _fields_behind(family, cfg, by_param, p, h.shape)
            why = f" (from {', '.join(f'{k} = {v}' for k, v in fields)})" if fields else ""
            fix = f"fix config.json's {' / '.join(k for k, _ in fields)}" if fields else "fix config.json"
            raise ValueError(f"{h.file}: tensor {name!r} has shape {list(h.shape)} but config.json gives "
                             f"{list(shape)}{why}; the checkpoint and its config.json disagree: {fix} or use the "
                             "checkpoint's own config.json")
        if is_float and h.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{h.file}: tensor {name!r} is {h.dtype}; expected a floating-point tensor "
                             f"({', '.join(FLOAT_DTYPES)}): the model computes with it")
        if not is_float and h.dtype not in INT_DTYPES:
            raise ValueError(f"{h.file}: tensor {name!r} is {h.dtype}; expected an integer tensor "
                             f"({', '.join(INT_DTYPES[:2])}): the model indexes with it")
    for p, (name, h) in by_param.items():
        m = _LAYER.match(p)
        if m and int(m.group(1)) < cfg.num_hidden_layers and p not in expected:
            raise ValueError(f"{h.file}: tensor {name!r} is not part of layer {m.group(1)} of a {family.name} model "
                             "with this config.json; the checkpoint and its config.json disagree (e.g. "
                             "attention_bias, q_lora_rank, the layer or expert counts): fix config.json")


def _fields_behind(family, cfg, by_param: dict, param: str, got: tuple[int, ...]) -> list[tuple[str, int]]:
    """The config fields a mismatched tensor's shape follows ([("vocab_size", 100)]), found by doubling each
    integer field alone and seeing which moves a differing dimension (meta device; error path only).
    A layer's tensor is probed on a config cut to that layer."""
    m = _LAYER.match(param)
    base = cfg
    if m:
        keep = int(m.group(1)) + 1
        n = cfg.num_hidden_layers
        cut = {f.name: getattr(cfg, f.name)[:keep] for f in dataclasses.fields(cfg)
               if isinstance(getattr(cfg, f.name), tuple) and len(getattr(cfg, f.name)) == n}
        try:
            base = dataclasses.replace(cfg, num_hidden_layers=keep, **cut)
        except Exception:  # noqa: BLE001 (a config that cannot be cut: probe the whole one)
            base = cfg
    want = _expected(family, base, by_param).get(param, ((),))[0]
    differing = [i for i in range(len(want)) if i >= len(got) or want[i] != got[i]] or list(range(len(want)))
    names = []
    for f in dataclasses.fields(base):
        v = getattr(base, f.name)
        if f.name == "num_hidden_layers" or isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            continue
        try:
            moved = _expected(family, dataclasses.replace(base, **{f.name: v * 2}), by_param).get(param, ((),))[0]
        except Exception:  # noqa: BLE001 (a field that cannot move alone: not the one)
            continue
        if len(moved) != len(want) or any(moved[i] != want[i] for i in differing):
            names.append((f.name, v))
    return names

