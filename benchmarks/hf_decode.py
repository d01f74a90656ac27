"""transformers' DeepseekV4ForCausalLM decode step on the same checkpoint (GPU, bf16).

Per-step decode time = (time of generating N2 tokens - time of generating N1) / (N2 - N1),
greedy, from a batch of random prompts of --context tokens: prefill and set-up cancel.
Usage: python3 benchmarks/hf_decode.py --model DIR --batch 1,64 --context 512 --output F
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers


def generate_time(model, ids: torch.Tensor, new_tokens: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
    )
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", default="1,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--short", type=int, default=4)
    p.add_argument("--long", type=int, default=24)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    # transformers 5.17 (the device's) keeps the norms and mHC parameters in fp32 and then
    # feeds an fp32 norm output to a bf16 linear ("mat1 and mat2 ... float != BFloat16"):
    # everything in bf16, as the checkpoint stores it
    model = model.to(torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size
    results = []
    for b in (int(x) for x in args.batch.split(",")):
        gen = torch.Generator().manual_seed(b)
        ids = torch.randint(2, vocab, (b, args.context), generator=gen).cuda()
        generate_time(model, ids, 2)  # warm-up
        short = min(generate_time(model, ids, args.short) for _ in range(2))
        long = min(generate_time(model, ids, args.long) for _ in range(2))
        step_ms = (long - short) / (args.long - args.short) * 1e3
        results.append(
            {
                "kind": "hf_decode",
                "transformers": transformers.__version__,
                "batch": b,
                "context": args.context,
                "step_ms": step_ms,
            }
        )
        print(f"transformers decode x{b} @ {args.context}: {step_ms:.2f} ms/step", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
