"""How much of the bf16 fast-vs-reference argmax disagreement is the reference's own bf16 noise.

Teacher-forced decode (as tests/model/test_gpu_fastpath.py's bf16 gate), three models on the
same (bf16-representable) weights: the fast path in bf16, the reference kernels in bf16, and
the reference kernels in fp32 (the truth). Prints, per context, argmax agreement and median
relative logit error of fast-vs-ref(bf16), ref(bf16)-vs-fp32 and fast-vs-fp32, and the fp32
top-1/top-2 margins of the rows where fast and ref(bf16) disagree.
Usage: python3 benchmarks/bf16_agreement.py [--contexts 100 600] [--steps 64] [--output f.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from rackserve.bench.accuracy import teacher_forced_agreement
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.presets import preset_config

PAIRS = [("fast", "ref"), ("ref", "fp32"), ("fast", "fp32")]


def bf16_models() -> dict[str, DeepseekV4ForCausalLM]:
    """fast (bf16), ref (bf16) and fp32 (reference kernels) on the same weights."""
    cfg = preset_config("v4-flash", 4, 64)
    with torch.device("cuda"):
        fast = DeepseekV4ForCausalLM(cfg, with_mtp=False)
        ref = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels="reference")
        fp32 = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels="reference")
    init_model_(fast.cast(torch.bfloat16), seed=0)
    state = fast.state_dict()
    ref.cast(torch.bfloat16).load_state_dict(state)
    fp32.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return {"fast": fast.eval(), "ref": ref.eval(), "fp32": fp32.eval()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[100, 600])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    models = bf16_models()
    results = []
    for c in args.contexts:
        r = teacher_forced_agreement(models, PAIRS, c, args.steps)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("fp32_margin")}))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
