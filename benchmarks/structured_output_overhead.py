"""Per-step CPU overhead of grammar-constrained decoding: xgrammar vs llguidance.

What one decode step of a batch of S constrained requests costs on the host: fill the
[S, ceil(V/32)] token bitmask (every matcher computes its allowed tokens) and advance every
matcher with its sampled token. Both libraries get the same JSON schema, the same
vocabulary (a byte-level BPE of DeepSeek-V4's size, 129280 tokens, trained on Python
sources so it has the long code tokens a real vocabulary has) and compact JSON (no free
whitespace, as rackserve serves it). Every row replays the same token streams for both
libraries: random valid documents of the schema (words from the package's corpus in the
strings), encoded by the tokenizer as a model would write them, each closed by EOS; a row
that ends one document resets its matcher (a new request joining) outside the timed
regions, and rows start at different offsets so a step mixes every kind of state.

    python benchmarks/structured_output_overhead.py --batch-size 64 --steps 200

Prints one JSON line per library and mode; results/structured_output_overhead.json keeps
the recorded run (date, CPU, commit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

VOCAB_SIZE = 129280
EOS_TOKEN_ID = 1

# A tool-argument / extraction schema of realistic size (~2 KB): nested objects, arrays,
# enums, bounded strings and numbers, optional fields.
SCHEMA: dict = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "severity": {"enum": ["low", "medium", "high", "critical"]},
        "component": {"type": "string", "enum": ["engine", "kv", "runner", "server", "model"]},
        "reproducible": {"type": "boolean"},
        "num_occurrences": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "latency_ms": {"type": "number"},
        "reporter": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 60},
                "team": {"type": ["string", "null"]},
            },
            "required": ["name", "email"],
        },
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "action": {"type": "string", "maxLength": 120},
                    "expected": {"type": "string", "maxLength": 120},
                    "actual": {"type": "string", "maxLength": 120},
                },
                "required": ["action", "expected", "actual"],
            },
            "minItems": 1,
            "maxItems": 8,
        },
        "labels": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 6},
        "environment": {
            "type": "object",
            "properties": {
                "os": {"enum": ["linux", "macos", "windows"]},
                "gpu": {"type": "string"},
                "driver_version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+(\\.[0-9]+)?$"},
                "num_gpus": {"type": "integer", "minimum": 1, "maximum": 72},
            },
            "required": ["os"],
        },
    },
    "required": ["title", "severity", "component", "steps", "environment"],
}


def build_vocab_tokenizer(cache_dir: Path):
    """A transformers tokenizer with VOCAB_SIZE tokens (cached: training takes minutes)."""
    from transformers import PreTrainedTokenizerFast

    from rackserve.model.tokenizer import build_tokenizer, tokenizer_config

    path = cache_dir / "tokenizer.json"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        root = Path(os.__file__).parent
        texts, size = [], 0
        for file in sorted(root.rglob("*.py")):
            text = file.read_text(encoding="utf-8", errors="ignore")
            texts.append(text)
            size += len(text)
            if size > 40_000_000:
                break
        start = time.perf_counter()
        tokenizer = build_tokenizer(VOCAB_SIZE, "".join(texts))
        print(f"trained {VOCAB_SIZE}-token BPE in {time.perf_counter() - start:.0f} s", flush=True)
        path.write_text(tokenizer.to_str(), encoding="utf-8")
        (cache_dir / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config(tokenizer), ensure_ascii=False)
        )
    return PreTrainedTokenizerFast.from_pretrained(str(cache_dir))


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, batch_size: int, parallel: bool) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        start = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS_TOKEN_ID]
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.setup_s = time.perf_counter() - start
        start = time.perf_counter()
        self.compiled = self.compiler.compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
        )
        self.compile_s = time.perf_counter() - start
        self.matchers = [xgr.GrammarMatcher(self.compiled) for _ in range(batch_size)]
        self.batch = xgr.BatchGrammarMatcher(2) if parallel else None

    def fill(self, bitmask: torch.Tensor) -> None:
        if self.batch is not None:
            self.batch.batch_fill_next_token_bitmask(self.matchers, bitmask)
        else:
            for i, m in enumerate(self.matchers):
                m.fill_next_token_bitmask(bitmask, i)

    def accept(self, tokens: list[int]) -> None:
        if self.batch is not None:
            ok = self.xgr.BatchGrammarMatcher.batch_accept_token(self.matchers, tokens)
        else:
            ok = [m.accept_token(t) for m, t in zip(self.matchers, tokens, strict=True)]
        assert all(ok)

    def accept_one(self, i: int, tokens: list[int]) -> None:
        assert all(self.matchers[i].accept_token(t) for t in tokens)

    def finished(self, i: int) -> bool:
        return self.matchers[i].is_terminated()

    def reset(self, i: int) -> None:
        self.matchers[i].reset()


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, batch_size: int, parallel: bool) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=VOCAB_SIZE, eos_token=EOS_TOKEN_ID
        )
        self.setup_s = time.perf_counter() - start
        start = time.perf_counter()
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(
            SCHEMA,
            defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
        )
        first = llguidance.LLMatcher(self.tokenizer, self.grammar)
        assert not first.is_error(), first.get_error()
        self.compile_s = time.perf_counter() - start
        self.matchers = [first] + [
            llguidance.LLMatcher(self.tokenizer, self.grammar) for _ in range(batch_size - 1)
        ]
        self.executor = llguidance.LLExecutor(2) if parallel else None

    def fill(self, bitmask: torch.Tensor) -> None:
        import llguidance.torch as lt

        if self.executor is not None:
            lt.fill_next_token_bitmask_par(
                self.executor, [(m, i) for i, m in enumerate(self.matchers)], bitmask
            )
        else:
            for i, m in enumerate(self.matchers):
                lt.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, tokens: list[int]) -> None:
        if self.executor is not None:
            ok = self.executor.consume_token_par(list(zip(self.matchers, tokens, strict=True)))
        else:
            ok = [m.consume_token(t) for m, t in zip(self.matchers, tokens, strict=True)]
        assert all(ok), [m.get_error() for m in self.matchers if m.is_error()]

    def accept_one(self, i: int, tokens: list[int]) -> None:
        assert self.matchers[i].consume_tokens(tokens), self.matchers[i].get_error()

    def finished(self, i: int) -> bool:
        return self.matchers[i].is_stopped()

    def reset(self, i: int) -> None:
        self.matchers[i].reset()


def random_document(rng: np.random.Generator, words: list[str]) -> dict:
    """A valid instance of SCHEMA with every property, in the schema's order."""

    def text(max_len: int) -> str:
        out = " ".join(rng.choice(words, size=int(rng.integers(1, 12))))
        return out[:max_len].strip() or "x"

    return {
        "title": text(80),
        "severity": str(rng.choice(["low", "medium", "high", "critical"])),
        "component": str(rng.choice(["engine", "kv", "runner", "server", "model"])),
        "reproducible": bool(rng.integers(2)),
        "num_occurrences": int(rng.integers(0, 100000)),
        "latency_ms": round(float(rng.uniform(0, 5000)), 3),
        "reporter": {"name": text(40), "email": "dev@example.com", "team": None},
        "steps": [
            {"action": text(120), "expected": text(120), "actual": text(120)}
            for _ in range(int(rng.integers(1, 4)))
        ],
        "labels": [text(24) for _ in range(int(rng.integers(0, 4)))],
        "environment": {
            "os": "linux",
            "gpu": "H200",
            "driver_version": f"{rng.integers(500, 600)}.{rng.integers(0, 200)}",
            "num_gpus": int(rng.integers(1, 73)),
        },
    }


