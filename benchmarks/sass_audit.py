"""Register / stack / shared-memory audit of the decode hot path's Triton kernels for sm_90,
on a machine without a GPU.

Each op's own Python wrapper is called with fake CUDA tensors (``FakeTensorMode``: shapes,
dtypes and strides, no memory) at the v4-flash preset's shapes, with 132 SMs reported by
``torch.cuda.get_device_properties``, so every ``default_tiling`` takes its GPU branch.
``JITFunction.run`` is replaced by a recorder that binds the launch's arguments exactly as
Triton does (its own binder: dtypes, constexprs, ints equal to 1 specialized, divisibility
by 16, the launch's num_warps / num_stages) and launches nothing; each recorded launch is
then compiled for sm_90 with Triton's bundled ptxas and read with ``sass_resources``.
Every launch prints one line: kernel, case, the constexprs, warps / stages, registers,
stack bytes, LDL/STL spill instructions and shared bytes ("!" flags stack > 16 bytes or
shared > 232,448 bytes).

    env -u TRITON_INTERPRET .venv/bin/python benchmarks/sass_audit.py [--json] [CASE_SUBSTRING ...]

(``--json``: the records as one JSON list; tests/ops/test_mhc_sm90.py reads them.)

Cases: ``moe_routed`` (the model's fused decode MoE: route + align, gate-up, down, through
``MoE.forward`` as a decoder layer calls it, defer_sum=True), ``moe_experts`` (the fused MoE
without the router), ``gemv`` (the split-K GEMV at 1 token: x-projections, wq_b, wo_b,
grouped wo_a, the lm_head's fp32 logits), ``sparse_attn`` (the decode attention at 1 and 64
queries; from 128 queries the model takes the prefill / wgmma attention, audited apart),
``indexer`` (the CSA indexer's logits + top-k at 1, 64, 256 queries over 4096 / 4 entries),
``rms_norm q_a``, ``rope_cos_sin``, ``embed_streams``, ``hc_post_pre`` (a block's mHC at
decode and prefill sizes, with a plain block output or a fused MoE's unsummed slots: it
flags the expand-fused K1's spills at 16 and 64 tokens), ``k1 <candidate>`` (hc_post_pre
with each ``mhc.EXPAND_K1_*`` candidate, plain and with slots).
Not covered (their inputs are the step metadata's and caches' and are not rebuilt here):
the attention prologue / kv_insert, compress, step_meta, the prefill indexer / MoE.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import types
from collections.abc import Callable

os.environ.pop("TRITON_INTERPRET", None)  # the compile needs the real backend

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_resources import resources

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
MAX_SHARED = 232448
MAX_STACK = 16
aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------
# a CUDA device without a GPU: fake tensors, 132 SMs, and the few tensor methods whose Python
# bindings take a CUDA device guard (which a CPU-only torch does not have)


def _split_index(self: torch.Tensor, idx) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Basic indexing applied as views; advanced (tensor / list) indices by output dim."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    used = sum(
        i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
        for i in idx
        if i is not None and i is not Ellipsis
    )
    out, dim, adv = self, 0, {}
    for i in idx:
        if i is None:
            out = out.unsqueeze(dim)
            dim += 1
        elif i is Ellipsis:
            dim += self.dim() - used
        elif isinstance(i, bool):
            raise NotImplementedError("bool index")
        elif isinstance(i, (int, torch.SymInt)):
            out = out.select(dim, i)
        elif isinstance(i, slice):
            stop = 2**62 if i.stop is None else i.stop
            out = aten.slice.Tensor(out, dim, i.start or 0, stop, i.step or 1)
            dim += 1
        else:
            t = i if isinstance(i, torch.Tensor) else torch.tensor(i, device=self.device)
            adv[dim] = t
            dim += 1
    return out, adv


def _getitem(self, idx):
    out, adv = _split_index(self, idx)
    if adv:
        out = aten.index.Tensor(out, [adv.get(d) for d in range(max(adv) + 1)])
    return out


def _copy_(self, src, non_blocking=False):
    if not isinstance(src, FakeTensor) or src.device != self.device:
        src = torch.empty(src.shape, dtype=src.dtype, device=self.device)
    return aten.copy_(self, src)


def _setitem(self, idx, value):
    out, adv = _split_index(self, idx)
    if adv:
        if not isinstance(value, torch.Tensor):
            value = torch.full((), value, dtype=out.dtype, device=out.device)
        aten.index_put_(out, [adv.get(d) for d in range(max(adv) + 1)], value)
    elif isinstance(value, torch.Tensor):
        _copy_(out, value)
    else:
        out.fill_(value)


def _to(self, *args, **kwargs):
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    for a in args:
        if isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.dtype):
            dtype = a
    out = self
    if device is not None and torch.device(device).type != self.device.type:
        out = torch.empty(self.shape, dtype=self.dtype, device=device)
    if dtype is not None and dtype != out.dtype:
        out = aten._to_copy.default(out, dtype=dtype)
    return out


def _contiguous(self, memory_format=torch.contiguous_format):
    if self.is_contiguous(memory_format=memory_format):
        return self
    return torch.empty(self.shape, dtype=self.dtype, device=self.device)


FakeTensor.__getitem__ = _getitem
FakeTensor.__setitem__ = _setitem
FakeTensor.copy_ = _copy_
FakeTensor.to = _to
FakeTensor.contiguous = _contiguous

_PROPS = types.SimpleNamespace(
    multi_processor_count=132,
    name="NVIDIA H100 80GB HBM3",
    major=9,
    minor=0,
    total_memory=80 * 2**30,
    shared_memory_per_block_optin=MAX_SHARED,
    L2_cache_size=50 * 2**20,
)
torch.cuda.get_device_properties = lambda *a, **k: _PROPS
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.is_current_stream_capturing = lambda: False
for _name in ("uniform_", "normal_", "random_", "exponential_", "bernoulli_"):
    setattr(torch.Tensor, _name, lambda self, *a, **k: self)  # module init on fake CUDA

from rackserve.ops.side_stream import SideStream  # noqa: E402

SideStream.of = classmethod(lambda cls, device: cls(None))  # issue order, no CUDA stream

# ---------------------------------------------------------------------------------------------
# launches recorded with Triton's own binder instead of run

LAUNCHES: list[dict] = []


class _Pointer:
    """A tensor as Triton's specialization sees it: its dtype and the alignment of its data
    (a fresh allocation is 256-byte aligned; a view's storage offset may unalign it)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype = t.dtype
        self._offset = t.storage_offset() * t.element_size()

    def data_ptr(self) -> int:
        return (1 << 20) + self._offset


def _record(self, *args, grid, warmup, **kwargs):
    kwargs.setdefault("debug", self.debug)
    binder = create_function_from_signature(self.signature, self.params, BACKEND)
    args = [_Pointer(a) if isinstance(a, torch.Tensor) else a for a in args]
    kwargs = {k: _Pointer(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound, spec, opts)
    LAUNCHES.append(
        dict(fn=self, signature=signature, constexprs=constexprs, attrs=attrs, options=options)
    )


JITFunction.run = _record


def compile_launch(launch: dict):
    src = ASTSource(
        fn=launch["fn"],
        signature=launch["signature"],
        constexprs=launch["constexprs"],
        attrs=launch["attrs"],
    )
    return triton.compile(src, target=TARGET, options=launch["options"].__dict__)


def describe(launch: dict) -> str:
    names = launch["fn"].arg_names
    shown = []
    for path, value in launch["constexprs"].items():
        name = names[path[0]]
        if name == "PDL" or name.startswith("stride"):
            continue
        if isinstance(value, bool):
            value = int(value)
        shown.append(f"{name}={getattr(value, 'name', value)}")
    return " ".join(shown)


# ---------------------------------------------------------------------------------------------
# the cases: v4-flash shapes, bf16

HIDDEN, HEADS, HEAD_DIM, Q_LORA, ROPE = 4096, 64, 512, 1024, 64
O_GROUPS, O_LORA, INTER, EXPERTS, TOP_K, VOCAB = 8, 1024, 2048, 64, 6, 129280
INDEX_HEADS, INDEX_DIM, INDEX_TOPK, WINDOW, CSA_RATIO, HCA_RATIO = 64, 128, 512, 128, 4, 128
CONTEXT = 4096
BF16 = torch.bfloat16
CUDA = torch.device("cuda")


def _empty(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device=CUDA)


def case_moe_routed(tokens: int) -> None:
    """The decoder layer's routed MoE (non-hash router, shared expert folded in)."""
    from rackserve import ops
    from rackserve.model.moe import MoE
    from rackserve.model.presets import preset_config

    cfg = preset_config("v4-flash", 4, EXPERTS)
    with torch.device(CUDA):
        moe = MoE(cfg, hashed=False, kernels=ops.kernels("auto"))
    for name, p in moe.named_parameters():
        if p.is_floating_point() and not name.endswith("bias"):
            p.data = _empty(*p.shape)
    moe(_empty(tokens, HIDDEN), _empty(tokens, dtype=torch.int64), defer_sum=True)


def case_moe_experts(tokens: int) -> None:
    from rackserve.ops.triton.fused_moe import moe_experts

    ids, weights = (
        _empty(tokens, TOP_K, dtype=torch.int32),
        _empty(tokens, TOP_K, dtype=torch.float32),
    )
    w13, w2 = _empty(EXPERTS, 2 * INTER, HIDDEN), _empty(EXPERTS, HIDDEN, INTER)
    moe_experts(_empty(tokens, HIDDEN), ids, weights, w13, w2, 10.0)


def case_gemv(n: int, k: int, groups: int = 1, out_dtype=None) -> Callable[[int], None]:
    def run(tokens: int) -> None:
        from rackserve.ops.triton.gemv import gemv

        x = _empty(tokens, groups, k) if groups > 1 else _empty(tokens, k)
        gemv(x, _empty(n, k), groups=groups, out_dtype=out_dtype)

    run.__name__ = f"gemv {k}->{n}" + (f" g{groups}" if groups > 1 else "")
    return run


def case_sparse_attn(compressed: int) -> Callable[[int], None]:
    """Decode attention: the window's 128 rows + ``compressed`` rows (CSA: the indexer's
    512 picks; HCA: 4096 / 128 entries), K = V rows of 512, RoPE undone on the last 64."""

    def run(tokens: int) -> None:
        from rackserve.ops.triton.sparse_attn import paged_sparse_attention

        paged_sparse_attention(
            _empty(tokens, HEADS, HEAD_DIM), _empty(4096, HEAD_DIM),
            _empty(tokens, WINDOW, dtype=torch.int32), _empty(4096, HEAD_DIM),
            _empty(tokens, compressed, dtype=torch.int32),
            _empty(tokens, WINDOW + compressed, dtype=torch.bool),
            _empty(HEADS, dtype=torch.float32), HEAD_DIM**-0.5,
            _empty(tokens, ROPE // 2), _empty(tokens, ROPE // 2),
        )  # fmt: skip

    run.__name__ = f"sparse_attn {WINDOW}+{compressed}"
    return run


def case_indexer(tokens: int) -> None:
    """The CSA indexer's scores and top-512 over the request's 4096 / 4 entries."""
    from rackserve.ops.triton.indexer import paged_indexer_select

    entries = CONTEXT // CSA_RATIO
    paged_indexer_select(
        _empty(tokens, INDEX_HEADS, INDEX_DIM), _empty(entries * 4, HEAD_DIM + INDEX_DIM),
        _empty(tokens, entries, dtype=torch.int64),
        _empty(tokens, INDEX_HEADS, dtype=torch.float32),
        INDEX_DIM**-0.5, _empty(tokens, dtype=torch.int32), INDEX_TOPK,
        _empty(tokens, WINDOW, dtype=torch.bool),
    )  # fmt: skip


def case_rms_norm(tokens: int) -> None:
    """The attention's q_a norm (q_residual [T, 1024], fp32 weight)."""
    from rackserve.ops.triton.norm_rope import rms_norm

    rms_norm(_empty(tokens, Q_LORA), _empty(Q_LORA, dtype=torch.float32), 1e-6)


def case_rope_cos_sin(tokens: int) -> None:
    from rackserve.ops.triton.norm_rope import rope_cos_sin

    rope_cos_sin(
        _empty(tokens, dtype=torch.int64), _empty(ROPE // 2, dtype=torch.float32), 1.0, BF16
    )


def case_embed(tokens: int) -> None:
    from rackserve.ops.triton.embed import embed_streams

    embed_streams(_empty(tokens, dtype=torch.int64), _empty(VOCAB, HIDDEN), 4)


def case_hc_post_pre(tokens: int, slots: bool = False, tiling=None) -> None:
    """A block's mHC: the previous block's expand, then K1 + K2 (N 4 streams); ``slots``:
    after a fused MoE, its unsummed slots (the shared expert's last: k 7) as the block
    output; ``tiling``: a function of the default tiling."""
    from rackserve.ops.reference import ExpertSlots
    from rackserve.ops.triton import mhc

    n, f32 = 4, torch.float32
    block_out = _empty(tokens, HIDDEN)
    if slots:
        k = TOP_K + 1
        block_out = ExpertSlots(
            _empty(tokens * k, HIDDEN, dtype=f32), _empty(tokens, k, dtype=torch.int64),
            EXPERTS + 1, BF16,
        )  # fmt: skip
    if tiling is not None:
        tiling = tiling(mhc.default_tiling(tokens, n, HIDDEN, CUDA, BF16))
    mhc.hc_post_pre(
        _empty(tokens, n, HIDDEN), block_out, _empty(tokens, n, dtype=f32),
        _empty(tokens, n, n, dtype=f32), _empty((2 + n) * n, n * HIDDEN, dtype=f32),
        _empty((2 + n) * n, dtype=f32), _empty(3, dtype=f32), _empty(HIDDEN, dtype=f32),
        20, 1e-6, 1e-6, tiling=tiling,
    )  # fmt: skip


def case_expand_k1(name: str, slots: bool) -> Callable[[int], None]:
    """hc_post_pre with an expand-fused K1 candidate (``mhc.EXPAND_K1_*``)."""

    def run(tokens: int) -> None:
        from rackserve.ops.triton import mhc

        every = mhc.EXPAND_K1_DECODE | mhc.EXPAND_K1_PREFILL
        case_hc_post_pre(tokens, slots, lambda base: mhc.expand_k1_tiling(base, every[name]))

    return run


def _expand_k1_cases() -> list[tuple[str, Callable[[int], None], tuple[int, ...]]]:
    """The decode candidates at 64 tokens after an attention block and after a fused MoE
    (its slots); the prefill ones at 8192 after a plain block output (the prefill MoE sums
    its own slots)."""
    from rackserve.ops.triton import mhc

    cases = [
        (f"k1 {n}{s}", case_expand_k1(n, bool(s)), (64,))
        for n in mhc.EXPAND_K1_DECODE
        for s in ("", " slots")
    ]
    return cases + [(f"k1 {n}", case_expand_k1(n, False), (8192,)) for n in mhc.EXPAND_K1_PREFILL]


DECODE = (1, 64, 256)
CASES: list[tuple[str, Callable[[int], None], tuple[int, ...]]] = [
    ("moe_routed", case_moe_routed, DECODE),
    ("moe_experts", case_moe_experts, DECODE),
    ("gemv x-proj", case_gemv(Q_LORA, HIDDEN), (1,)),
    ("gemv wq_b", case_gemv(HEADS * HEAD_DIM, Q_LORA), (1,)),
    ("gemv wo_a", case_gemv(O_GROUPS * O_LORA, HEADS * HEAD_DIM // O_GROUPS, O_GROUPS), (1,)),
    ("gemv wo_b", case_gemv(HIDDEN, O_GROUPS * O_LORA), (1,)),
    ("gemv lm_head", case_gemv(VOCAB, HIDDEN, out_dtype=torch.float32), (1,)),
    ("sparse_attn csa", case_sparse_attn(INDEX_TOPK), (1, 64)),
    ("sparse_attn hca", case_sparse_attn(CONTEXT // HCA_RATIO), (1, 64)),
    ("indexer", case_indexer, DECODE),
    ("rms_norm q_a", case_rms_norm, DECODE),
    ("rope_cos_sin", case_rope_cos_sin, DECODE),
    ("embed_streams", case_embed, DECODE),
    ("hc_post_pre", case_hc_post_pre, (1, 16, 64, 256, 8192)),
    ("hc_post_pre slots", functools.partial(case_hc_post_pre, slots=True), (16, 64, 256)),
    *_expand_k1_cases(),
]


def audit(wanted: list[str]) -> list[dict]:
    """Every distinct launch of the cases whose label contains one of ``wanted`` (all when
    empty), compiled for sm_90: one record each (case, tokens, kernel, warps, stages,
    registers, stack bytes, spill instructions, shared bytes, constexprs), or a record with
    ``skipped`` where the case could not run on fake tensors."""
    records = []
    for label, case, batches in CASES:
        if wanted and not any(w in label for w in wanted):
            continue
        for tokens in batches:
            LAUNCHES.clear()
            try:
                with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
                    case(tokens)
            except Exception as exc:
                records.append({"case": label, "tokens": tokens,
                                "skipped": f"{type(exc).__name__}: {exc}"[:160]})  # fmt: skip
                continue
            seen = set()
            for launch in LAUNCHES:
                key = (launch["fn"].__name__, describe(launch), str(launch["options"]))
                if key in seen:
                    continue
                seen.add(key)
                r = resources(compile_launch(launch))
                opts = launch["options"]
                records.append({
                    "case": label, "tokens": tokens, "kernel": launch["fn"].__name__,
                    "warps": opts.num_warps, "stages": opts.num_stages,
                    "registers": r["registers"], "stack_bytes": r["stack_bytes"],
                    "spills": r["spills"], "shared_bytes": r["shared_bytes"],
                    "constexprs": describe(launch),
                })  # fmt: skip
    return records


def _flagged(r: dict) -> bool:
    return r["stack_bytes"] > MAX_STACK or r["shared_bytes"] > MAX_SHARED


def _line(r: dict) -> str:
    if "skipped" in r:
        return f"{r['case']:<22} {r['tokens']:>4}  SKIPPED: {r['skipped']}"
    return (
        f"{r['case']:<22} {r['tokens']:>4}  {r['kernel']:<30} {r['warps']:>2}/{r['stages']:<2} "
        f"{r['registers']:>4} {r['stack_bytes']:>6} {r['spills']:>5} {r['shared_bytes']:>7}"
        f"{' !' if _flagged(r) else '  '}{r['constexprs']}"
    )


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    records = audit([a for a in argv[1:] if a != "--json"])
    if as_json:
        print(json.dumps(records))
        return 0
    print(f"{'case':<22} {'T':>4}  {'kernel':<30} {'w/s':>5} {'reg':>4} {'stack':>6} "
          f"{'spill':>5} {'shared':>7}  constexprs")  # fmt: skip
    for r in records:
        print(_line(r))
    flagged = [r for r in records if "skipped" not in r and _flagged(r)]
    print(f"\n{len(flagged)} launches over {MAX_STACK} stack bytes or {MAX_SHARED} shared bytes")
    for r in flagged:
        print(_line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
