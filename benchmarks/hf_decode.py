"""transformers' DeepseekV4ForCausalLM decode step on the same checkpoint (GPU; bf16, or a
pre-quantized FP8 / FP4 checkpoint, which transformers runs through its fine-grained FP8
modules: the ``accelerate`` wheel must be carried).

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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate_time(model, ids: torch.Tensor, new_tokens: int) -> float:
    synchronize(ids.device)
    start = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
    )
    synchronize(ids.device)
    return time.perf_counter() - start


def in_checkpoint_dtype(model):
    """transformers 5.17 (the device's) keeps the norms and mHC parameters in fp32 and then
    feeds an fp32 norm output to a bf16 linear ("mat1 and mat2 ... float != BFloat16"):
    every parameter in bf16, as the checkpoint stores it, except a pre-quantized
    checkpoint's FP8 / FP4 weights and their scales."""
    if getattr(model.config, "quantization_config", None) is None:
        return model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if param.dtype == torch.float32 and not name.endswith(("scale_inv", "activation_scale")):
            param.data = param.data.to(torch.bfloat16)
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", default="1,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--short", type=int, default=4)
    p.add_argument("--long", type=int, default=24)
    p.add_argument("--output", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (timings mean nothing)")
    args = p.parse_args()
    device = torch.device(args.device)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    model = in_checkpoint_dtype(model).to(device).eval()
    quantization = getattr(model.config, "quantization_config", None)
    vocab = model.config.vocab_size
    results = []
    for b in (int(x) for x in args.batch.split(",")):
        gen = torch.Generator().manual_seed(b)
        ids = torch.randint(2, vocab, (b, args.context), generator=gen).to(device)
        generate_time(model, ids, 2)  # warm-up
        short = min(generate_time(model, ids, args.short) for _ in range(2))
        long = min(generate_time(model, ids, args.long) for _ in range(2))
        step_ms = (long - short) / (args.long - args.short) * 1e3
        results.append(
            {
                "kind": "hf_decode",
                "transformers": transformers.__version__,
                "quantization": getattr(quantization, "to_dict", lambda: quantization)(),
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
