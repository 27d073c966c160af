"""Capture backends: how one decode program becomes a replayable graph.

A backend turns ``program(*args)`` -- a pure step over *persistent* argument
tensors that keep their addresses and shapes -- into a zero-argument
``replay()`` that reruns it on whatever those tensors hold now. The runner
(:mod:`cpattn.graphs.runner`) calls :meth:`Backend.capture` once per capture
size, largest first.

=========== ==================================================================
name        what replay runs
=========== ==================================================================
eager       the step itself (padding and buffers, no compiler): a reference
cpu         ``torch.compile(backend="inductor", fullgraph=True, dynamic=False)``
inductor    same as cpu, on any device inductor supports
aot_eager   ``torch.compile(backend="aot_eager", fullgraph=True)``: traced,
            functionalized, not code-generated (torchair's precondition)
cuda        ``torch.cuda.CUDAGraph`` per size, one shared memory pool,
            warm-up on a side stream before capture
npu         ``torch.npu.NPUGraph`` per size, the same recipe as cuda
            (torch_npu, imported lazily; untested on hardware)
torchair    ``torch.compile`` with torchair's ``get_npu_backend`` and a
            ``CompilerConfig`` (mode "max-autotune" = GE graph, or
            "reduce-overhead" = aclgraph); untested on hardware
auto        cuda / npu / cpu by the device of the state tensors
=========== ==================================================================

Add a backend by subclassing :class:`Backend` and calling
:func:`register_backend` (see docs/graphs.md).
"""

from __future__ import annotations

import abc
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

Replay = Callable[[], Any]


class BackendUnavailable(RuntimeError):
    """The backend needs a device or package this machine does not have."""


class StaticStepError(RuntimeError):
    """The step cannot be captured: it syncs, allocates by data, or changes shape."""


