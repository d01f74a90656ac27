"""DeepSeek-V4 attention over paged caches: sliding window + CSA / HCA compressed entries.

Shape legend: T new tokens in the batch, H heads, Dh head dim, Di indexer head dim,
r compress ratio, W sliding window, Tc compressed entries of one request.

Per layer and request, what the step reads and writes (positions are absolute)::

    0 ............ L-W+1 ...... num_computed ............ L = num_computed + new
                    |-- swa rows read --------------------|   (W rows per query)
    compressed entries 0 .. L // r - 1 (entry w closes at token r*w + r - 1)
    state rows: raw compressor projections, kept for the last 2r (CSA) / r (HCA) tokens

Compression is stateless given the cached raw rows ("carry-over as data"): entry w of an
HCA layer pools the rows of window w; entry w of a CSA layer pools the first half of the
rows of window w-1 with the second half of the rows of window w. So chunked prefill,
preemption and prefix hits need no special path.

The whole batch is computed at once, with no per-request loop and no host sync: every query
gathers its own rows (its W window rows, then the visible HCA entries or the indexer's
top-k CSA entries) through its request's block tables, and one batched sink attention runs
over them. Queries are processed in chunks only to bound the gathered bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from rackserve.config import CSA, HCA, SLIDING, ModelConfig
from rackserve.model.batch import KVCacheTensors, StepMetadata
from rackserve.model.layers import (
    FusedWeights,
    GroupedLinear,
    RMSNorm,
    Rotary,
    grouped_linear,
    linear,
)
from rackserve.ops import Kernels
from rackserve.ops.side_stream import SideStream


class Compressor(nn.Module):
    """Projects tokens to raw (kv, gate) rows; ``ops.compress_pool`` turns the rows of a
    closed window into an entry (pool, norm, RoPE).

    ``width`` is the entry width; with ``overlap`` the rows are twice as wide (the Ca / Cb
    halves of CSA). Checkpoint names: ``wkv``, ``wgate``, ``ape``, ``norm``.
    """

    def __init__(self, cfg: ModelConfig, width: int, ratio: int, overlap: bool) -> None:
        super().__init__()
        row = 2 * width if overlap else width
        self.ratio, self.overlap, self.row = ratio, overlap, row
        self.wkv = nn.Linear(cfg.hidden_size, row, bias=False)
        self.wgate = nn.Linear(cfg.hidden_size, row, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, row, dtype=torch.float32))
        self.norm = RMSNorm(width, cfg.rms_norm_eps)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> raw rows [T, 2 * row] = [kv | gate], cached per token."""
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: its own overlapping compressor at Di, and query
    heads scored against the compressed keys. Checkpoint names: ``wq_b``,
    ``weights_proj``, ``compressor.*``."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.num_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.topk = cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.num_heads, bias=False)
        self.compressor = Compressor(cfg, self.head_dim, cfg.csa_ratio, overlap=True)

    def select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        key_cache: torch.Tensor,
        slots: torch.Tensor,
        num_visible: torch.Tensor,
        window_valid: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k compressed entries of each query, as the rows attention reads.

        q: [S, heads, Di] the roped index queries (``wq_b(q_residual)``); weights: [S, heads]
        float32 (``weights_proj(x) * heads**-0.5``), both made by the attention prologue;
        key_cache: the [N, C] rows whose first Di columns are index keys; slots: [S, E] rows
        of entries 0..E-1 of each query's request; num_visible: [S]; window_valid: [S, W].
        Returns (the picks' slots [S, min(topk, E)], best first; valid [S, W + picks]: the
        window's, then whether each pick is visible). Ties (common with few index heads:
        relu zeroes whole scores) go to the earliest entry, so the choice never depends on
        how the prompt was chunked.
        """
        num = min(self.topk, slots.shape[1])
        return self.kernels.paged_indexer_select(
            q, key_cache, slots, weights, self.head_dim**-0.5, num_visible, num, window_valid
        )


class Projected(NamedTuple):
    """The projections of the layer input x [T, D] that attention reads besides q."""

    q_a: torch.Tensor  # [T, q_lora] (wq_a x)
    kv: torch.Tensor  # [T, Dh] (wkv x)
    state_rows: torch.Tensor | None  # [T, state width]: the compressors' raw rows
    head_logits: torch.Tensor | None  # [T, index heads]: the indexer's weights_proj x (CSA)


# Bytes of gathered rows and scores one attention chunk may hold (queries are processed in
# chunks of at most this much; a decode batch of 256 at 4K context is one chunk).
_CHUNK_BYTES = 1 << 30


class Attention(nn.Module):
    """Shared-KV MQA with sinks, partial interleaved RoPE, low-rank Q and grouped
    low-rank output; plus a compressor (CSA: with indexer; HCA) on compressed layers.

    Checkpoint names: ``wq_a``, ``q_norm``, ``wq_b``, ``wkv``, ``norm`` (the kv norm),
    ``wo_a``, ``wo_b``, ``attn_sink``, ``compressor.*``, ``indexer.*``.
    """

    def __init__(
        self, cfg: ModelConfig, layer_id: int, kind: str, rotary: Rotary, kernels: Kernels
    ) -> None:
        super().__init__()
        self.layer_id, self.kind, self.kernels = layer_id, kind, kernels
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window, self.eps, self.o_groups = cfg.sliding_window, cfg.rms_norm_eps, cfg.o_groups
        self.rotary = rotary  # shared module: "main" for sliding layers, "compress" otherwise
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        in_per_group = self.num_heads * self.head_dim // cfg.o_groups
        self.wo_a = GroupedLinear(in_per_group, cfg.o_lora_rank, cfg.o_groups)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.ratio = 0
        if kind == CSA:
            self.ratio = cfg.csa_ratio
            self.compressor = Compressor(cfg, self.head_dim, self.ratio, overlap=True)
            self.indexer = Indexer(cfg, kernels)
        elif kind == HCA:
            self.ratio = cfg.hca_ratio
            self.compressor = Compressor(cfg, self.head_dim, self.ratio, overlap=False)
        else:
            assert kind == SLIDING, kind
        self._fusions: dict[str, FusedWeights] = {}

    def _x_linears(self) -> list[nn.Module]:
        """Every projection of the layer input x, in the order of the fused weight's rows:
        wq_a, wkv, the compressors' wkv + wgate (in the order of the state rows), the
        indexer's weights_proj."""
        linears = [self.wq_a, self.wkv]
        if self.ratio:
            for comp, _, _ in self._compressors():
                linears += [comp.wkv, comp.wgate]
        if self.kind == CSA:
            linears.append(self.indexer.weights_proj)
        return linears

    def _fusion(self, key: str, linears: list[nn.Module]) -> FusedWeights | None:
        """One weight [sum of widths, in] for ``linears``, for the fast path's single GEMM;
        None when one of them is not a plain ``nn.Linear`` (FP8 linears run one block-scaled
        GEMM each). Rebuilt when the loader swapped modules since."""
        if not all(type(lin) is nn.Linear for lin in linears):
            return None
        fused = self._fusions.get(key)
        if fused is None or any(
            m is not lin for (m, _), lin in zip(fused.params, linears, strict=True)
        ):
            sizes = [lin.out_features for lin in linears]
            fused = FusedWeights(
                [(lin, "weight") for lin in linears],
                torch.cat,
                lambda f: list(f.split(sizes)),
            )
            self._fusions[key] = fused
        return fused

    def _q_linears(self) -> list[nn.Module]:
        """The two projections of q_residual on a CSA layer: attention q, indexer q."""
        return [self.wq_b, self.indexer.wq_b]

    def _project(self, x: torch.Tensor) -> Projected:
        """x [T, D] -> its projections: one GEMM on the fast path, column views of its
        output."""
        fused = self._fusion("x", self._x_linears()) if self.kernels.fast(x) else None
        if fused is None:
            state = None
            if self.ratio:
                state = torch.cat([c.rows(x) for c, _, _ in self._compressors()], dim=-1)
            head_logits = self.indexer.weights_proj(x) if self.kind == CSA else None
            return Projected(self.wq_a(x), self.wkv(x), state, head_logits)
        y = self.kernels.linear(x, fused.get())
        q_lora, width = self.wq_a.out_features, self.head_dim
        state_end = q_lora + width + (self.compressor.wkv.out_features * 2 if self.ratio else 0)
        if self.kind == CSA:
            state_end += self.indexer.compressor.wkv.out_features * 2
        state = y[:, q_lora + width : state_end] if self.ratio else None
        head_logits = y[:, state_end:] if self.kind == CSA else None
        return Projected(y[:, :q_lora], y[:, q_lora : q_lora + width], state, head_logits)

    def fuse_weights(self) -> None:
        """Build the fast path's fused projection weights now (no-op on the reference path)."""
        if self.kernels.fast(self.wq_a.weight):
            for key, linears in self._fused_groups():
                fused = self._fusion(key, linears)
                if fused is not None:
                    fused.get()

    def _fused_groups(self) -> list[tuple[str, list[nn.Module]]]:
        groups = [("x", self._x_linears())]
        return [*groups, ("q", self._q_linears())] if self.kind == CSA else groups

    def _q_projections(self, q_residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q_residual [T, q_lora] -> (``wq_b`` [T, H * Dh], CSA: the indexer's ``wq_b``
        [T, heads * Di], else None); one GEMM on the fast path (column views)."""
        if self.kind != CSA:
            return linear(self.kernels, self.wq_b, q_residual), None
        fused = self._fusion("q", self._q_linears()) if self.kernels.fast(q_residual) else None
        if fused is None:
            return self.wq_b(q_residual), self.indexer.wq_b(q_residual)
        q_both = self.kernels.linear(q_residual, fused.get())
        width = self.wq_b.out_features
        return q_both[:, :width], q_both[:, width:]

    # ---- cache layout of this layer ---------------------------------------------------------
    @property
    def state_group(self) -> str:
        return "csa_state" if self.kind == CSA else "hca_state"

    @property
    def entry_group(self) -> str:
        return "csa_kv" if self.kind == CSA else "hca_kv"

    def _compressors(self) -> list[tuple[Compressor, slice, slice]]:
        """(compressor, its columns in the state rows, its columns in the entries)."""
        main = self.compressor
        main_rows = slice(0, 2 * main.row)
        if self.kind != CSA:
            return [(main, main_rows, slice(0, self.head_dim))]
        idx = self.indexer.compressor
        return [
            (main, main_rows, slice(0, self.head_dim)),
            (idx, slice(2 * main.row, 2 * main.row + 2 * idx.row), slice(self.head_dim, None)),
        ]

    def _compress(self, meta: StepMetadata, caches: KVCacheTensors) -> None:
        """Emit the entry of every window that closed this step (``meta.compression``:
        which windows, from which state rows, into which slots); the state rows of this
        step are already written."""
        plan = meta.compression[self.entry_group]
        if plan.dst.numel() == 0:
            return
        parts = [
            (rows.start, comp.ape, comp.norm.weight, cols.start)
            for comp, rows, cols in self._compressors()
        ]
        self.kernels.compress_entries(
            caches.flat(self.state_group, self.layer_id), plan.src, plan.missing, plan.dst,
            caches.flat(self.entry_group, self.layer_id), parts, self.compressor.norm.eps,
            plan.positions, self.rotary.inv_freq, self.rotary.scale,
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        meta: StepMetadata,
        caches: KVCacheTensors,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        # x: [T, D] (the normed block input) -> [T, D]; rope: this step's (cos, sin) of
        # ``self.rotary`` when the model computed them once for every layer
        t, k = x.shape[0], self.kernels
        rope = self.rotary(meta.positions, x.dtype) if rope is None else rope
        cos, sin = rope
        proj = self._project(x)
        q_residual = k.rms_norm(proj.q_a, self.q_norm.weight, self.eps)
        swa = caches.flat("swa", self.layer_id)
        chunk = self._chunk_tokens(t, meta.max_seq_len, x.element_size(), x.is_cuda)
        picks = None  # the compressed rows of every query, when computed before the loop
        if self.kind == CSA and chunk == t and k.indexer_beside_q(x):
            q, picks = self._indexer_beside_q(q_residual, proj, rope, meta, caches)
            q_index = index_weights = None
            q_norm_eps = self.eps  # the attention norms and rotates q
        else:
            q, q_index = self._q_projections(q_residual)
            # q: per-head norm + RoPE (or by the attention kernel as it loads q); kv: norm +
            # RoPE into the window, the compressor's raw rows into the state; CSA: the
            # indexer's q RoPE and head weights
            raw_q = k.attention_norms_q(q)
            q_norm_eps = self.eps if raw_q else None
            q, q_index, index_weights = self._prologue(
                q, proj, q_index, rope, meta, caches, norm_q=not raw_q
            )
            if self.ratio:
                self._compress(meta, caches)

        window = meta.gather["swa"]
        out = torch.empty_like(q) if chunk < t else None  # one chunk: no copy into `out`
        for a in range(0, t, chunk):
            rows = slice(a, min(a + chunk, t))
            entries, slots, valid = picks if picks is not None else self._compressed_rows(
                meta, caches, rows,
                None if q_index is None else q_index[rows],
                None if index_weights is None else index_weights[rows],
            )  # fmt: skip
            # K = V carried RoPE into the output's rope slice: the op rotates it back
            o = k.paged_sparse_attention(
                q[rows], swa, window.slots[rows], entries, slots, valid, self.attn_sink,
                self.head_dim**-0.5, cos[rows], sin[rows], q_norm_eps=q_norm_eps,
            )  # fmt: skip
            if out is None:
                out = o
            else:
                out[rows] = o
        o = grouped_linear(self.kernels, self.wo_a, out.view(t, self.o_groups, -1))
        return linear(self.kernels, self.wo_b, o)

    def _prologue(
        self,
        q: torch.Tensor,
        proj: Projected,
        q_index: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: StepMetadata,
        caches: KVCacheTensors,
        norm_q: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``Kernels.attention_prologue`` on this layer's caches: (q, normed and roped unless
        ``norm_q`` is False; the indexer's roped q and head weights, CSA only)."""
        t, (cos, sin) = q.shape[0], rope
        state, state_slots = None, None
        if self.ratio:
            state = caches.flat(self.state_group, self.layer_id)
            state_slots = meta.slot_mapping[self.state_group]
        index_heads = self.indexer.num_heads if self.kind == CSA else 1
        return self.kernels.attention_prologue(
            q.view(t, self.num_heads, self.head_dim), proj.kv, self.norm.weight, self.eps, cos,
            sin, caches.flat("swa", self.layer_id), meta.slot_mapping["swa"], proj.state_rows,
            state, state_slots, None if q_index is None else q_index.view(t, index_heads, -1),
            proj.head_logits, index_heads**-0.5, norm_q=norm_q,
        )  # fmt: skip

    def _indexer_beside_q(
        self,
        q_residual: torch.Tensor,
        proj: Projected,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: StepMetadata,
        caches: KVCacheTensors,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """A CSA layer's q projection on the current stream and, beside it on the side stream,
        the rest of what the attention reads: the prologue without q (kv into the window, the
        raw rows into the state, the indexer's q RoPE and head weights), the closing entries
        and the indexer's top-k. Returns the raw q (the attention norms and rotates it) and
        the compressed rows of every query.

        The indexer's q projection runs first, in series: the side stream runs no GEMV (the
        split-K GEMV keeps one set of counters per device, for one stream at a time), so the
        two q projections are two GEMMs here (one fused GEMM in series). The side's prologue
        is handed the q being computed on the current stream only for its shape: it does not
        read q when ``norm_q`` is False."""
        k = self.kernels
        q_index = linear(k, self.indexer.wq_b, q_residual)
        side = SideStream.of(q_residual.device)
        side.fork()
        q = linear(k, self.wq_b, q_residual)
        with side.active():
            _, q_index, index_weights = self._prologue(
                q, proj, q_index, rope, meta, caches, norm_q=False
            )
            self._compress(meta, caches)
            picks = self._compressed_rows(
                meta, caches, slice(0, q.shape[0]), q_index, index_weights
            )
        side.join()
        return q.view(q.shape[0], self.num_heads, self.head_dim), picks

    def _chunk_tokens(
        self, num_tokens: int, max_seq_len: int, element_size: int, on_cuda: bool
    ) -> int:
        """Queries per chunk so that one chunk's gathered rows and scores stay bounded (the
        fast kernels on a GPU gather nothing in place: only the indexer's [n, E] int64 keys)."""
        in_place = on_cuda and self.kernels.name != "reference"
        entries = max_seq_len // self.ratio if self.ratio else 0
        if in_place:
            per_token = 16 * entries if self.kind == CSA else 1
            return max(1, min(num_tokens, _CHUNK_BYTES // per_token))
        rows = self.window + (min(entries, self.indexer.topk) if self.kind == CSA else entries)
        per_token = rows * (self.head_dim * element_size + 4 * self.num_heads)
        if self.kind == CSA:  # the indexer's fp32 keys and per-head scores
            per_token += entries * 4 * (self.indexer.head_dim + self.indexer.num_heads)
        return max(1, min(num_tokens, _CHUNK_BYTES // per_token))

    def _compressed_rows(
        self,
        meta: StepMetadata,
        caches: KVCacheTensors,
        rows: slice,
        q_index: torch.Tensor | None,
        index_weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The compressed rows the queries of ``rows`` attend to besides their window.

        Query at position p: (HCA) entries 0 .. E-1, or (CSA) the indexer's picks; entry e
        is visible once p >= r*e + r - 1, and E = max_seq_len // r bounds every request's
        entries. Returns (the entry cache, slots [n, K], valid [n, W + K] over
        [window | compressed]); a sliding layer returns no compressed slots.
        """
        window_valid = meta.gather["swa"].valid[rows]
        swa = caches.flat("swa", self.layer_id)
        if not self.ratio or meta.max_seq_len < self.ratio:
            return swa, meta.gather["swa"].slots[rows][:, :0], window_valid
        entries = caches.flat(self.entry_group, self.layer_id)
        plan = meta.gather[self.entry_group]
        slots = plan.slots[rows]  # [n, E]
        if self.kind == CSA:  # entry rows are [kv (Dh) | indexer key (Di)]
            num_visible = plan.num_visible[rows]
            assert q_index is not None and index_weights is not None
            slots, valid = self.indexer.select(
                q_index, index_weights, entries[:, self.head_dim :], slots, num_visible,
                window_valid,
            )  # fmt: skip
            return entries, slots, valid
        return entries, slots, meta.window_and_entries_valid(self.entry_group)[rows]
