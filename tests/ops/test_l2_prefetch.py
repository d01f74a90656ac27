"""``ops/triton/l2_prefetch.py`` and ``Kernels.prefetch``: where the decode step reads its
next weight stream into L2, on a stream of its own, and that doing so changes nothing.

On CPU: the kernel compiles for sm_90 to loads with no shared memory and keeps them; under
the interpreter it leaves the weight as it was; the model asks for the right weights at the
right points and joins each before its GEMM (the calls recorded on the interpreted fast
path); the op does nothing off CUDA. On a GPU (``gpu`` mark): the step is bitwise the same
with the prefetches on, eagerly and replayed from a graph captured with them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rackserve import ops
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.generate import ContiguousCache
from rackserve.model.presets import tiny_config
from rackserve.ops.side_stream import SideStream
from rackserve.ops.triton.l2_prefetch import l2_prefetch
from rackserve.runner.cuda_graph import capture_region

_COMPILE = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rackserve.ops.triton.l2_prefetch import BLOCK, STEPS, l2_prefetch_kernel
sig = {"w_ptr": "*i32", "numel": "i64", "never": "i32", "BLOCK": "constexpr",
       "STEPS": "constexpr"}
src = ASTSource(fn=l2_prefetch_kernel, signature=sig,
                constexprs={"BLOCK": BLOCK, "STEPS": STEPS},
                attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
ptx = k.asm["ptx"]
v4 = ptx.count("ld.global.L1::evict_last.L2::cache_hint.v4")
print(json.dumps({"loads": ptx.count("ld.global"), "v4": v4, "shared": k.metadata.shared}))
"""


def test_kernel_compiles_for_sm90_to_loads_it_keeps():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    # 8 steps of 1024 words over 128 threads (a word count divisible by 16, as 16 MB is): two
    # 16-byte evict_last loads a thread a step, all kept; shared memory for the final fold only
    assert report["loads"] == report["v4"] == 16 and report["shared"] <= 64, report


def test_kernel_reads_and_leaves_the_weight():
    w = torch.randn(300, 129, dtype=torch.bfloat16)  # an odd size: masked tail, 4-byte words
    before = w.clone()
    l2_prefetch(w, 1 << 20)
    l2_prefetch(w, 1000)
    assert torch.equal(w, before)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(w.t(), 1000)


def test_prefetch_is_a_no_op_off_cuda(monkeypatch):
    monkeypatch.setattr(ops, "L2_PREFETCH_MAX_TOKENS", 16)
    x = torch.zeros(1, 8)

    def weight() -> torch.Tensor:
        raise AssertionError("the weight is not needed off CUDA")

    for name in ("triton", "reference"):
        side = ops.kernels(name).prefetch(x, weight)
        assert side.stream is None
        side.join()


@torch.inference_mode()
def test_the_step_prefetches_each_next_weight_stream(monkeypatch):
    """On the fast path, in order: layer 0's fused input projection before its mHC pre;
    per layer its output projection's wo_a after the q projection, the shared expert's
    gate-up after the attention, and the next layer's input projection before the mHC
    between them; the lm_head before the hyper head. Each joined before the next
    prefetch is asked for (so before its own GEMM)."""
    cfg = tiny_config(3, 8)
    model = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels="triton")
    init_model_(model, seed=0)
    model.eval()
    events: list[object] = []

    class Pending(SideStream):
        def join(self) -> None:
            events.append("join")

    def prefetch(self, x, weight):
        events.append(weight())
        return Pending(None)

    monkeypatch.setattr(ops.Kernels, "prefetch", prefetch)
    cache = ContiguousCache(model, 2, 64)
    model(torch.tensor([3, 9]), cache.batch([0, 0], [1, 1], [0, 1]), cache.tensors)
    layers = model.model.layers
    want = [layers[0].attn.input_weight(torch.zeros(1))]
    for i, layer in enumerate(layers):
        want += [layer.attn.wo_a.weight, layer.ffn.shared_gate_up(torch.zeros(1))]
        if i + 1 < len(layers):
            want.append(layers[i + 1].attn.input_weight(torch.zeros(1)))
    want.append(model.head.weight)
    assert events[1::2] == ["join"] * len(want)
    got = events[0::2]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g is not None and g.data_ptr() == w.data_ptr() and g.shape == w.shape
    # the shared expert's rows of the folded gate-up: w1's then w3's
    shared = model.model.layers[0].ffn.shared_experts
    assert torch.equal(got[2], torch.cat([shared.w1.weight, shared.w3.weight]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.inference_mode()
def test_prefetches_change_nothing_eager_or_replayed(monkeypatch):
    """A bf16 decode step of two requests with the prefetches on: logits bitwise those
    without, eagerly and replayed from a CUDA graph captured with them."""
    cfg = tiny_config(3, 8)
    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(cfg, with_mtp=False)
    init_model_(model.cast(torch.bfloat16), seed=0)
    model.eval()
    cache = ContiguousCache(model, 2, 64)
    ids = torch.tensor([3, 9], device="cuda")
    meta = cache.batch([5, 9], [1, 1], [0, 1])

    def logits() -> torch.Tensor:
        hidden, _ = model(ids, meta, cache.tensors)
        return model.compute_logits(hidden)

    off = logits().clone()
    monkeypatch.setattr(ops, "L2_PREFETCH_MAX_TOKENS", 16)
    assert torch.equal(logits(), off)
    graph, out = capture_region(logits)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, off)