def token_streams(tokenizer, num: int, seed: int) -> list[list[int]]:
    """``num`` documents as token ids, each followed by EOS."""
    from rackserve.model.tokenizer import load_corpus

    words = sorted({w for w in load_corpus().split() if w.isalnum()})
    rng = np.random.default_rng(seed)
    return [
        [
            *tokenizer.encode(
                json.dumps(random_document(rng, words), separators=(",", ":")),
                add_special_tokens=False,
            ),
            EOS_TOKEN_ID,
        ]
        for _ in range(num)
    ]


def run(lib, streams: list[list[int]], batch_size: int, steps: int) -> dict:
    """Each row walks through the documents; row i starts ``i * 7`` tokens in."""
    bitmask = torch.zeros(batch_size, (VOCAB_SIZE + 31) // 32, dtype=torch.int32)
    doc = list(range(batch_size))
    pos = [0] * batch_size
    for i in range(batch_size):  # warm the rows up to their offsets
        skip = (i * 7) % (len(streams[i]) - 1)
        lib.accept_one(i, streams[i][:skip])
        pos[i] = skip
    fill_s, accept_s, num_finished = [], [], 0
    for _ in range(steps):
        start = time.perf_counter()
        lib.fill(bitmask)
        fill_s.append(time.perf_counter() - start)
        tokens = [streams[doc[i]][pos[i]] for i in range(batch_size)]
        for i, t in enumerate(tokens):  # the replayed token must be allowed
            assert bitmask[i, t // 32] >> (t % 32) & 1, (lib.name, i, t)
        start = time.perf_counter()
        lib.accept(tokens)
        accept_s.append(time.perf_counter() - start)
        for i in range(batch_size):
            pos[i] += 1
            if pos[i] == len(streams[doc[i]]):
                assert lib.finished(i), (lib.name, i)
                lib.reset(i)
                num_finished += 1
                doc[i] = (doc[i] + batch_size) % len(streams)
                pos[i] = 0
    total = [f + a for f, a in zip(fill_s, accept_s, strict=True)]
    return {
        "library": lib.name,
        "batch_size": batch_size,
        "steps": steps,
        "tokenizer_setup_s": round(lib.setup_s, 3),
        "compile_s": round(lib.compile_s, 4),
        "fill_ms_median": round(1e3 * statistics.median(fill_s), 3),
        "accept_ms_median": round(1e3 * statistics.median(accept_s), 3),
        "step_ms_median": round(1e3 * statistics.median(total), 3),
        "step_ms_p90": round(1e3 * float(np.percentile(total, 90)), 3),
        "step_ms_mean": round(1e3 * statistics.fmean(total), 3),
        "num_finished": num_finished,
    }


def cpu_model() -> str:
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="of the documents")
    parser.add_argument("--cache-dir", type=Path, default=Path("out/bench_tokenizer_129k"))
    parser.add_argument("--out", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    tokenizer = build_vocab_tokenizer(args.cache_dir)
    streams = token_streams(tokenizer, 4 * args.batch_size, args.seed)
    results = []
    for parallel in (False, True):
        for cls in (Xgrammar, Llguidance):
            lib = cls(tokenizer, args.batch_size, parallel)
            result = run(lib, streams, args.batch_size, args.steps)
            result["mode"] = "parallel (2 threads)" if parallel else "sequential"
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out is not None:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        record = {
            "date": time.strftime("%Y-%m-%d"),
            "cpu": cpu_model(),
            "num_cpus": os.cpu_count(),
            # the host is shared: a load above the core count slows every number here
            "load_average_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "commit": commit,
            "command": "python benchmarks/structured_output_overhead.py "
            f"--batch-size {args.batch_size} --steps {args.steps}",
            "results": results,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
