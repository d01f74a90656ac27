"""transformers' DeepseekV4ForCausalLM decode step on the same checkpoint (GPU; bf16, or a
pre-quantized FP8 / FP4 checkpoint: transformers needs the ``accelerate`` wheel for it and
runs it on its fine-grained FP8 kernels, which the ``kernels`` package fetches from the HF
hub; without them (the device has no network) it dequantizes the checkpoint to bf16 at
load, which the record says).

Per-step decode time = (time of generating N2 tokens - time of generating N1) / (N2 - N1),
greedy, from a batch of random prompts of --context tokens: prefill and set-up cancel.
Usage: python3 benchmarks/hf_decode.py --model DIR --batch 1,64 --context 512 --output F
"""

from __future__ import annotations

import argparse
import json
import os
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


def fp8_kernels_loadable() -> bool:
    """Whether transformers can run pre-quantized FP8 / FP4 weights: its kernels come from
    the HF hub through the ``kernels`` package (offline: the hub's cache only)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no waiting on a network that is not there
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
    except Exception as e:  # ImportError, or the hub client's own errors
        print(f"transformers' FP8 kernels: {type(e).__name__}: {e}"[:300], flush=True)
        return False
    return True


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
    config = transformers.AutoConfig.from_pretrained(args.model)
    quantized = getattr(config, "quantization_config", None) is not None
    dequantize = quantized and not fp8_kernels_loadable()
    extra = {}
    if dequantize:
        print("transformers: its FP8 kernels did not load (they come from the HF hub): the "
              "checkpoint is dequantized to bf16 at load", flush=True)  # fmt: skip
        extra["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, **extra
    )
    model = in_checkpoint_dtype(model).to(device).eval()
    quantization = config.quantization_config if quantized else None
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
                "dequantized_at_load": dequantize,
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
