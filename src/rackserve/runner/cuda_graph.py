"""CUDA graphs of uniform decode steps (every request adds one token and samples), and of
prefill / mixed steps of up to 2048 tokens.

One FULL graph per (padded batch size, context bucket), captured largest first into one
shared memory pool. A graph reads its inputs from static device buffers (token ids,
positions, block-table rows) and derives everything else inside the graph (slot mappings,
gathered block tables, closing windows); padded rows point at the null row of the device
block tables, so they write only into the null block and count no expert load. The
context bucket fixes the only shapes that depend on context (how many compressed entries
each query gathers), so one graph serves every step whose longest request fits it.

Each key also has one small sampler graph per ``SamplerVariant`` (greedy, random,
random with filters), captured right after its forward graph and reading its logits: a
step whose sampling is graph-safe replays the forward graph and then one sampler graph,
and reads the sampled ids from a static buffer; other decode steps replay the forward
graph and sample eagerly. ``runner/graph_sampling.py`` says which steps, and why the
sampler is not captured into the forward graph.

Steps that are not uniform decode (prefill chunks, mixed steps) of up to
``PREFILL_GRAPH_TOKENS[-1]`` tokens replay ``PrefillGraphs``: the same capture with every
token its own metadata row (its request's block-table row), padded to the next captured
size (every 256 tokens), returning the hidden states (the runner takes the logits of the
sampled rows, and samples, eagerly). Below ~4K tokens the eager forward is bound by the
host, not the GPU: on the H200 (2026-12-04, session 23) the host took 13.0 ms to issue
prefill:2048, whose GPU work replays in 12.2 ms, and the eager step swung between 12.6 and
17 ms with the host's speed. Longer steps run eager on the same code (their launches
amortised over the tokens), as do contexts past ``PREFILL_GRAPH_MAX_CONTEXT`` (a graph's
[T, E] gather plans grow with its bucket).

What a graph captures beyond the eager forward of the same step (the CPU launch counter
counts both, tests/runner/test_graph_launches.py): the step's metadata (on a GPU one Triton
launch per cache group, ``ops/triton/step_meta.py``, where ``StepMetadata.build`` takes
~115 small torch kernels), the token mask, zeroing the expert counts, and one compression
launch per compressed layer even when no window closes (its candidates write the null block).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import numpy as np
import torch

from rackserve.config import HCA
from rackserve.kv.spec import CacheGroupSpec
from rackserve.model.batch import KVCacheTensors, StepMetadata, compressed_ratios
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.runner.graph_sampling import InGraphSampling, SamplerVariant, StaticSampling
from rackserve.runner.inputs import StepInputs
from rackserve.runner.step_buffers import Feed, StaticInputs, StepBuffers, pad_to

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
CONTEXT_BUCKETS = (4096, 16384, 65536, 262144, 1 << 20)
# token counts of the prefill / mixed-step graphs (a step pads to the next: the padding's
# compute against the eager step's host time; on the H200, 2026-12-04, a 1,088-token mixed
# step padded to 1,536 replayed in 11.6 ms against 10.5 eager, while prefill:512 took 7.0
# against 10.0-11.3 and prefill:2048 12.4 against 12.8-13.0), and the largest context
# bucket they serve
PREFILL_GRAPH_TOKENS = tuple(range(256, 2049, 256))
PREFILL_GRAPH_MAX_CONTEXT = 65536


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: the listed sizes up to the first >= max_num_seqs."""
    sizes = [b for b in BATCH_SIZES if b < max_num_seqs]
    return [*sizes, next((b for b in BATCH_SIZES if b >= max_num_seqs), BATCH_SIZES[-1])]


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Python's garbage collector frozen while graphs are captured: ``torch.cuda.graph``
    runs ``gc.collect()`` at every capture, which then skips the objects alive before (the
    model, the engine), as vLLM's capture does."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@cache
def _warm_up_stream(device: int) -> torch.cuda.Stream:
    """The one side stream of a device's warm-up runs. The allocator caches a freed block for
    the stream that allocated it, so a new stream a warm-up (as this was until session 26)
    kept every warm-up's memory reserved (the GPU test of ``test_memory_profile.py``); bench
    decode at 64 requests had logged 1.03 GiB of graphs against a 0.46 GiB reserve (H100)."""
    return torch.cuda.Stream(device)


