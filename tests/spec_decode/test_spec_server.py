"""End to end: `rackserve serve --speculative-config` answers exactly what the plain engine
answers (streamed and not), keeps `usage` as without speculation, and exports the
acceptance counters on /metrics."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rackserve.llm import LLM
from rackserve.request import SamplingParams
from rackserve.spec_decode.stats import from_prometheus

from spec_utils import target_dir

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Once upon a time, in a land"]
MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model: Path, log_path: Path, *extra: str):
    port = free_port()
    cmd = [
        sys.executable, "-m", "rackserve.cli", "serve", str(model), "--port", str(port),
        "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--kv-cache-memory", "64M",
        "--disable-uvicorn-access-log", *extra,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                raise AssertionError(f"server exited:\n{log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.25)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture(scope="module")
def expected(target_dir):
    llm = LLM(str(target_dir), device="cpu", max_model_len=512, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.outputs[0].text for out in llm.generate(PROMPTS, params)]


def test_server_with_a_draft_answers_as_the_plain_engine(target_dir, tmp_path, expected):
    spec = json.dumps(
        {"method": "draft_model", "num_speculative_tokens": 3, "model": str(target_dir)}
    )
    with serve(target_dir, tmp_path / "server.log", "--speculative-config", spec) as url:
        body = {
            "model": str(target_dir),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        for prompt, want in zip(PROMPTS, expected, strict=True):
            got = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt}, timeout=60)
            assert got.status_code == 200, got.text
            answer = got.json()
            assert answer["choices"][0]["text"] == want
            assert answer["usage"]["completion_tokens"] == MAX_TOKENS
        # streamed: several tokens per step, the same text
        chunks = []
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "prompt": PROMPTS[0], "stream": True},
            timeout=60,
        ) as stream:  # fmt: skip
            for line in stream.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected[0]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    stats = from_prometheus(metrics)
    assert stats is not None and stats.num_drafts > 0
    # a draft identical to the target: every draft token accepted, at every position
    assert stats.num_draft_tokens == stats.num_accepted_tokens == 3 * stats.num_drafts
    assert stats.num_accepted_tokens_per_pos == [stats.num_drafts] * 3
    assert stats.report()["spec_decode_acceptance_length"] == 4.0
    assert "rackserve:spec_decode_num_drafts_total{" in metrics
