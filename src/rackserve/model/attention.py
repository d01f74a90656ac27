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

import torch
from torch import nn

from rackserve.config import CSA, HCA, SLIDING, ModelConfig
from rackserve.model.batch import KVCacheTensors, StepMetadata
from rackserve.model.layers import GroupedLinear, RMSNorm, Rotary
from rackserve.ops import Kernels


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
        x: torch.Tensor,
        q_residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        slots: torch.Tensor,
        num_visible: torch.Tensor,
    ) -> torch.Tensor:
        """Top-k compressed entries per query.

        x: [S, D]; q_residual: [S, q_lora]; cos/sin at the query positions; key_cache: the
        [N, C] rows whose first Di columns are index keys; slots: [S, E] rows of entries
        0..E-1 of each query's request; num_visible: [S]. Returns entry ids
        [S, min(topk, E)], best first; ids >= num_visible are not visible (the caller masks).
        Ties (common with few index heads: relu zeroes whole scores) go to the earliest
        entry, so the choice never depends on how the prompt was chunked.
        """
        s, k = x.shape[0], self.kernels
        q = k.apply_rope(self.wq_b(q_residual).view(s, self.num_heads, self.head_dim), cos, sin)
        weights = self.weights_proj(x).float() * self.num_heads**-0.5
        num = min(self.topk, slots.shape[1])
        return k.paged_indexer_topk(
            q, key_cache, slots, weights, self.head_dim**-0.5, num_visible, num
        )


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

    def _update_compressed(
        self, x: torch.Tensor, meta: StepMetadata, caches: KVCacheTensors
    ) -> None:
        """Write this step's raw rows, then emit the entry of every window that closed
        (``meta.compression``: which windows, from which state rows, into which slots)."""
        state = caches.flat(self.state_group, self.layer_id)
        entries = caches.flat(self.entry_group, self.layer_id)
        parts = self._compressors()
        rows = torch.cat([c.rows(x) for c, _, _ in parts], dim=-1)  # [T, state width]
        state[meta.slot_mapping[self.state_group]] = rows.to(state.dtype)
        plan = meta.compression[self.entry_group]
        if plan.dst.numel() == 0:
            return
        rotary = self.rotary
        for comp, row_cols, entry_cols in parts:
            new = self.kernels.compress_pool(
                state, plan.src, plan.missing, row_cols.start, comp.ape, comp.norm.weight,
                comp.norm.eps, plan.positions, rotary.inv_freq, rotary.scale,
            )  # fmt: skip
            entries[plan.dst, entry_cols] = new.to(entries.dtype)

    def forward(self, x: torch.Tensor, meta: StepMetadata, caches: KVCacheTensors) -> torch.Tensor:
        # x: [T, D] (the normed block input) -> [T, D]
        t, k = x.shape[0], self.kernels
        cos, sin = self.rotary(meta.positions, x.dtype)
        q_residual = k.rms_norm(self.wq_a(x), self.q_norm.weight, self.eps)
        q = self.wq_b(q_residual).view(t, self.num_heads, self.head_dim)
        q = k.rms_norm_rope(q, None, self.eps, cos, sin)  # unweighted per-head norm
        kv = k.rms_norm_rope(self.wkv(x), self.norm.weight, self.eps, cos, sin)  # [T, Dh]
        swa = caches.flat("swa", self.layer_id)
        swa[meta.slot_mapping["swa"]] = kv.to(swa.dtype)
        if self.ratio:
            self._update_compressed(x, meta, caches)

        out = torch.empty_like(q)
        window = meta.gather["swa"]
        in_place = x.is_cuda and k.name != "reference"  # the kernels read rows in place
        chunk = self._chunk_tokens(t, meta.max_seq_len, x.element_size(), in_place)
        for a in range(0, t, chunk):
            rows = slice(a, min(a + chunk, t))
            entries, slots, valid = self._compressed_rows(
                meta, caches, rows, x[rows], q_residual[rows], cos[rows], sin[rows]
            )
            # K = V carried RoPE into the output's rope slice: the op rotates it back
            out[rows] = k.paged_sparse_attention(
                q[rows], swa, window.slots[rows], entries, slots, valid, self.attn_sink,
                self.head_dim**-0.5, cos[rows], sin[rows],
            )  # fmt: skip
        return self.wo_b(self.wo_a(out.view(t, self.o_groups, -1)))

    def _chunk_tokens(
        self, num_tokens: int, max_seq_len: int, element_size: int, in_place: bool
    ) -> int:
        """Queries per chunk so that one chunk's gathered rows and scores stay bounded
        (``in_place``: kernels that gather nothing, only the indexer's [n, E] int64 keys)."""
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
        x: torch.Tensor,
        q_residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
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
            ids = self.indexer.select(
                x, q_residual, cos, sin, entries[:, self.head_dim :], slots, num_visible
            )
            slots, picked = slots.gather(1, ids), ids < num_visible[:, None]
        else:
            picked = plan.valid[rows]
        return entries, slots, torch.cat([window_valid, picked], dim=1)