def capture_region(region: Callable[[], Any], pool=None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, output) of ``region`` captured into ``pool`` (None: a new one, the graph's),
    after a warm-up run on a side stream (kernel selection, autotuning), whose memory the
    next warm-up reuses."""
    side = _warm_up_stream(torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        region()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = region()
    return graph, out


def release_warm_up_memory() -> None:
    """After a set of captures: the warm-ups' cached blocks belong to their stream, so no
    eager step could reuse them; hand them back (the graphs' pools stay)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prefill_graph_sizes(max_num_batched_tokens: int) -> list[int]:
    """Prefill-graph token counts: the listed ones that a step of at most
    ``max_num_batched_tokens`` can need."""
    sizes = [t for t in PREFILL_GRAPH_TOKENS if t < max_num_batched_tokens]
    return sizes + [t for t in PREFILL_GRAPH_TOKENS if t >= max_num_batched_tokens][:1]


def prefill_graph_buckets(buckets: Sequence[int]) -> list[int]:
    """The context buckets the prefill graphs serve: those up to PREFILL_GRAPH_MAX_CONTEXT."""
    return [c for c in buckets if c <= PREFILL_GRAPH_MAX_CONTEXT]


def graph_serves(inputs: StepInputs) -> bool:
    """Whether a runner with graphs (and room for this step's size) replays this step: a
    uniform decode, or a prefill / mixed step within the prefill graphs' sizes and context."""
    return inputs.is_uniform_decode or (
        len(inputs.input_ids) <= PREFILL_GRAPH_TOKENS[-1]
        and inputs.max_seq_len <= PREFILL_GRAPH_MAX_CONTEXT
    )


def context_buckets(max_model_len: int) -> list[int]:
    """Context buckets: the listed ones below max_model_len, then max_model_len itself."""
    return [b for b in CONTEXT_BUCKETS if b < max_model_len] + [max_model_len]


@dataclass(frozen=True)
class DecodeResult:
    """A decode step's device results, views of static buffers valid until the next run (which
    reads ``token_ids`` through its feed before it overwrites them)."""

    logits: torch.Tensor  # [R, V] float32
    token_ids: torch.Tensor | None  # [R] int64 sampled in the graph; None: sample eagerly
    expert_counts: torch.Tensor  # [L, E]


class GraphMetadata:
    """A captured step's metadata from its static device inputs: every token a closing
    candidate, the padding (tokens of requests on the null table row) masked, the graph's
    expert counts zeroed. On a GPU, and on the CPU when the model runs Triton everywhere
    (the interpreter: the launch-count tests), the metadata kernels (``ops/triton/
    step_meta.py``: a launch per cache group); else ``StepMetadata.build`` (torch ops).
    The decode and prefill graphs and the speculation graphs (``spec_decode/graphs.py``)
    share it (``fast``: which path; a benchmark flips it). ``tables``: the full [rows,
    cols] int64 device table of each group, ``null_row`` their all-null row."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        groups: Sequence[CacheGroupSpec],
        tables: Mapping[str, torch.Tensor],
        null_row: int,
        device: torch.device,
    ) -> None:
        self.groups, self.tables, self.null_row = list(groups), tables, null_row
        self.fast = device.type == "cuda" or model.kernels.name == "triton"
        # compressed groups read as [window | entries] by HCA layers: derived with the rest
        names = {g.name for g in self.groups}
        self.combined = {
            layer.attn.entry_group for layer in model.model.layers if layer.attn.kind == HCA
        } & names
        self.ratios = compressed_ratios(self.groups)

    def __call__(
        self,
        positions: torch.Tensor,
        token_req: torch.Tensor,
        rows: torch.Tensor,
        bucket: int,
        every_token: torch.Tensor | None = None,
        expert_counts: torch.Tensor | None = None,
        masked: bool = True,
    ) -> StepMetadata:
        """positions, token_req [T]; rows [R] the requests' table rows; every_token [T]
        arange(T) (a static buffer: the torch path's closing candidates; None without
        compressed groups); ``expert_counts`` zeroed; ``masked``: token_mask = rows[token_req]
        != null_row (else None)."""
        null_row = self.null_row if masked else None
        if self.fast:  # its first launch zeroes the expert counts too
            from rackserve.ops.triton.step_meta import step_metadata

            return step_metadata(
                self.groups, positions, token_req, rows, self.tables, bucket, null_row,
                self.combined, clear=expert_counts,
            )  # fmt: skip
        if expert_counts is not None:
            expert_counts.zero_()
        return StepMetadata.build(
            self.groups,
            positions,
            token_req,
            {g.name: self.tables[g.name][rows] for g in self.groups},
            bucket,
            {r: every_token for r in self.ratios},
            token_mask=None if null_row is None else rows[token_req] != null_row,
        )


class _StepGraphs:
    """What both graph families share: the static inputs (a token's id, position and table
    row), the captured metadata, capture into one pool, staging and replay. ``forward`` is
    the captured region of one (size, bucket)."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        caches: KVCacheTensors,
        buffers: StepBuffers,
        groups: Sequence[CacheGroupSpec],
        batch_sizes: Sequence[int],
        buckets: Sequence[int],
    ) -> None:
        self.model, self.caches, self.buffers = model, caches, buffers
        self.groups = list(groups)
        self.batch_sizes, self.buckets = sorted(batch_sizes), sorted(buckets)
        device, n = buffers.device, max(batch_sizes)
        # a graph of b tokens reads [ids b | positions b | table rows b | _num_extra(b)]
        self.static = StaticInputs(3 * n + self._num_extra(n), device)
        self.token_req = torch.arange(n, device=device)
        cfg = model.cfg
        self.expert_counts = torch.zeros(
            cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.int64, device=device
        )
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.meta = GraphMetadata(model, groups, buffers.tables, buffers.null_row, device)

    def _num_extra(self, b: int) -> int:
        """Static ints a graph of b tokens reads past its ids, positions and rows."""
        return 0

    def inputs(self, b: int) -> list[torch.Tensor]:
        """The static inputs a graph of b tokens reads: ids, positions, table rows [b] each,
        then its extra field (when ``_num_extra``)."""
        extra = self._num_extra(b)
        return self.static.views([b, b, b, extra] if extra else [b, b, b])

    def metadata(self, b: int, bucket: int) -> StepMetadata:
        """The captured step's metadata from the static buffers (every token a closing
        candidate, padded rows masked), the expert counts zeroed for the step."""
        _, positions, rows = self.inputs(b)[:3]
        req = self.token_req[:b]  # one token a request
        return self.meta(positions, req, rows, bucket, req, self.expert_counts)

    def hidden(self, b: int, bucket: int, head_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The forward from the static buffers: metadata, then the model: hidden [b, D]
        (``head_rows``: of those rows only)."""
        meta = self.metadata(b, bucket)  # zeroes the expert counts
        ids = self.inputs(b)[0]
        hidden, _ = self.model(ids, meta, self.caches, self.expert_counts, head_rows)
        return hidden

    def forward(self, b: int, bucket: int) -> torch.Tensor:
        raise NotImplementedError

    def _captured(self, key: tuple[int, int], out: torch.Tensor) -> None:
        """Hook: after the forward graph of ``key`` (output ``out``) is captured."""

    @torch.inference_mode()
    def capture(self, log: bool = True) -> None:
        """Capture every (size, bucket), largest first, so smaller graphs reuse the pool."""
        keys = [(b, c) for c in reversed(self.buckets) for b in reversed(self.batch_sizes)]
        with frozen_gc():
            for i, key in enumerate(keys):
                graph, out = self._capture(partial(self.forward, *key))
                self.graphs[key] = (graph, out)
                self._captured(key, out)
                if log:
                    print(f"\rcapturing CUDA graphs {i + 1}/{len(keys)}", end="", flush=True)
        if log and keys:
            print(flush=True)

    def _capture(self, region: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """(graph, output) of ``region`` captured into the shared pool."""
        graph, out = capture_region(region, self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def stage(
        self,
        key: tuple[int, int],
        inputs: StepInputs,
        table_writes: tuple[np.ndarray, np.ndarray],
        feed: Feed | None = None,
        extra: np.ndarray | None = None,
    ) -> None:
        """Upload the step, apply its table writes and fill the static inputs of graph
        ``key`` in the same copy: each token's id, position and its request's table row
        (the metadata's row of the token; padded rows: token 0 at position 0 on the null
        row), then ``extra`` (the graph's extra field, ``_num_extra`` ints); ``feed``
        writes the previous step's sampled ids over placeholders, on the device."""
        b = key[0]
        rows = np.asarray(inputs.rows, dtype=np.int64)[inputs.token_req]
        ids, positions = pad_to(inputs.input_ids, b), pad_to(inputs.positions, b)
        rows = pad_to(rows, b, self.buffers.null_row)
        fields = [ids, positions, rows] + ([] if extra is None else [extra])
        w_index, w_values = self.buffers.upload(table_writes, self.static.buffer, fields)
        self.buffers.apply_writes(w_index, w_values)
        if feed is not None:  # async scheduling: last step's tokens, on the device
            feed(self.inputs(b)[0])

    def _padded_key(self, inputs: StepInputs) -> tuple[int, int] | None:
        """(the first size >= the step's tokens, the first bucket >= its longest request),
        or None past the largest of either."""
        i = bisect.bisect_left(self.batch_sizes, len(inputs.input_ids))
        j = bisect.bisect_left(self.buckets, inputs.max_seq_len)
        if i == len(self.batch_sizes) or j == len(self.buckets):
            return None
        return self.batch_sizes[i], self.buckets[j]

    def _replay(self, key: tuple[int, int]) -> torch.Tensor:
        """Graph ``key``'s output after a replay (a key not captured: the same padded step,
        eagerly), then the staged upload's fence: recorded after the graph's launch, not
        between the upload and the graph (``PinnedStaging.fence``)."""
        if key in self.graphs:
            graph, out = self.graphs[key]
            graph.replay()
        else:
            out = self.forward(*key)
        self.buffers.fence()
        return out


class DecodeGraphs(_StepGraphs):
    """Uniform decode steps per (padded batch size, context bucket): the forward to the
    logits, and one sampler graph per variant on them."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        caches: KVCacheTensors,
        buffers: StepBuffers,
        groups: Sequence[CacheGroupSpec],
        batch_sizes: Sequence[int],
        buckets: Sequence[int],
    ) -> None:
        super().__init__(model, caches, buffers, groups, batch_sizes, buckets)
        # every graph writes its logits here: as graph outputs in the pool each (size,
        # bucket) kept its own [b, V] fp32 alive (2.6 GB at 129,280 columns, 256 requests
        # and 4 buckets, against 132 MB)
        self.logits = torch.empty(
            max(batch_sizes), model.cfg.vocab_size, dtype=torch.float32, device=buffers.device
        )
        self.sampling = StaticSampling(max(batch_sizes), model.cfg.vocab_size, buffers.device)
        self.sampler_graphs: dict[tuple[int, int, SamplerVariant], torch.cuda.CUDAGraph] = {}

    def forward(self, b: int, bucket: int) -> torch.Tensor:
        """The captured region: metadata from the static buffers, forward, logits [b, V]."""
        return self.model.compute_logits(self.hidden(b, bucket), out=self.logits[:b])

    def _captured(self, key: tuple[int, int], out: torch.Tensor) -> None:
        """Its sampler graphs on its logits."""
        for variant in SamplerVariant:
            # its warm-up samples whatever the captured logits hold: nobody reads it
            sampler, _ = self._capture(partial(self.sampling.sample, out, variant))
            self.sampler_graphs[(*key, variant)] = sampler

    def key_for(self, inputs: StepInputs) -> tuple[int, int] | None:
        """The graph that serves this step, or None (not uniform decode, or too large)."""
        return self._padded_key(inputs) if inputs.is_uniform_decode else None

    def run(
        self,
        key: tuple[int, int],
        inputs: StepInputs,
        table_writes: tuple[np.ndarray, np.ndarray],
        feed: Feed | None = None,
        in_graph: InGraphSampling | None = None,
    ) -> DecodeResult:
        """Replay the forward graph, and with ``in_graph`` (``in_graph_sampling``: the step
        samples in the graph) the sampler graph of its variant. A key that was not captured
        runs the same padded regions eagerly (the CPU tests do)."""
        self.stage(key, inputs, table_writes, feed)
        if in_graph is not None:
            self.sampling.stage(in_graph)
        logits = self._replay(key)
        num_reqs = len(inputs.rows)
        token_ids = None
        if in_graph is not None:
            sampler = self.sampler_graphs.get((*key, in_graph.variant))
            if sampler is not None:
                sampler.replay()
            else:
                self.sampling.sample(logits, in_graph.variant)
            token_ids = self.sampling.token_ids[:num_reqs]
        return DecodeResult(logits[:num_reqs], token_ids, self.expert_counts)


class PrefillGraphs(_StepGraphs):
    """Graphs of the steps ``DecodeGraphs`` does not serve: prefill chunks and mixed steps of
    up to ``max(sizes)`` tokens, padded to the next captured size (padded tokens at position
    0 on the null row, masked), in context buckets up to ``PREFILL_GRAPH_MAX_CONTEXT``. The
    captured region is ``DecodeGraphs``' without the logits, with the hyper head on the
    step's sampled rows only (their indices in a static buffer of ``max_sampled_rows``
    entries, padded with row 0): it returns their hidden states, of which the runner takes
    the logits eagerly. A step with more sampled rows runs eagerly, as does one that wants
    every row's hidden state (prompt logprobs: the runner's choice). Every token is a
    closing candidate of the compressors, as in a decode graph."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        caches: KVCacheTensors,
        buffers: StepBuffers,
        groups: Sequence[CacheGroupSpec],
        sizes: Sequence[int],
        buckets: Sequence[int],
        max_sampled_rows: int | None = None,
    ) -> None:
        """``max_sampled_rows``: the most rows a step samples (the runner's requests a step;
        None: any number up to the largest size)."""
        self.max_sampled = max(sizes) if max_sampled_rows is None else max_sampled_rows
        super().__init__(model, caches, buffers, groups, sizes, prefill_graph_buckets(buckets))

    def _num_extra(self, t: int) -> int:
        """The sampled rows' indices: as many as the step samples, at most max_sampled."""
        return min(t, self.max_sampled)

    def forward(self, t: int, bucket: int) -> torch.Tensor:
        """The captured region: metadata from the static buffers, forward: the hidden
        states [min(t, max_sampled_rows), D] of the rows in its sampled-rows field."""
        return self.hidden(t, bucket, self.inputs(t)[3])

    def key_for(self, inputs: StepInputs) -> tuple[int, int] | None:
        """The graph that serves this step: None for uniform decode (``DecodeGraphs``'), for
        steps past the largest size or bucket and for more sampled rows than captured."""
        if inputs.is_uniform_decode or len(inputs.logits_indices) > self.max_sampled:
            return None
        return self._padded_key(inputs)

    def run(
        self,
        key: tuple[int, int],
        inputs: StepInputs,
        table_writes: tuple[np.ndarray, np.ndarray],
        feed: Feed | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay (a key not captured: run the same padded step eagerly); returns (the
        sampled rows' hidden states [S, D], in ``logits_indices`` order, and expert_counts
        [L, E]; valid until the next run)."""
        num_sampled = len(inputs.logits_indices)
        indices = np.zeros(self._num_extra(key[0]), dtype=np.int64)
        indices[:num_sampled] = inputs.logits_indices
        self.stage(key, inputs, table_writes, feed, indices)
        return self._replay(key)[:num_sampled], self.expert_counts


def capture_step_graphs(
    model: DeepseekV4ForCausalLM,
    caches: KVCacheTensors,
    buffers: StepBuffers,
    groups: Sequence[CacheGroupSpec],
    max_num_reqs: int,
    max_model_len: int,
    max_step_tokens: int,
    log: bool = True,
) -> tuple[PrefillGraphs, DecodeGraphs]:
    """A runner's graphs, captured: the prefill / mixed steps' first (the larger graphs),
    then the decode steps' into the same pool; with ``log``, the memory they hold (against
    ``memory_profile.runner_reserve_bytes``' estimate)."""
    on_gpu = buffers.device.type == "cuda"
    before = torch.cuda.memory_reserved(buffers.device) if on_gpu else 0
    buckets = context_buckets(max_model_len)
    prefill = PrefillGraphs(
        model, caches, buffers, groups, prefill_graph_sizes(max_step_tokens), buckets,
        max_sampled_rows=max_num_reqs,
    )  # fmt: skip
    prefill.capture(log=log)
    decode = DecodeGraphs(model, caches, buffers, groups, graph_batch_sizes(max_num_reqs), buckets)
    decode.pool = prefill.pool
    decode.capture(log=log)
    release_warm_up_memory()
    if log and on_gpu:
        held = torch.cuda.memory_reserved(buffers.device) - before
        print(
            f"CUDA graphs: {len(prefill.graphs)} prefill / mixed, {len(decode.graphs)} decode, "
            f"{held / 2**30:.2f} GiB",
            flush=True,
        )
    return prefill, decode
