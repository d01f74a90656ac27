"""The offline API, shaped like vLLM's so users' scripts port::

    from rackserve import LLM, SamplingParams
    llm = LLM("path/to/checkpoint", dtype="float32")
    for out in llm.generate(["Hello"], SamplingParams(max_tokens=16)):
        print(out.outputs[0].text, out.outputs[0].token_ids)

One process: the engine core runs in-line; the output processor detokenizes, applies
stop strings and fans ``n > 1`` out into child requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm
from transformers import AutoTokenizer

from rackserve.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpecConfig,
)
from rackserve.engine.core import EngineCore
from rackserve.engine.output_processor import OutputProcessor
from rackserve.engine.request_output import RequestOutput
from rackserve.request import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        tokenizer: str | None = None,
        enforce_eager: bool = False,
        parallel: ParallelConfig | None = None,
        kv_cache_dtype: str = "auto",
        speculative_config: str | dict[str, Any] | SpecConfig | None = None,
        async_scheduling: bool | None = None,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        """``speculative_config``: as ``--speculative-config`` (JSON text or a dict, e.g.
        ``{"method": "mtp", "num_speculative_tokens": 3}``), or a SpecConfig.
        ``async_scheduling``: as ``--async-scheduling`` (engine/async_scheduling.py; None:
        on a GPU wherever supported);
        ``long_prefill_token_threshold``: as ``--long-prefill-token-threshold``."""
        parallel = parallel or ParallelConfig()
        speculative = (
            speculative_config
            if isinstance(speculative_config, SpecConfig)
            else SpecConfig.from_json(speculative_config)
        )
        if parallel.data_parallel_size > 1:
            # One in-line engine core here; DP ranks are processes with a front end.
            raise ConfigError(
                "LLM runs one engine rank; serve DP/EP with `rackserve serve MODEL "
                "--data-parallel-size N --enable-expert-parallel`"
            )
        model_config = ModelConfig.from_pretrained(model)
        max_len = max_model_len or min(model_config.max_position_embeddings, 8192)
        self.engine = EngineCore(
            EngineConfig(
                model=str(model),
                model_config=model_config,
                cache=CacheConfig(
                    kv_cache_memory=kv_cache_memory,
                    enable_prefix_caching=enable_prefix_caching,
                    kv_cache_dtype=kv_cache_dtype,
                ),
                scheduler=SchedulerConfig(
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max(max_num_batched_tokens, 1),
                    max_model_len=max_len,
                    async_scheduling=async_scheduling,
                    long_prefill_token_threshold=long_prefill_token_threshold,
                ),
                dtype=dtype,
                device=device,
                seed=seed,
                enforce_eager=enforce_eager,
                parallel=parallel,
                tokenizer=tokenizer,
                speculative=speculative,
            ),
            log_stats=False,
        )
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        return None, list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or ``{"prompt_token_ids": ...}``);
        results come back in the prompts' order."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(all_params) != len(prompts):
            raise ValueError("pass one SamplingParams, or one per prompt")
        order = []
        try:
            for prompt, p in zip(prompts, all_params, strict=True):
                text, ids = self._prompt_ids(prompt)
                request_id = str(next(self._ids))
                order.append(request_id)
                for request in self.processor.add_request(request_id, ids, p, prompt=text):
                    self.engine.add_request(request)
        except ValueError:  # a request the engine refuses (e.g. an invalid grammar)
            for request_id in order:  # takes back this call's requests: none is left waiting
                self.engine.abort_requests(self.processor.abort_request(request_id))
            raise
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Render conversations with the tokenizer's chat template, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="generating", disable=not use_tqdm)
        while self.processor.has_unfinished_requests():
            processed = self.processor.process_outputs(self.engine.step())
            if processed.abort_ids:
                self.engine.abort_requests(processed.abort_ids)
            for request in processed.to_send:
                self.engine.add_request(request)
            for out in processed.request_outputs:
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
            if processed.failed:  # the others are aborted too: a batch call returns all or none
                self.engine.abort_requests(self.processor.abort_all())
                request_id, message = processed.failed[0]
                raise RuntimeError(f"request {request_id}: {message}")
        bar.close()
        return [results[i] for i in order]
