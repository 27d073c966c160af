"""Hardware profiles: what one device and its links can do, each published number with its source.

A :class:`Profile` is a roofline per device (peak FLOP/s per dtype, memory
bandwidth, memory size) plus the achieved fraction of peak per op class,
per-kernel launch overheads, and two links (inside a node, between nodes)
with a latency ``alpha`` and a per-device bandwidth ``beta`` for the
alpha + bytes / beta cost of each collective step. ``overlap`` is the
fraction of a transfer that hides behind compute when the code overlaps
them (1.0: DMA engines move the bytes while the cores compute).

Built in:

- ``h200``: an 8 x H200 SXM node (NVLink 4 through NVSwitch), NVIDIA's published specifications;
- ``ascend-910c``: an Atlas 800T A3 node, 16 Ascend 910C dies (each die is one device to
  vLLM-Ascend, 8 packages of 2 dies), HCCS inside the node, RoCE between nodes;
- ``b200``: an 8 x B200 node (NVLink 5), for the published DCP anchor measured there;
- ``cpu``: this project's 2-core machine with gloo, fitted by ``cpattn plan calibrate`` (the
  numbers here are a default until a calibrated profile is saved).

Achieved fractions (``efficiency``) and launch overheads of the accelerators
are assumptions, not measurements: they are printed with every prediction.

Example
-------
>>> p = get_profile("h200")
>>> p.flops["bf16"], p.devices_per_node
(989000000000000.0, 8)
>>> round(p.op_time("gemm", flops=2e12, bytes_=1e9, dtype="bf16") * 1e3, 3)  # compute-bound: 2 TFLOP at 70%
2.889
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

# ``efficiency[kind]`` of an attention kind is the rate per exact query-key pair at this many tokens (the one
# size profiles were calibrated at before ``curves``; calibrated profiles keep writing it that way)
LEGACY_ATTN_TOKENS = 2048
OP_CLASSES = ("gemm", "attention", "attention_causal", "decode_attention", "elementwise")


def interpolate(points: list[list[float]], size: float) -> float:
    """A curve ``[[size, value], ...]`` at ``size``: linear in log(size) between points, held at the end
    values outside.

    >>> interpolate([[1024, 0.6], [4096, 0.8]], 2048), interpolate([[1024, 0.6], [4096, 0.8]], 100)
    (0.7, 0.6)
    """
    pts = sorted(points)
    if size <= pts[0][0]:
        return pts[0][1]
    for (s0, e0), (s1, e1) in zip(pts, pts[1:]):
        if size <= s1:
            w = math.log(size / s0) / math.log(s1 / s0)
            return e0 + w * (e1 - e0)
    return pts[-1][1]


@dataclass(frozen=True)
class Link:
    """One fabric: ``alpha`` seconds per message step, ``beta`` bytes/s per device and direction,
    ``overlap`` the fraction of a transfer hidden behind concurrent compute.

    Calibrated CPU links (gloo over loopback) also carry what a transfer costs the *process*
    in CPU time (``cpu_alpha`` seconds per step plus bytes / ``cpu_beta``; 0 where not measured),
    and ``cold``: the extra seconds a collective costs when the rank arrives at it from
    ``cold_gap`` seconds (or more) of host work instead of from another collective.

    >>> Link(1e-4, 1e9, cpu_alpha=5e-5, cpu_beta=2e9).cpu_time(1e6), Link(1e-4, 1e9).cpu_time(1e6)
    (0.00055, 0.0)
    >>> Link(1e-4, 1e9, cold=3e-4, cold_gap=5e-4).cold_cost(2.5e-4)  # half the calibrated gap
    0.00015
    """

    alpha: float
    beta: float
    overlap: float = 1.0
    cpu_alpha: float = 0.0
    cpu_beta: float = 0.0
    cold: float = 0.0
    cold_gap: float = 0.0

    def time(self, nbytes: float, steps: int = 1) -> float:
        """``steps * alpha + nbytes / beta`` (seconds)."""
        return steps * self.alpha + nbytes / self.beta

    def cpu_time(self, nbytes: float, steps: int = 1) -> float:
        """Process CPU seconds of ``steps`` message steps moving ``nbytes`` (0 when not calibrated)."""
        return steps * self.cpu_alpha + (nbytes / self.cpu_beta if self.cpu_beta > 0 else 0.0)

    def cold_cost(self, gap: float) -> float:
        """Extra seconds of one collective reached after ``gap`` seconds of host work: ``cold`` at the
        calibrated gap or longer, in proportion below it (a collective right after another costs alpha)."""
        if self.cold <= 0 or self.cold_gap <= 0:
            return 0.0
        return self.cold * min(1.0, max(gap, 0.0) / self.cold_gap)


@dataclass(frozen=True)
class Profile:
    """A device and its node (see module doc). ``flops``: dtype -> dense peak FLOP/s per device;
    ``efficiency``: op class -> achieved fraction of the compute peak (and of ``mem_bw`` for the
    memory-bound part); ``launch``: "eager" / "graph" -> seconds per kernel; ``links``:
    "intra" / "inter" (and on the CPU the gloo algorithms: "a2a", "ring", "native");
    ``sources``: field -> where the number comes from."""

    name: str
    device: str
    flops: dict[str, float]
    mem_bw: float
    mem_bytes: float
    devices_per_node: int
    links: dict[str, Link]
    efficiency: dict[str, float] = field(default_factory=dict)
    launch: dict[str, float] = field(default_factory=dict)
    mem_util: float = 0.9
    sources: dict[str, str] = field(default_factory=dict)
    curves: dict[str, list[list[float]]] = field(default_factory=dict)
    # link name -> the collective library's algorithms on it (cpattn.plan.collectives); empty: alpha-beta rings
    collectives: dict[str, list[dict]] = field(default_factory=dict)

    def efficiency_at(self, kind: str, size: float | None = None) -> float:
        """Achieved fraction of ``kind`` at problem ``size``: from ``curves[kind]`` (``[[size, eff], ...]``
        measured at a few sizes, interpolated in log(size), held at the end values outside) when the
        profile has one, else the single ``efficiency[kind]`` (1.0 when absent).

        >>> p = dataclasses.replace(CPU_DEFAULT, curves={"attention": [[1024, 0.6], [4096, 0.8]]})
        >>> p.efficiency_at("attention", 2048), p.efficiency_at("attention", 100), p.efficiency_at("gemm")
        (0.7, 0.6, 1.0)
        """
        if size is None or not self.curves.get(kind):
            return self.efficiency.get(kind, 1.0)
        return interpolate(self.curves[kind], size)

    def op_time(self, kind: str, *, flops: float, bytes_: float, dtype: str = "bf16",
                size: float | None = None) -> float:
        """Roofline time of one op: ``max(flops / (peak * eff), bytes / (mem_bw * eff))``; ``eff`` is
        :meth:`efficiency_at` ``size`` when given."""
        eff = self.efficiency_at(kind, size)
        peak = self.flops.get(dtype) or self.flops["bf16"]
        return max(flops / (peak * eff), bytes_ / (self.mem_bw * eff))

    def link(self, crosses_nodes: bool) -> Link:
        """The fabric a group uses: "inter" if it spans nodes, else "intra"."""
        return self.links["inter" if crosses_nodes and "inter" in self.links else "intra"]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        links = {k: Link(**v) for k, v in d["links"].items()}
        return cls(**{**d, "links": links})


TB, GB = 1e12, 1e9
KB, MB, US = 1024, 1024 * 1024, 1e-6

# ----------------------------------------------------------------------------- collective algorithms
# One entry per (algorithm, protocol) a library runs; cpattn.plan.collectives prices each as
# base + steps * hop + bytes / (beta * bw[kind]) and picks as the library does: an entry with ``windows``
# ([[max ranks, max bytes], ...]) is taken whenever its rule admits the message (vLLM's custom all-reduce is
# chosen by rule, not by cost); among the rest the cheapest wins (NCCL's tuner: the protocol switch by size).
NCCL_NVLINK = [
    # NCCL src/graph/tuning.cc: baseLat Ring {LL 6.6, LL128 14.0, Simple 8.4} us; hwLat NVLINK Ring
    # {LL .6, LL128 1.9, Simple 3.4} us per step. bw: LL moves 8-byte lines of 4 data + 4 flag bytes and
    # NCCL's model caps it at 1/4 (all-reduce) or 1/3 (other collectives) of the bus bandwidth; LL128 at
    # 120/128 of it (also tuning.cc). Inside one node NCCL's tree is a chain with the ring's step count, so
    # the ring entries stand for it.
    {"name": "nccl ring LL", "family": "ring", "base": 6.6 * US, "hop": 0.6 * US,
     "bw": {"all_reduce": 0.25, "*": 1 / 3}},
    {"name": "nccl ring LL128", "family": "ring", "base": 14.0 * US, "hop": 1.9 * US, "bw": {"*": 120 / 128}},
    {"name": "nccl ring Simple", "family": "ring", "base": 8.4 * US, "hop": 3.4 * US, "bw": {"*": 1.0}},
]
VLLM_CUSTOM_AR = [
    # vLLM csrc/custom_all_reduce.cuh (CustomAllreduce::allreduce): one-stage (one-shot: every rank reads all
    # peers' buffers) when world_size == 2, or <= 4 ranks and < 512 KB, or <= 8 ranks and < 256 KB on a fully
    # connected NVLink node; else two-stage (reduce-scatter + all-gather through peer memory);
    # vllm/distributed/device_communicators/custom_all_reduce.py: only up to max_size = 8 MB, else NCCL.
    # base: assumption, 4 us (one kernel and two flag barriers over NVLink, no ring steps).
    {"name": "vllm custom all-reduce 1-stage", "family": "one_shot", "base": 4.0 * US, "hop": 0.0,
     "bw": {"*": 1.0}, "kinds": ["all_reduce"], "windows": [[2, 8 * MB], [4, 512 * KB], [8, 256 * KB]]},
    {"name": "vllm custom all-reduce 2-stage", "family": "two_shot", "base": 4.0 * US, "hop": 2.0 * US,
     "bw": {"*": 1.0}, "kinds": ["all_reduce"], "windows": [[8, 8 * MB]]},
]
NCCL_NET = [
    # NCCL tuning.cc: hwLat NET Ring {LL 2.7, LL128 4.0, Simple 14.0}, Tree {LL 5.0, LL128 8.5, Simple 28} us;
    # the tree's steps: 2 log2(ranks) (an assumption: NCCL counts log2 of the nodes, intra-node hops apart).
    {"name": "nccl ring LL", "family": "ring", "base": 6.6 * US, "hop": 2.7 * US,
     "bw": {"all_reduce": 0.25, "*": 1 / 3}},
    {"name": "nccl ring LL128", "family": "ring", "base": 14.0 * US, "hop": 4.0 * US, "bw": {"*": 120 / 128}},
    {"name": "nccl ring Simple", "family": "ring", "base": 8.4 * US, "hop": 14.0 * US, "bw": {"*": 1.0}},
    {"name": "nccl tree LL", "family": "tree", "base": 6.8 * US, "hop": 5.0 * US, "bw": {"*": 0.25},
     "kinds": ["all_reduce"]},
    {"name": "nccl tree Simple", "family": "tree", "base": 0.0, "hop": 28.0 * US, "bw": {"*": 1.0},
     "kinds": ["all_reduce"]},
]
HCCL_HCCS = [
    # assumption (no published per-step latency): HCCL's full-mesh algorithm on an HCCS node (one step, every
    # peer at once) for small messages, its ring for large ones, both with the node's 10 us alpha
    {"name": "hccl mesh", "family": "one_shot", "base": 10.0 * US, "hop": 0.0, "bw": {"*": 1.0}},
    {"name": "hccl ring", "family": "ring", "base": 0.0, "hop": 10.0 * US, "bw": {"*": 1.0}},
]

H200 = Profile(
    name="h200", device="NVIDIA H200 SXM (HGX H200, 8 GPUs, NVLink 4 + NVSwitch)",
    flops={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "fp32": 67e12},
    mem_bw=4.8 * TB, mem_bytes=141 * GB, devices_per_node=8,
    links={"intra": Link(alpha=8e-6, beta=450 * GB), "inter": Link(alpha=15e-6, beta=50 * GB)},
    efficiency={"gemm": 0.7, "attention": 0.55, "attention_causal": 0.5, "decode_attention": 0.75,
                "elementwise": 0.8},
    launch={"eager": 8e-6, "graph": 2e-6},
    sources={
        "flops": "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/h200): BF16/FP16 1,979 TFLOPS and FP8 "
                 "3,958 TFLOPS *with sparsity*, i.e. 989 / 1,979 dense; FP32 67 TFLOPS",
        "mem_bw": "NVIDIA H200 datasheet: 4.8 TB/s HBM3e",
        "mem_bytes": "NVIDIA H200 datasheet: 141 GB HBM3e",
        "links.intra": "NVIDIA H200 datasheet: NVLink 900 GB/s per GPU (both directions) -> 450 GB/s each way; "
                       "alpha 8 us per point-to-point message (the PCP ring step, the expert all-to-all): assumption; "
                       "collectives use the library tables below",
        "links.inter": "HGX H200 reference: one ConnectX-7 400 Gb/s NIC per GPU -> 50 GB/s; alpha 15 us: assumption",
        "efficiency": "assumption: achieved fraction of peak (dense GEMM 70%, flash attention 50-55%, "
                      "decode attention 75% of HBM bandwidth)",
        "launch": "assumption: 8 us per eager kernel launch, 2 us per kernel inside a CUDA graph",
        "collectives": "vLLM's custom all-reduce (1-stage / 2-stage by vLLM's size rule, up to 8 MB) on NVLink, "
                       "else NCCL's ring LL / LL128 / Simple, the cheapest by NCCL's tuning.cc constants; "
                       "between nodes NCCL's ring and tree (constants and sources in NCCL_NVLINK, "
                       "VLLM_CUSTOM_AR, NCCL_NET)",
    },
    collectives={"intra": VLLM_CUSTOM_AR + NCCL_NVLINK, "inter": NCCL_NET},
)

H100 = Profile(
    name="h100", device="NVIDIA H100 SXM 80 GB (HGX H100, 8 GPUs, NVLink 4 + NVSwitch)",
    flops={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "fp32": 67e12},
    mem_bw=3.35 * TB, mem_bytes=80 * GB, devices_per_node=8,
    links={"intra": Link(alpha=8e-6, beta=450 * GB), "inter": Link(alpha=15e-6, beta=50 * GB)},
    efficiency=dict(H200.efficiency), launch=dict(H200.launch),
    sources={
        "flops": "NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 1,979 / FP8 3,958 TFLOPS with sparsity -> "
                 "989 / 1,979 dense; FP32 67 TFLOPS",
        "mem_bw": "NVIDIA H100 datasheet (SXM): 3.35 TB/s HBM3", "mem_bytes": "NVIDIA H100 datasheet (SXM): 80 GB",
        "links.intra": "NVIDIA H100 datasheet: NVLink 900 GB/s per GPU (both directions) -> 450 GB/s each way",
        "links.inter": "assumption: one 400 Gb/s RDMA NIC per GPU (50 GB/s), as the Llama3-405B CP anchor's hosts",
        "efficiency": "assumption: as for the H200", "launch": "assumption: as for the H200",
        "collectives": "as for the H200",
    },
    collectives={"intra": VLLM_CUSTOM_AR + NCCL_NVLINK, "inter": NCCL_NET},
)

B200 = Profile(
    name="b200", device="NVIDIA B200 (HGX B200, 8 GPUs, NVLink 5 + NVSwitch)",
    flops={"bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12, "fp4": 9000e12, "fp32": 75e12},
    mem_bw=8.0 * TB, mem_bytes=180 * GB, devices_per_node=8,
    links={"intra": Link(alpha=8e-6, beta=900 * GB), "inter": Link(alpha=15e-6, beta=50 * GB)},
    efficiency=dict(H200.efficiency), launch=dict(H200.launch),
    sources={
        "flops": "NVIDIA HGX B200 specifications (nvidia.com/hgx): per GPU FP4 18 / FP8 9 / BF16 4.5 PFLOPS "
                 "*with sparsity* -> halved for dense; FP32 75 TFLOPS",
        "mem_bw": "NVIDIA HGX B200 specifications: 8 TB/s HBM3e per GPU",
        "mem_bytes": "NVIDIA HGX B200 specifications: 1.44 TB for 8 GPUs -> 180 GB per GPU",
        "links.intra": "NVIDIA: NVLink 5, 1.8 TB/s per GPU (both directions) -> 900 GB/s each way",
        "links.inter": "assumption: one 400 Gb/s NIC per GPU -> 50 GB/s",
        "efficiency": "assumption: as for the H200", "launch": "assumption: as for the H200",
        "collectives": "as for the H200 (NCCL's NVLink constants; vLLM's custom all-reduce rule)",
    },
    collectives={"intra": VLLM_CUSTOM_AR + NCCL_NVLINK, "inter": NCCL_NET},
)

ASCEND_910C = Profile(
    name="ascend-910c", device="Huawei Ascend 910C die (Atlas 800T A3: 8 packages x 2 dies = 16 devices, HCCS)",
    flops={"bf16": 400e12, "fp16": 400e12, "int8": 800e12, "fp32": 100e12},
    mem_bw=1.6 * TB, mem_bytes=64 * GB, devices_per_node=16,
    links={"intra": Link(alpha=10e-6, beta=196 * GB), "inter": Link(alpha=20e-6, beta=25 * GB)},
    efficiency={"gemm": 0.6, "attention": 0.45, "attention_causal": 0.4, "decode_attention": 0.7,
                "elementwise": 0.7},
    launch={"eager": 15e-6, "graph": 3e-6},
    sources={
        "flops": "third-party summaries of Huawei's 910C (besthub.dev 'Huawei Ascend AI chip detailed specs', "
                 "2025): 800 TFLOPS FP16 per 910C package of two 910B-class dies -> 400 per die (the device "
                 "vLLM-Ascend schedules); int8 2x: assumption",
        "mem_bw": "assumption: 3.2 TB/s per 910C package (commonly cited), 1.6 TB/s per die",
        "mem_bytes": "third-party summary (boardor.com, 2025): 910C carries 128 GB HBM -> 64 GB per die",
        "devices_per_node": "Huawei MindCluster docs (hiascend.com, 'Atlas 800T A3 SuperPoD'): 8 HiAM modules "
                            "of two processors joined by SIO, modules joined by HCCS: 16 devices per node",
        "links.intra": "besthub.dev summary: 784 GB/s interconnect per 910C package -> 392 GB/s per die both "
                       "directions, 196 GB/s each way; alpha 10 us: assumption",
        "links.inter": "assumption: 200 Gb/s RoCE per die between nodes (25 GB/s), alpha 20 us",
        "efficiency": "assumption: achieved fraction of peak (GEMM 60%, attention 40-45%, decode 70% of HBM)",
        "launch": "assumption: 15 us per eager kernel, 3 us per kernel inside a graph",
        "collectives": "assumption: HCCL's full-mesh one-step algorithm or its ring, the cheaper (HCCL_HCCS)",
    },
    collectives={"intra": HCCL_HCCS},
)

# The CPU default: overwritten by `cpattn plan calibrate` (saved to CPU_PROFILE_PATH); numbers of the
# project's 2-core AMD EPYC (AVX, FMA, no AVX2) with gloo over loopback, measured once, one thread per rank.
CPU_DEFAULT = Profile(
    name="cpu", device="this machine's CPU, one thread per rank, gloo over loopback TCP",
    flops={"fp32": 40e9, "bf16": 40e9, "fp16": 40e9, "fp64": 15e9},
    mem_bw=6 * GB, mem_bytes=8 * GB, devices_per_node=2,
    links={"intra": Link(alpha=150e-6, beta=1.5 * GB, overlap=0.5), "a2a": Link(alpha=150e-6, beta=1.5 * GB),
           "ring": Link(alpha=300e-6, beta=1.5 * GB, overlap=0.5), "native": Link(alpha=250e-6, beta=1.5 * GB)},
    efficiency={"gemm": 1.0, "attention": 0.8, "attention_gqa": 0.8, "attention_causal": 0.65,
                "attention_causal_hm": 0.7, "decode_attention": 1.0, "transpose": 0.5, "elementwise": 1.0,
                "concurrent_bandwidth": 0.9, "concurrent_compute": 1.0},
    launch={"eager": 8e-6, "graph": 1e-6, "view": 2e-6, "graph_call": 100e-6},
    sources={"all": "defaults; run `cpattn plan calibrate` to fit them on this machine"},
)

PROFILES = {p.name: p for p in (H200, H100, B200, ASCEND_910C, CPU_DEFAULT)}
CPU_PROFILE_PATH = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cpattn",
                                "cpu_profile.json")


def get_profile(name: str) -> Profile:
    """A built-in profile by name, ``cpu`` (the calibrated one when saved), or a JSON file's path.

    >>> get_profile("ascend-910c").devices_per_node
    16
    """
    if name == "cpu" and os.path.isfile(CPU_PROFILE_PATH):
        return load_profile(CPU_PROFILE_PATH)
    if name in PROFILES:
        return PROFILES[name]
    if os.path.isfile(name):
        return load_profile(name)
    raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)} or pass a profile JSON path "
                     "(cpattn plan calibrate --out PATH writes one)")


def load_profile(path: str) -> Profile:
    """A profile saved by :func:`save_profile`."""
    with open(path) as f:
        return Profile.from_dict(json.load(f))


def save_profile(profile: Profile, path: str) -> None:
    """Write ``profile`` as JSON (directories created), atomically: a reader sees the old file or the new one."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(profile.as_dict(), f, indent=2)
    os.replace(tmp, path)