class Backend(abc.ABC):
    """Turns a program over persistent tensors into a replayable graph.

    Subclasses implement :meth:`capture`. ``compiles`` counts the graphs the
    compiler produced (for compile backends: every dynamo frame compiled), so
    a test can check that replays never recompile.
    """

    name: str = "?"

    def __init__(self) -> None:
        self.compiles = 0

    @abc.abstractmethod
    def capture(self, program: Callable[..., Any], args: tuple, size: int) -> Replay:
        """Capture ``program(*args)`` for capture size ``size``; return ``replay()``.

        ``args`` are pytrees of persistent tensors: replay reads their current
        contents, never new objects. The returned ``replay()`` gives the
        program's outputs; they must stay valid after the next replay (clone
        static output buffers if the backend has them).
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class EagerBackend(Backend):
    """Run the step as is on the padded persistent buffers (no compiler)."""

    name = "eager"

    def capture(self, program, args, size):
        return lambda: program(*args)


class CompileBackend(Backend):
    """``torch.compile(fullgraph=True, dynamic=False)``, one compiled program per size.

    Arguments
    ---------
    compiler: a registered dynamo backend name ("inductor", "aot_eager", ...)
        or a dynamo backend callable ``(gm, example_inputs) -> callable``.
    name: the name shown in errors and stats.
    strict: reject traced graphs with data-dependent values or shapes
        (``.item()``, ``.tolist()``, ``nonzero``, boolean masks, sizes read
        from tensors). With ``fullgraph=True`` dynamo traces these as unbacked
        symbols instead of breaking the graph; they would sync with the host
        inside a CUDA/NPU graph, so a captured step must not have them.

    Each size gets its own trampoline function with its own code object, so
    dynamo keeps one cache per size: sizes never evict each other and the
    recompile limit never applies. The first call (inside :meth:`capture`)
    compiles; replays only evaluate guards.

    Example
    -------
    >>> import torch
    >>> b = CompileBackend("aot_eager")
    >>> x = torch.ones(3)
    >>> replay = b.capture(lambda t: t * 2, (x,), size=3)
    >>> x.fill_(5.0); replay()
    tensor([5., 5., 5.])
    tensor([10., 10., 10.])
    >>> b.compiles
    1
    """

    def __init__(self, compiler: str | Callable = "inductor", name: str | None = None, strict: bool = True):
        super().__init__()
        self.compiler = compiler
        self.strict = strict
        self.name = name or (compiler if isinstance(compiler, str) else getattr(compiler, "__name__", "compile"))

    def _counted(self) -> Callable:
        inner = torch._dynamo.lookup_backend(self.compiler) if isinstance(self.compiler, str) else self.compiler

        def backend(gm, example_inputs):
            self.compiles += 1
            bad = data_dependent_nodes(gm) if self.strict else []
            if bad:
                raise StaticStepError(
                    "the traced step has values or shapes that depend on tensor contents (a host sync "
                    "or an allocation by data inside a captured program):\n  " + "\n  ".join(bad)
                    + "\nCompute them in the host-side plan, or with fixed-shape tensor ops "
                    "(torch.where instead of masks, padded sizes instead of data-dependent ones)"
                )
            return inner(gm, example_inputs)

        return backend

    def capture(self, program, args, size):
        compiled = torch.compile(own_code(program), backend=self._counted(), fullgraph=True, dynamic=False)
        compiled(*args)  # compile now (and warm up), not at the first decode step
        return lambda: compiled(*args)


class DeviceGraphBackend(Backend):
    """Manual stream capture: ``torch.cuda.CUDAGraph`` or ``torch.npu.NPUGraph`` per size.

    Every graph allocates from one shared memory pool (``graph_pool_handle``);
    sizes are captured largest first, so smaller graphs reuse the larger
    ones' blocks. Before capture the program runs ``warmup`` times on a side
    stream (lazy initialisation, allocator warm-up, library handles). Output
    tensors are static buffers of the graph: replay returns clones.

    Nothing inside the program may synchronise with the host (``.item()``,
    ``.tolist()``, data-dependent shapes): the capture fails with an error
    from the driver if it does. Untested on hardware in this repository.

    Arguments
    ---------
    device_type: "cuda" or "npu".
    warmup: eager runs on the side stream before capture.
    compile_first: wrap the program in ``torch.compile(backend="inductor")``
        before capture (fuses elementwise work; the graph then holds the
        generated kernels).
    """

    def __init__(self, device_type: str = "cuda", warmup: int = 2, compile_first: bool = False):
        super().__init__()
        self.name = device_type
        self.device_type = device_type
        self.warmup = warmup
        self.compile_first = compile_first
        self.mod = _device_module(device_type)
        self.pool = None

    def capture(self, program, args, size):
        mod = self.mod
        if self.compile_first:
            program = torch.compile(own_code(program), backend="inductor", fullgraph=True, dynamic=False)
        if self.pool is None:
            self.pool = mod.graph_pool_handle()
        side = mod.Stream()
        side.wait_stream(mod.current_stream())
        with mod.stream(side):
            for _ in range(self.warmup):
                program(*args)
        mod.current_stream().wait_stream(side)
        graph = mod.CUDAGraph() if self.device_type == "cuda" else mod.NPUGraph()
        with mod.graph(graph, pool=self.pool):
            static_out = program(*args)
        self.compiles += 1

        def replay():
            graph.replay()
            return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, static_out)

        return replay


def data_dependent_nodes(gm: torch.fx.GraphModule) -> list[str]:
    """Describe every FX node whose traced value holds an unbacked symbol.

    With ``dynamic=False`` every legitimate size is a plain int, so a
    SymInt/SymFloat/SymBool -- as a value or inside a tensor's shape -- comes
    from tensor contents: ``.item()``, ``.tolist()``, ``nonzero``, masks.
    """
    bad = []
    for node in gm.graph.nodes:
        for leaf in pytree.tree_leaves(node.meta.get("example_value")):
            sizes = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else (leaf,)
            if any(isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)) for s in sizes):
                bad.append(f"{node.op} {getattr(node.target, '__name__', node.target)} -> {leaf}{_where(node)}")
                break
    return bad


def _where(node: torch.fx.Node) -> str:
    """' at File "...", line N: code' from the node's stack trace, if dynamo kept one."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines()]
    files = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not files:
        return ""
    i = files[-1]
    return f"  at {lines[i]}: {lines[i + 1] if i + 1 < len(lines) else ''}"


