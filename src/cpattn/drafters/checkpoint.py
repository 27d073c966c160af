"""Draft checkpoints on disk: ``config.json`` + ``model.safetensors``, read back by name prefix.

A drafter saves its weights under the names its format uses (a DeepSeek-V3
checkpoint's ``model.layers.{N}.*`` for MTP, an Eagle3 / DSpark head's own
names) next to a config.json; :func:`read` loads every tensor whose name
starts with a prefix, from every ``*.safetensors`` file of a directory, so
a drafter can take its few tensors out of a whole target checkpoint.

Example
-------
>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> save(d, {"a.weight": torch.ones(2), "b": torch.zeros(1)}, {"model_type": "toy"})
>>> config, params = read(d, prefix="a.")
>>> config["model_type"], sorted(params)
('toy', ['a.weight'])
"""

from __future__ import annotations

import json
import os
import re

import torch

_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


KEEP32 = ("mlp.gate.weight", "e_score_correction_bias")  # router tensors stay float32 (as checkpoints keep them)


def save(path: str | os.PathLike, params: dict[str, torch.Tensor], config: dict,
         dtype: torch.dtype | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (contiguous copies) into directory ``path``;
    ``dtype`` casts floating tensors (except routers) on the way, e.g. bfloat16 for a small file."""
    from safetensors.torch import save_file

    def cast(name, t):
        t = t.detach()
        if dtype is not None and t.is_floating_point() and not name.endswith(KEEP32):
            t = t.to(dtype)
        return t.contiguous()

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file({n: cast(n, t) for n, t in params.items()}, os.path.join(path, "model.safetensors"))


def read_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` of a checkpoint directory."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{os.fspath(path)!r} has no config.json; pass a checkpoint directory")
    with open(file) as f:
        return json.load(f)


def read(path: str | os.PathLike, *, prefix: str = "", names: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(config dict, ``{name: tensor}``) of every tensor named ``prefix...`` (all: ``""``) or listed in ``names``.

    Reads only those tensors (``safe_open``), from every ``*.safetensors`` file in ``path``.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    config = read_config(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path!r} has no *.safetensors files")
    out = {}
    for file in files:
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix) or name in names:
                    out[name] = f.get_tensor(name)
    return config, out


def unstack_experts(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names from stacked experts (the inverse of ``normalize_params``' stacking).

    ``<p>.mlp.experts.gate_up_proj`` [E, 2I, H] -> ``<p>.mlp.experts.{e}.gate_proj.weight`` /
    ``up_proj.weight`` [I, H]; ``down_proj`` [E, H, I] -> ``{e}.down_proj.weight``.

    >>> out = unstack_experts({"m.mlp.experts.gate_up_proj": torch.zeros(2, 6, 4), "x": torch.ones(1)})
    >>> sorted(out)[:2], out["m.mlp.experts.1.up_proj.weight"].shape
    (['m.mlp.experts.0.gate_proj.weight', 'm.mlp.experts.0.up_proj.weight'], torch.Size([3, 4]))
    """
    out = {}
    for name, t in params.items():
        m = _STACKED.match(name)
        if not m:
            out[name] = t
            continue
        base, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"] = gate
                out[f"{base}.{e}.up_proj.weight"] = up
            else:
                out[f"{base}.{e}.down_proj.weight"] = t[e]
    return out
