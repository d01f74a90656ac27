"""Counting the kernel launches of a forward on the CPU (the M2 gate: <= 20 per decode layer).

A :class:`LaunchCounter` is a ``TorchDispatchMode`` that counts every aten op that launches
a kernel on a GPU (views, allocations and metadata ops launch none), plus every Triton
kernel launch (under ``TRITON_INTERPRET=1``: the interpreter's ``run``; the torch ops the
interpreter itself runs to copy arguments are not counted). Launches are attributed to the
innermost scope entered with :meth:`LaunchCounter.scope` (e.g. one per decoder layer).

The counter also records each Triton launch's *compile key*: its constexpr arguments and how
Triton would specialize the rest (dtypes; ints equal to 1 or divisible by 16). A key the
process has not seen is a JIT compile on a GPU (tens to hundreds of ms), so an eager step
whose keys depend on the exact context length recompiles every step: a test asserts they
do not.

Known gap against the GPU profiler: a cuBLAS GEMM may add a split-K reduce kernel on the
GPU (one aten ``mm`` here). A CUDA graph records what its captured region launches:
:func:`count_step_launches` counts a decode step both ways, the eager step (metadata,
forward, logits) and ``DecodeGraphs.forward`` (what the graph captures, same padding and
context bucket), with the metadata in its own scope.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that allocate or describe tensors without launching a kernel
_NO_LAUNCH = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "detach",
    "alias",
    "_unsafe_view",
    "_local_scalar_dense",  # a host sync, not a launch (a test asserts there is none)
    "resize_",
    "set_",
    "is_same_size",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
}


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` launches a GPU kernel (not a view, an allocation or metadata)."""
    if func.is_view:
        return False
    return func.overloadpacket.__name__ not in _NO_LAUNCH


class LaunchCounter(TorchDispatchMode):
    """``with LaunchCounter() as c: model(...)``; then ``c.by_scope[name]``: a Counter of
    op name -> launches in that scope (Triton kernels as ``triton:<kernel>``)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_scope: dict[str, Counter] = {}
        self._scopes = ["outside"]
        self._in_kernel = 0
        self._patched: list[tuple[type, object] | None] = []  # one per __enter__
        self.host_syncs = 0
        self.compile_keys: set[tuple] = set()  # (kernel, specialization) per Triton launch

    def total(self, scope: str) -> int:
        return sum(self.by_scope.get(scope, Counter()).values())

    def _add(self, name: str) -> None:
        self.by_scope.setdefault(self._scopes[-1], Counter())[name] += 1

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
            # what the GPU runs: the ops it decomposes into (einsum -> permutes + bmm + copy)
            with self:  # the mode is off inside its own handler: count the parts
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if not self._in_kernel:
            name = func.overloadpacket.__name__
            if name == "_local_scalar_dense":
                self.host_syncs += 1
            if launches_kernel(func):
                self._add(name)
        return func(*args, **kwargs)

    def __enter__(self):
        self._patch_triton()
        return super().__enter__()

    def __exit__(self, *exc):
        # undo this entry's patch only: the mode is re-entered while it decomposes an op,
        # and clearing every patch there left the outer one on the class for good (later
        # counters then counted each Triton launch twice)
        patch = self._patched.pop()
        if patch is not None:
            cls, run = patch
            cls.run = run
        return super().__exit__(*exc)

    def _patch_triton(self) -> None:
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:  # no Triton: nothing to count there
            self._patched.append(None)
            return
        original = InterpretedFunction.run
        counter = self

        def run(fn, *args, **kwargs):
            if kwargs.get("warmup") or counter._in_kernel:
                return original(fn, *args, **kwargs)
            counter._add(f"triton:{fn.__name__}")
            counter.compile_keys.add((fn.__name__, *_specialization(args, kwargs)))
            counter._in_kernel += 1
            try:
                return original(fn, *args, **kwargs)
            finally:
                counter._in_kernel -= 1

        InterpretedFunction.run = run
        self._patched.append((InterpretedFunction, original))


def _specialization(args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a launch for: every keyword (the constexprs and launch options)
    by value, positional tensors by dtype, ints by class (1, divisible by 16, other)."""

    def spec(a: object) -> object:
        if isinstance(a, torch.Tensor):
            return str(a.dtype)
        if isinstance(a, bool) or not isinstance(a, int):
            return type(a).__name__
        return 1 if a == 1 else "d16" if a % 16 == 0 else "int"

    named = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in ("grid", "warmup")))
    return tuple(spec(a) for a in args), named


def count_layer_launches(
    model: torch.nn.Module, run, counter: LaunchCounter | None = None
) -> tuple[LaunchCounter, list[str]]:
    """Run ``run()`` under a :class:`LaunchCounter` (``counter`` or a new one) with one scope
    per decoder layer of ``model`` (a ``DeepseekV4ForCausalLM``; a layer's ``run``), named
    ``"<i>:<kind>"``. Returns the counter and the layer scope names in order; launches
    outside the layers land in "outside". (A layer's scope holds the next layer's fused
    mHC pre.)"""
    counter = counter or LaunchCounter()
    layers = list(model.model.layers)
    names = [f"{i}:{layer.attn.kind}" for i, layer in enumerate(layers)]

    def scoped(fn, name):
        def call(*args, **kwargs):
            with counter.scope(name):
                return fn(*args, **kwargs)

        return call

    for layer, name in zip(layers, names, strict=True):
        layer.run = scoped(layer.run, name)
    try:
        with counter:
            run()
    finally:
        for layer in layers:
            del layer.run
    return counter, names


def count_step_launches(graphs, key: tuple[int, int], inputs, table_writes) -> dict[str, dict]:
    """Launches of one decode step, eager and as ``graphs`` (a ``DecodeGraphs``) captures
    it for ``key`` (its padded batch and context bucket), per scope: "metadata" (the
    step's slots and plans), the layers ("<i>:<kind>"), "outside" (embedding, rope, head,
    logits). Returns {"eager": {scope: Counter}, "graph": {...}}; the step's table writes
    are applied first (neither count holds them: the runner's copy, not the forward). The
    model's fused weights must exist already (``cast`` builds them).

    The eager step uploads ``inputs`` and builds its metadata as the runner's eager path
    does (``StepBuffers.eager_step``); the graph's region runs eagerly here, on the inputs
    ``DecodeGraphs.run`` stages (padded rows, the bucket)."""
    model, buffers = graphs.model, graphs.buffers
    writes = (table_writes[0][:0], table_writes[1][:0])
    graphs.stage(key, inputs, table_writes)  # the static inputs, the table writes
    out = {}

    def eager() -> None:
        with counter.scope("metadata"):
            ids, meta, idx = buffers.eager_step(inputs, writes)
        hidden, _ = model(ids, meta, graphs.caches)
        model.compute_logits(hidden[idx])

    def graph() -> None:
        real = graphs.metadata

        def metadata(*args):
            with counter.scope("metadata"):
                return real(*args)

        graphs.metadata = metadata
        try:
            graphs.forward(*key)
        finally:
            del graphs.metadata

    for name, run in (("eager", eager), ("graph", graph)):
        counter = LaunchCounter()  # the scope of eager() and graph()
        count_layer_launches(model, run, counter)
        out[name] = dict(counter.by_scope)
    return out