def own_code(fn: Callable) -> Callable:
    """A trampoline ``(*args) -> fn(*args)`` with a code object of its own.

    torch.compile keeps its cache (and its recompile limit) per code object;
    one trampoline per capture size gives each size a private cache.
    """

    def program(*args):
        return fn(*args)

    program.__code__ = program.__code__.replace()  # a new code object, same body
    return program


def _device_module(device_type: str) -> types.ModuleType:
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "backend 'cuda' needs a CUDA GPU but torch.cuda.is_available() is False; "
                "use backend='cpu' (inductor) or 'eager'"
            )
        return torch.cuda
    if device_type == "npu":
        import_torch_npu("npu")
        return torch.npu
    raise ValueError(f"device graphs exist for 'cuda' and 'npu'; got device_type={device_type!r}")


def import_torch_npu(backend: str) -> types.ModuleType:
    """Import torch_npu lazily; raise :class:`BackendUnavailable` with a fix if absent."""
    try:
        import torch_npu  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise BackendUnavailable(
            f"backend {backend!r} needs torch_npu (Ascend's PyTorch adapter) and the CANN toolkit, "
            f"and importing torch_npu failed ({e}); on an Ascend host `pip install cpattn[npu]`, "
            "call cpattn.ops.enable_npu(), or pick backend='cpu' / 'eager' here"
        ) from e
    return torch_npu


class TorchairBackend(CompileBackend):
    """``torch.compile`` with torchair's NPU backend (``get_npu_backend``); untested on hardware.

    Arguments
    ---------
    mode: torchair ``CompilerConfig.mode``: "max-autotune" (Ascend IR / GE
        graph, the default) or "reduce-overhead" (aclgraph, kernels captured
        as in CUDA graphs).
    config: a ready ``CompilerConfig`` (overrides ``mode``).

    Collectives inside the graph may need torchair's ``patch_for_hcom()``
    on older releases; the program must first pass
    ``torch.compile(backend="aot_eager", fullgraph=True)`` on CPU.
    """

    def __init__(self, mode: str = "max-autotune", config: Any = None):
        import_torch_npu("torchair")
        try:
            import torchair
        except ImportError:  # pragma: no cover - older torch_npu keep it inside
            from torch_npu.dynamo import torchair
        if config is None:
            config = torchair.CompilerConfig()
            config.mode = mode
        super().__init__(torchair.get_npu_backend(compiler_config=config), name="torchair")


# name -> factory; see register_backend
_BACKENDS: dict[str, Callable[[], Backend]] = {
    "eager": EagerBackend,
    "cpu": lambda: CompileBackend("inductor", name="cpu"),
    "inductor": lambda: CompileBackend("inductor"),
    "aot_eager": lambda: CompileBackend("aot_eager"),
    "cuda": lambda: DeviceGraphBackend("cuda"),
    "npu": lambda: DeviceGraphBackend("npu"),
    "torchair": TorchairBackend,
}
_AUTO = {"cuda": "cuda", "npu": "npu", "privateuseone": "npu", "cpu": "cpu"}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Make ``backend=name`` available to :class:`~cpattn.graphs.runner.DecodeRunner`.

    Example
    -------
    >>> register_backend("my_eager", EagerBackend)
    >>> get_backend("my_eager").name
    'eager'
    """
    _BACKENDS[name] = factory


def backends() -> list[str]:
    """Names accepted by :func:`get_backend` (plus "auto")."""
    return sorted(_BACKENDS) + ["auto"]


def get_backend(backend: str | Backend, device: torch.device | str | None = None) -> Backend:
    """A :class:`Backend` from a name ("auto" picks by ``device``) or an instance.

    Example
    -------
    >>> get_backend("auto", "cpu").name
    'cpu'
    """
    if isinstance(backend, Backend):
        return backend
    if backend == "auto":
        kind = torch.device(device).type if device is not None else "cpu"
        backend = _AUTO.get(kind, "eager")
    if backend not in _BACKENDS:
        raise ValueError(f"unknown graph backend {backend!r}; choose one of {backends()} or pass a Backend")
    return _BACKENDS[backend]()
