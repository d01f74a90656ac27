"""Structured output: grammar-constrained decoding with xgrammar (why xgrammar: docs/serving.md).

Three parts, from request to token:

- ``build_grammar`` turns a request's ``StructuredOutputsParams`` into an xgrammar
  ``Grammar`` (no tokenizer needed). The API process calls it through
  ``check_structured_outputs`` to answer an invalid schema, regex or grammar with a 400.
- ``GrammarCompiler`` compiles grammars against the model's vocabulary on background
  threads, cached by ``StructuredOutputsParams.key()``: the engine core submits a request's
  grammar when the request arrives (an invalid one is refused there, at once), so
  compilation (tens to hundreds of ms for a large schema; unbounded for a pathological
  one) runs while other requests step.
- ``GrammarWait`` holds the scheduler's requests whose grammar is still compiling (vLLM's
  WAITING_FOR_FSM): they join the waiting queue once compiled, and fail alone, freeing
  everything, when compilation fails or outlives ``--structured-output-timeout-s``. So the
  runner, which builds a request's matcher when it first runs, never waits for a compile.
- ``StructuredOutputs`` is the runner's per-request state: a matcher created when a request
  joins the runner (replaying the tokens it already has, so a request resumed after
  preemption recomputes to the same grammar state), the [S, ceil(V / 32)] bitmask of the
  sampled rows filled on the host and uploaded once per step, and the matchers advanced
  with the sampled tokens.

EOS is allowed only where the grammar accepts: the matcher's stop tokens are the model's
EOS ids, and its mask holds them only when the grammar can end there.

Shapes: S sampled rows this step, V vocabulary size, W = ceil(V / 32) bitmask words.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from rackserve.engine.outputs import SchedulerOutput
from rackserve.request import Request, StructuredOutputsParams

if TYPE_CHECKING:  # xgrammar is imported on first use: an engine without such requests
    import xgrammar  # never pays its import (about a second)

    from rackserve.runner.input_batch import RunnerRequest

logger = logging.getLogger(__name__)

# Free whitespace in JSON is bounded: a model (or a random test model) that keeps choosing
# whitespace would otherwise never finish. 16 still allows pretty-printing a few levels deep.
MAX_JSON_WHITESPACE = 16
# Compile threads: more than one, so one slow grammar (its thread cannot be stopped: the
# compile runs in C++) does not hold every later grammar behind it; few, as the threads
# share the host with the step loop.
COMPILE_THREADS = 2
# Compiled grammars kept (each holds a per-vocabulary token-mask cache, often ~1 MB).
GRAMMAR_CACHE_SIZE = 128
# xgrammar prefixes its errors with "[time] file.cc:line: " and assertion text; clients
# get the message alone.
_ERROR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")


def _clean_error(error: Exception) -> str:
    message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return _ERROR_PREFIX.sub("", message)


# xgrammar 0.2.9 writes the characters of a length-bounded JSON string (minLength /
# maxLength) as the class below, which lets control characters through; JSON forbids them
# unescaped (json.loads refuses them). Its unbounded strings exclude them, as we do here.
_BOUNDED_STRING_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\]"


def _without_control_characters(grammar: xgrammar.Grammar) -> xgrammar.Grammar:
    import xgrammar as xgr

    text = str(grammar)
    if _BOUNDED_STRING_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER))


def build_grammar(params: StructuredOutputsParams) -> xgrammar.Grammar:
    """The xgrammar Grammar of ``params``; ValueError with a readable message when the
    schema, regex or grammar is invalid or uses something xgrammar does not support."""
    import xgrammar as xgr

    kind = params.kind
    whitespace: dict[str, Any] = (
        {"any_whitespace": False}
        if params.disable_any_whitespace
        else {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    )
    try:
        if kind == "json":
            assert isinstance(params.json, str)  # dicts are serialised on construction
            grammar = xgr.Grammar.from_json_schema(params.json, strict_mode=True, **whitespace)
            return _without_control_characters(grammar)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **whitespace)
        if kind == "regex":
            assert params.regex is not None
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            # EBNF string literals take JSON's escapes
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        assert params.grammar is not None
        if "::=" in params.grammar:  # EBNF (GBNF): `root ::= ...`
            return xgr.Grammar.from_ebnf(params.grammar)
        return xgr.Grammar.from_lark(params.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(kind, kind)
        raise ValueError(f"invalid {what} for structured output: {_clean_error(e)}") from None


def check_structured_outputs(params: StructuredOutputsParams | None) -> None:
    """ValueError naming the problem when ``params`` cannot be compiled (API-side check)."""
    if params is not None:
        build_grammar(params)


class GrammarCompiler:
    """Grammars compiled against one vocabulary, on a background thread, cached by key.

    The tokenizer is loaded on the first submission (from ``tokenizer_path``) so engines
    that never see a structured request load nothing. ``vocab_size`` is the model's (it
    may exceed the tokenizer's: padded embeddings); ``eos_token_ids`` are the stop tokens.
    """

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_workers: int = COMPILE_THREADS,
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._setup_error: str | None = None  # why the vocabulary could not be loaded
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache is touched by the engine thread only,
        # but tests and the offline LLM may submit from others
        self._setup_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")

    def submit(self, params: StructuredOutputsParams) -> Future:
        """Start compiling (or find) ``params``'s grammar; the Future's result is an
        xgrammar CompiledGrammar. ValueError, at once, when the grammar is invalid."""
        if self._setup_error is not None:
            raise ValueError(f"structured output is unavailable: {self._setup_error}")
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        grammar = build_grammar(params)  # the client's error surfaces before anything runs
        with self._lock:
            future = self._pool.submit(self._compile, grammar)
            self._cache[key] = future
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def compiled(self, params: StructuredOutputsParams) -> Any:
        """The CompiledGrammar of ``params`` (waits for its compilation)."""
        return self.submit(params).result()

    def _compile(self, grammar: xgrammar.Grammar) -> Any:
        import xgrammar as xgr

        with self._setup_lock:  # several compile threads: the vocabulary is loaded once
            if self._compiler is None:
                self._compiler = self._load_compiler(xgr)
        return self._compiler.compile_grammar(grammar)

    def _load_compiler(self, xgr: Any) -> Any:
        """xgrammar's compiler over our vocabulary (the tokenizer loads here)."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
        except Exception as e:  # later requests are refused with this message
            self._setup_error = f"no tokenizer at {self.tokenizer_path} ({e})"
            raise
        # our own cache holds the results; one thread: compilation shares 2-core hosts
        # with the step loop
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarWait:
    """Requests whose grammar is still compiling (the scheduler's WAITING_FOR_FSM state).

    The scheduler ``add``s a request with its compile Future and deadline (time.monotonic)
    instead of queueing it, and ``poll``s once per step: compiled requests go to the
    waiting queue; a failed or late compile fails that request alone. Insertion order is
    kept, so requests compiled by the same poll queue in arrival order.
    """

    def __init__(self) -> None:
        self._pending: dict[str, tuple[Request, Future, float, float]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, req: Request, grammar: Future, timeout_s: float) -> None:
        self._pending[req.request_id] = (req, grammar, time.monotonic() + timeout_s, timeout_s)

    def discard(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def wait(self, timeout_s: float) -> None:
        """Block until a pending compile ends or ``timeout_s`` passes: an engine with
        nothing else to run waits here rather than spinning empty steps against the
        compile threads."""
        futures = [grammar for _, grammar, _, _ in self._pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def poll(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests now compiled, [(request, why it failed)]), both removed from here."""
        if not self._pending:
            return [], []
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        now = time.monotonic()
        for req_id, (req, grammar, deadline, timeout_s) in list(self._pending.items()):
            if grammar.done():
                error = grammar.exception()
                if error is None:
                    ready.append(req)
                else:
                    failed.append((req, f"structured output grammar failed to compile: {error}"))
            elif now >= deadline:
                failed.append(
                    (
                        req,
                        f"structured output grammar did not compile within {timeout_s:g} s "
                        "(--structured-output-timeout-s): simplify the schema or raise the limit",
                    )
                )
            else:
                continue
            del self._pending[req_id]
        return ready, failed


class StructuredOutputs:
    """The runner's matchers, one per constrained request it holds, and the step bitmask.

    Invariant: a request's matcher has consumed exactly the request's output tokens in
    the runner (``RunnerRequest.output_token_ids``); a request that leaves (finished or
    preempted) drops its matcher and a resumed one replays its tokens into a new one.
    """

    def __init__(
        self,
        compiler: GrammarCompiler,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.compiler = compiler
        self.device = device
        self.num_words = (vocab_size + 31) // 32
        self.matchers: dict[str, Any] = {}  # req id -> xgrammar GrammarMatcher
        # Host side of the step's bitmask; pinned so its upload is asynchronous. The copy
        # of step k has finished before step k+1 refills it: each step ends with a sync
        # (the sampled tokens' read-back).
        self._bitmask = torch.full(
            (max_num_reqs, self.num_words),
            -1,
            dtype=torch.int32,
            pin_memory=device.type == "cuda",
        )
        self._batch: Any = None  # xgrammar BatchGrammarMatcher, made on first use

    def add_request(
        self, req_id: str, params: StructuredOutputsParams, output_ids: Sequence[int]
    ) -> None:
        """A request joins the runner: its matcher, advanced over ``output_ids`` (the
        tokens it generated before a preemption; none for a new request)."""
        import xgrammar as xgr

        try:
            compiled = self.compiler.compiled(params)
        except Exception as e:  # checked when the request arrived: a bug, not bad input
            logger.error("structured output: request %s's grammar failed: %s", req_id, e)
            return
        matcher = xgr.GrammarMatcher(compiled)
        for token_id in output_ids:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                logger.warning(
                    "structured output: request %s's earlier token %d does not match its "
                    "grammar; it is no longer constrained",
                    req_id,
                    token_id,
                )
                return
        self.matchers[req_id] = matcher

    def update(self, sched: SchedulerOutput) -> None:
        """Apply a step's leaves and joins (a resumed request brings its output so far)."""
        if self.matchers:
            for req_id in sched.finished_req_ids | sched.preempted_req_ids:
                self.matchers.pop(req_id, None)
        for new in sched.new_reqs:
            params = new.sampling_params.structured_outputs
            if params is not None:
                self.add_request(new.req_id, params, new.token_ids[new.num_prompt_tokens :])

    def bitmask(self, sampled_reqs: Sequence[RunnerRequest]) -> torch.Tensor | None:
        """The step's token bitmask [S, W] int32 on the device (all ones in unconstrained
        rows), or None when no sampled request is constrained. One upload, no sync."""
        if not self.matchers:
            return None
        rows: list[int] = []
        matchers: list[Any] = []
        for row, r in enumerate(sampled_reqs):
            matcher = self.matchers.get(r.req_id)
            # a terminated matcher (EOS taken, e.g. under ignore_eos) constrains no more
            if matcher is not None and not matcher.is_terminated():
                rows.append(row)
                matchers.append(matcher)
        if not rows:
            return None
        bitmask = self._bitmask[: len(sampled_reqs)]
        bitmask.fill_(-1)
        self._batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return bitmask.to(self.device, non_blocking=True)

    def advance(self, sampled_reqs: Sequence[RunnerRequest], token_ids: Sequence[int]) -> None:
        """Advance the constrained requests' matchers with their sampled tokens
        (``token_ids[s]`` belongs to ``sampled_reqs[s]``)."""
        if not self.matchers:
            return
        for r, token_id in zip(sampled_reqs, token_ids, strict=True):
            matcher = self.matchers.get(r.req_id)
            if matcher is None or matcher.is_terminated():
                continue
            if not matcher.accept_token(token_id):
                # only a row the sampler could not honour (every token masked) gets here
                logger.warning(
                    "structured output: request %s sampled token %d outside its grammar; "
                    "it is no longer constrained",
                    r.req_id,
                    token_id,
                )
                del self.matchers[r.req_id]

    def _batch_matcher(self) -> Any:
        if self._batch is None:
            import xgrammar as xgr

            # xgrammar's own default (half the cores), capped: rows are independent, but
            # the threads share the host with the step loop and the grammar compiler
            self._batch = xgr.BatchGrammarMatcher(min(8, max(1, (os.cpu_count() or 2) // 2)))
        return self._batch
