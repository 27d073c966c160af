"""What a ``cpattn demo`` run is made of: its :class:`Spec`, its model (embedded or a checkpoint), prompts, engines.

Example
-------
>>> spec = Spec(prompt_len=16, batch=2)
>>> spec.prompt_lens, spec.interleave
([16, 12], 16)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.bench.common import DTYPES
from cpattn.config import EngineConfig
from cpattn.engine import checks, driver
from cpattn.layout.rows import cu_seqlens
from cpattn.models.family import ModelFamily, get_family
from cpattn.models import load_checkpoint
from cpattn.models.common import config_dict

# the embedded default: a tiny Qwen3 (GQA 4:1 with q/k norm), random weights, nothing downloaded.
EMBEDDED_STD = 0.2  # weights ~ N(0, 0.2): clear logit margins, so greedy tokens are not near-ties


@dataclass(frozen=True)
class Spec:
    """Everything a rank needs (picklable): model, layout, sizes, graph and pool settings."""

    model_dir: str | None = None
    model_type: str = "qwen3"
    pcp: int = 2
    dcp: int = 2
    prompt_len: int = 4096
    batch: int = 1
    max_new_tokens: int = 32
    graph_mode: str = "full_decode_only"
    backend: str = "cpu"
    block_size: int = 16
    interleave_size: int | None = None
    merge: str = "local_ag"
    dtype: str = "float32"
    seed: int = 0
    capture_sizes: tuple[int, ...] | None = None
    eager_row: bool = True
    progress: bool = True
    perturb_reference: bool = False
    reps: int = 3
    kv_pool: str | None = None
    pool_rounds: int = 3
    pool_salt: int = 0

    @property
    def world_size(self) -> int:
        return max(self.pcp, self.dcp)

    @property
    def interleave(self) -> int:
        """``cp_kv_cache_interleave_size``: the block size unless set (whole blocks handed over)."""
        return self.block_size if self.interleave_size is None else self.interleave_size

    @property
    def prompt_lens(self) -> list[int]:
        """Request b has ``prompt_len - b * prompt_len // (2 * batch)`` tokens (uneven on purpose)."""
        return [self.prompt_len - (b * self.prompt_len) // (2 * self.batch) for b in range(self.batch)]



def model_config(spec: Spec) -> tuple[ModelFamily, Any]:
    """(family, config) of the run from the checkpoint's config.json alone (no weights read), or the
    family's tiny config for an embedded model. Raises ValueError naming what is wrong with a checkpoint."""
    if spec.model_dir is None:
        family = get_family(spec.model_type)
        return family, family.config_class.tiny()
    import json
    import os

    from cpattn.models import check_checkpoint

    check_checkpoint(spec.model_dir)  # config.json + safetensors headers against the family: no weights read
    path = os.path.join(spec.model_dir, "config.json")
    if not os.path.isdir(spec.model_dir):
        raise ValueError(f"{spec.model_dir!r} is not a directory; pass a Hugging Face checkpoint directory")
    if not os.path.isfile(path):
        raise ValueError(f"{spec.model_dir!r} has no config.json; pass a Hugging Face checkpoint directory")
    if not any(f.endswith(".safetensors") for f in os.listdir(spec.model_dir)):
        raise ValueError(f"{spec.model_dir!r} has no *.safetensors file (only safetensors checkpoints are read)")
    try:
        d = config_dict(spec.model_dir)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    family = get_family(d)
    try:
        cfg = family.config_class.from_hf(d)
    except KeyError as e:
        raise ValueError(f"{path} lacks {e.args[0]!r}, which a {family.name} config needs") from None
    _check_safetensors(spec.model_dir)
    return family, cfg


def _check_safetensors(model_dir: str) -> None:
    """Every *.safetensors file of the checkpoint has a readable header (only headers are read)."""
    import os

    from safetensors import SafetensorError, safe_open

    for name in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        try:
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{os.path.join(model_dir, name)} is not a readable safetensors file ({e})") from None


def load_model(spec: Spec) -> tuple[ModelFamily, Any, dict[str, torch.Tensor]]:
    """(family, config, params): an embedded tiny random model, or a local Hugging Face checkpoint."""
    dtype = DTYPES[spec.dtype]
    family, cfg = model_config(spec)
    if spec.model_dir is None:
        return family, cfg, family.init_params(cfg, seed=spec.seed, std=EMBEDDED_STD, dtype=dtype)
    _, params = load_checkpoint(spec.model_dir, dtype=dtype)
    return family, cfg, params


def prompts(spec: Spec, vocab: int) -> tuple[torch.Tensor, list[int]]:
    """Seeded random prompts, packed: tokens [T] int64 and cu_seqlens [B+1] (host ints)."""
    g = torch.Generator().manual_seed(spec.seed + 1)
    cu = cu_seqlens(spec.prompt_lens)
    return torch.randint(0, vocab, (cu[-1],), generator=g), cu


def graph_backend(spec: Spec, family: ModelFamily) -> str:
    """The decode runner's backend: the requested compiler for a capturable family, else "eager"."""
    return spec.backend if family.capturable else "eager"


def engine_configs(spec: Spec, family: ModelFamily, cfg: Any) -> tuple[EngineConfig, EngineConfig]:
    """The prefill (kv_producer, PCP) and decode (kv_consumer, DCP) engines of the P/D pair, validated.

    Raises :class:`~cpattn.config.ConfigError` listing every broken rule for
    a layout the guide (or the engine) cannot run.
    """
    graph = "FULL_DECODE_ONLY" if spec.graph_mode == "full_decode_only" else "NONE"
    pre, dec = driver.engine_configs(family, cfg, pcp_size=spec.pcp, dcp_size=spec.dcp, block_size=spec.block_size,
                                     interleave_size=spec.interleave, pd=True, graph_mode=graph,
                                     capture_sizes=spec.capture_sizes, graph_backend=graph_backend(spec, family))
    checks.check(family, cfg, pre, dec, world_size=spec.world_size, topology="colocated",
                 pool=spec.kv_pool is not None)
    return pre, dec


def flat(config: EngineConfig) -> dict:
    """An engine config as one flat dict of its fields (the flat names of ``EngineConfig.create``)."""
    return {k: v for part in dataclasses.asdict(config).values() for k, v in part.items()}

