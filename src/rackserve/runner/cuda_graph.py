"""CUDA graphs of uniform decode steps (every request adds one token and samples).

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

Prefill and mixed steps run eager on the same code: their launches are amortised over
many tokens.

What a graph captures beyond the eager forward of the same step (the CPU launch counter
counts both, tests/runner/test_graph_launches.py): the step's metadata (on a GPU one Triton
launch per cache group, ``ops/triton/step_meta.py``, where ``StepMetadata.build`` takes
~115 small torch kernels), the token mask, zeroing the expert counts, and one compression
launch per compressed layer even when no window closes (its candidates write the null block).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from rackserve.config import HCA
from rackserve.kv.spec import CacheGroupSpec
from rackserve.model.batch import KVCacheTensors, StepMetadata
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.runner.graph_sampling import InGraphSampling, SamplerVariant, StaticSampling
from rackserve.runner.inputs import StepInputs
from rackserve.runner.step_buffers import StepBuffers

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
CONTEXT_BUCKETS = (4096, 16384, 65536, 262144, 1 << 20)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: the listed sizes up to the first >= max_num_seqs."""
    sizes = [b for b in BATCH_SIZES if b < max_num_seqs]
    return [*sizes, next((b for b in BATCH_SIZES if b >= max_num_seqs), BATCH_SIZES[-1])]


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


class DecodeGraphs:
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
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.rows = torch.full((n,), buffers.null_row, dtype=torch.int64, device=device)
        self.token_req = torch.arange(n, device=device)
        cfg = model.cfg
        self.expert_counts = torch.zeros(
            cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.int64, device=device
        )
        self.sampling = StaticSampling(n, cfg.vocab_size, device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sampler_graphs: dict[tuple[int, int, SamplerVariant], torch.cuda.CUDAGraph] = {}
        self.pool = None
        # the metadata kernels: on a GPU, and on the CPU when the model runs Triton everywhere
        # (the interpreter: the launch-count tests); else StepMetadata.build (torch ops)
        self.fast_metadata = buffers.device.type == "cuda" or model.kernels.name == "triton"
        # compressed groups read as [window | entries] by HCA layers: derived with the rest
        self.combined = {
            layer.attn.entry_group for layer in model.model.layers if layer.attn.kind == HCA
        }

    def metadata(self, b: int, bucket: int) -> StepMetadata:
        """The captured step's metadata from the static buffers: every token a closing
        candidate, padded rows masked."""
        rows = self.rows[:b]
        token_mask = rows != self.buffers.null_row
        if self.fast_metadata:
            from rackserve.ops.triton.step_meta import step_metadata

            return step_metadata(
                self.groups, self.positions[:b], self.token_req[:b], rows,
                self.buffers.tables, bucket, token_mask, self.combined,
            )  # fmt: skip
        return StepMetadata.build(
            self.groups,
            self.positions[:b],
            self.token_req[:b],
            {name: table[rows] for name, table in self.buffers.tables.items()},
            bucket,
            {r: self.token_req[:b] for r in self.buffers.ratios},
            token_mask=token_mask,
        )

    def forward(self, b: int, bucket: int) -> torch.Tensor:
        """The captured region: metadata from the static buffers, forward, logits [b, V]."""
        meta = self.metadata(b, bucket)
        self.expert_counts.zero_()
        hidden, _ = self.model(self.input_ids[:b], meta, self.caches, self.expert_counts)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, log: bool = True) -> None:
        """Capture every (size, bucket), largest first, so smaller graphs reuse the pool;
        each forward graph, then its sampler graphs on its logits."""
        keys = [(b, c) for c in reversed(self.buckets) for b in reversed(self.batch_sizes)]
        for i, (b, bucket) in enumerate(keys):
            graph, logits = self._capture(partial(self.forward, b, bucket))
            self.graphs[(b, bucket)] = (graph, logits)
            for variant in SamplerVariant:
                # its warm-up samples whatever the captured logits hold: nobody reads it
                sampler, _ = self._capture(partial(self.sampling.sample, logits, variant))
                self.sampler_graphs[(b, bucket, variant)] = sampler
            if log:
                print(f"\rcapturing CUDA graphs {i + 1}/{len(keys)}", end="", flush=True)
        if log and keys:
            print(flush=True)

    def _capture(
        self, region: Callable[[], torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """(graph, output) of ``region`` captured into the shared pool, after a warm-up on a
        side stream (kernel selection, autotuning)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            region()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = region()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def key_for(self, inputs: StepInputs) -> tuple[int, int] | None:
        """The graph that serves this step, or None (not uniform decode, or too large)."""
        if not inputs.is_uniform_decode:
            return None
        i = bisect.bisect_left(self.batch_sizes, len(inputs.rows))
        j = bisect.bisect_left(self.buckets, inputs.max_seq_len)
        if i == len(self.batch_sizes) or j == len(self.buckets):
            return None
        return self.batch_sizes[i], self.buckets[j]

    def run(
        self,
        key: tuple[int, int],
        inputs: StepInputs,
        table_writes: tuple[np.ndarray, np.ndarray],
        feed: Callable[[torch.Tensor], None] | None = None,
        in_graph: InGraphSampling | None = None,
    ) -> DecodeResult:
        """Replay the forward graph, and with ``in_graph`` (``in_graph_sampling``: the step
        samples in the graph) the sampler graph of its variant. A key that was not captured
        runs the same padded regions eagerly (the CPU tests do)."""
        self.stage(key, inputs, table_writes, feed)
        if in_graph is not None:
            self.sampling.stage(in_graph)
        if key in self.graphs:
            graph, logits = self.graphs[key]
            graph.replay()
        else:
            logits = self.forward(*key)
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

    def stage(
        self,
        key: tuple[int, int],
        inputs: StepInputs,
        table_writes: tuple[np.ndarray, np.ndarray],
        feed: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Upload the step, apply its table writes and fill the static inputs of graph
        ``key`` (padded rows: token 0 at position 0 on the null row; ``feed`` writes the
        previous step's sampled ids over placeholders, on the device)."""
        b = key[0]
        num_reqs = len(inputs.rows)
        pad = b - num_reqs
        rows = np.asarray(inputs.rows, dtype=np.int64)
        if pad:
            zeros = np.zeros(pad, dtype=np.int64)
            ids = np.concatenate([inputs.input_ids, zeros])
            positions = np.concatenate([inputs.positions, zeros])
            rows = np.concatenate([rows, np.full(pad, self.buffers.null_row, dtype=np.int64)])
        else:
            ids, positions = inputs.input_ids, inputs.positions
        write_index, write_values = table_writes
        ids_d, pos_d, rows_d, w_index, w_values = self.buffers.upload(
            [ids, positions, rows, write_index, write_values]
        )
        self.buffers.apply_writes(w_index, w_values)
        self.input_ids[:b].copy_(ids_d)
        if feed is not None:  # async scheduling: last step's tokens, on the device
            feed(self.input_ids)
        self.positions[:b].copy_(pos_d)
        self.rows[:b].copy_(rows_d)
