"""``ops/triton/l2_prefetch.py`` and ``Kernels.prefetch``: where the decode step starts
pulling its next weight stream into L2, and that doing so changes nothing else.

On CPU: the kernel compiles for sm_90 to bulk prefetches and nothing else (no loads,
stores or shared memory); the model asks for the right weights at the right points (the
calls recorded on the interpreted fast path); the op does nothing off CUDA. On a GPU
(``gpu`` mark): the step is bitwise the same with the prefetches on, eagerly and replayed
from a graph captured with them (the capture fails if a prefetch stream is left unjoined).
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
from rackserve.runner.cuda_graph import capture_region

_COMPILE = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rackserve.ops.triton.l2_prefetch import CHUNK, LANES, l2_prefetch_kernel
sig = {"ptr": "*u8", "nbytes": "i64", "CHUNK": "constexpr", "LANES": "constexpr"}
src = ASTSource(fn=l2_prefetch_kernel, signature=sig, constexprs={"CHUNK": CHUNK, "LANES": LANES},
                attrs={(0,): [["tt.divisibility", 16]]})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": LANES // 32})
ptx = k.asm["ptx"]
print(json.dumps({"prefetch": ptx.count("cp.async.bulk.prefetch.L2.global"),
                  "loads": ptx.count("ld.global"), "stores": ptx.count("st.global"),
                  "shared": k.metadata.shared}))
"""


def test_kernel_compiles_for_sm90_to_bulk_prefetches_only():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == {"prefetch": 1, "loads": 0, "stores": 0, "shared": 0}, report


def test_prefetch_is_a_no_op_off_cuda(monkeypatch):
    monkeypatch.setattr(ops, "L2_PREFETCH_MAX_TOKENS", 16)
    x = torch.zeros(1, 8)

    def weight() -> torch.Tensor:
        raise AssertionError("the weight is not needed off CUDA")

    for name in ("triton", "reference"):
        assert ops.kernels(name).prefetch(x, weight) is None


@torch.inference_mode()
def test_the_step_prefetches_each_next_weight_stream(monkeypatch):
    """On the fast path, in order: layer 0's fused input projection before its mHC pre;
    per layer its output projection's wo_a after the q projection, and the next layer's
    input projection before the mHC between them; the lm_head before the hyper head."""
    cfg = tiny_config(3, 8)
    model = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels="triton")
    init_model_(model, seed=0)
    model.eval()
    calls: list[tuple[int, torch.Tensor | None]] = []
    monkeypatch.setattr(
        ops.Kernels, "prefetch", lambda self, x, weight: calls.append((x.shape[0], weight()))
    )
    cache = ContiguousCache(model, 2, 64)
    model(torch.tensor([3, 9]), cache.batch([0, 0], [1, 1], [0, 1]), cache.tensors)
    layers = model.model.layers
    want = [layers[0].attn.input_weight(torch.zeros(1))]
    for i, layer in enumerate(layers):
        want.append(layer.attn.wo_a.weight)
        if i + 1 < len(layers):
            want.append(layers[i + 1].attn.input_weight(torch.zeros(1)))
    want.append(model.head.weight)
    got = [w for _, w in calls]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g is not None and g.data_ptr() == w.data_ptr() and g.shape == w.shape


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
