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
"""

from __future__ import annotations

import torch
from torch import nn

from rackserve import ops
from rackserve.config import CSA, HCA, SLIDING, ModelConfig
from rackserve.model.batch import ForwardBatch, KVCacheTensors
from rackserve.model.layers import GroupedLinear, RMSNorm, Rotary


class Compressor(nn.Module):
    """Projects tokens to raw (kv, gate) rows and pools closed windows into entries.

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

    def pool(self, rows: torch.Tensor, first_entry: int, rotary: Rotary) -> torch.Tensor:
        """Entries from cached rows.

        rows: [n * r, 2 * row] for HCA (windows first_entry .. first_entry + n - 1), or
        [(n + 1) * r, 2 * row] for CSA (one extra window in front: window first_entry - 1,
        all -inf gates when first_entry == 0). Returns normed, roped entries [n, width].
        """
        r = self.ratio
        kv, gate = rows[:, : self.row], rows[:, self.row :]
        if self.overlap:
            n = kv.shape[0] // r - 1
            if first_entry == 0:  # window -1 does not exist: zero weight in the softmax
                gate = gate.clone()
                gate[:r] = float("-inf")
            # windows [w-1, w] side by side: [n, 2r, 2 * width]
            kv = torch.stack([kv[i * r : (i + 2) * r] for i in range(n)]) if n else kv[:0]
            gate = torch.stack([gate[i * r : (i + 2) * r] for i in range(n)]) if n else gate[:0]
        else:
            n = kv.shape[0] // r
            kv, gate = kv.reshape(n, r, -1), gate.reshape(n, r, -1)
        pooled = ops.compress_windows(kv, gate, self.ape, self.overlap)
        positions = torch.arange(n, device=rows.device) * r + first_entry * r
        cos, sin = rotary(positions, pooled.dtype)
        return ops.apply_rope(self.norm(pooled), cos, sin)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: its own overlapping compressor at Di, and query
    heads scored against the compressed keys. Checkpoint names: ``wq_b``,
    ``weights_proj``, ``compressor.*``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
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
        keys: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Top-k compressed entries per query.

        x: [S, D]; q_residual: [S, q_lora]; cos/sin at the query positions; keys: [Tc, Di];
        visible: [S, Tc] causal visibility. Returns a [S, Tc] bool mask of selected entries.
        """
        s = x.shape[0]
        q = self.wq_b(q_residual).view(s, self.num_heads, self.head_dim)
        q = ops.apply_rope(q, cos, sin)
        weights = self.weights_proj(x).float() * self.num_heads**-0.5
        scores = ops.indexer_scores(q, keys, weights, self.head_dim**-0.5)
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(self.topk, keys.shape[0])
        # Ties (common with few index heads: relu zeroes whole scores) go to the earliest
        # entry, so the choice never depends on how the prompt was chunked.
        top = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        selected = torch.zeros_like(visible).scatter_(1, top, True)
        return selected & visible  # picks past the causal limit are dropped


class Attention(nn.Module):
    """Shared-KV MQA with sinks, partial interleaved RoPE, low-rank Q and grouped
    low-rank output; plus a compressor (CSA: with indexer; HCA) on compressed layers.

    Checkpoint names: ``wq_a``, ``q_norm``, ``wq_b``, ``wkv``, ``norm`` (the kv norm),
    ``wo_a``, ``wo_b``, ``attn_sink``, ``compressor.*``, ``indexer.*``.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, kind: str, rotary: Rotary) -> None:
        super().__init__()
        self.layer_id, self.kind = layer_id, kind
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
            self.indexer = Indexer(cfg)
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
        self, x: torch.Tensor, batch: ForwardBatch, caches: KVCacheTensors
    ) -> None:
        """Write this step's raw rows, then emit every entry whose window closed."""
        state = caches.flat(self.state_group, self.layer_id)
        entries = caches.flat(self.entry_group, self.layer_id)
        parts = self._compressors()
        rows = torch.cat([c.rows(x) for c, _, _ in parts], dim=-1)  # [T, state width]
        r = self.ratio
        for i in range(batch.num_reqs):
            start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            computed, total = batch.num_computed_tokens[i], batch.seq_len(i)
            positions = torch.arange(computed, total, device=x.device)
            state[
                caches.slots(self.state_group, batch.block_table(self.state_group, i), positions)
            ] = rows[start:end]
            first, last = computed // r, total // r  # new entries: [first, last)
            if first == last:
                continue
            lo = (first - 1) * r if self.kind == CSA else first * r
            src = torch.arange(max(lo, 0), last * r, device=x.device)
            window_rows = state[
                caches.slots(self.state_group, batch.block_table(self.state_group, i), src)
            ]
            if lo < 0:  # entry 0 of CSA: a placeholder window -1 (masked in `pool`)
                window_rows = torch.cat([window_rows[:r], window_rows])
            dst = caches.slots(
                self.entry_group,
                batch.block_table(self.entry_group, i),
                torch.arange(first, last, device=x.device),
            )
            for comp, row_cols, entry_cols in parts:
                new = comp.pool(window_rows[:, row_cols], first, self.rotary)
                entries[dst, entry_cols] = new.to(entries.dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: KVCacheTensors) -> torch.Tensor:
        # x: [T, D] (the normed block input) -> [T, D]
        t = x.shape[0]
        cos, sin = self.rotary(batch.positions, x.dtype)
        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).view(t, self.num_heads, self.head_dim)
        q = ops.apply_rope(ops.rms_norm(q, None, self.eps), cos, sin)
        kv = ops.apply_rope(self.norm(self.wkv(x)), cos, sin)  # [T, Dh]
        if self.ratio:
            self._update_compressed(x, batch, caches)

        swa = caches.flat("swa", self.layer_id)
        out = torch.empty_like(q)
        for i in range(batch.num_reqs):
            start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            computed, total = batch.num_computed_tokens[i], batch.seq_len(i)
            q_pos = batch.positions[start:end]
            new_pos = torch.arange(computed, total, device=x.device)
            swa_table = batch.block_table("swa", i)
            swa[caches.slots("swa", swa_table, new_pos)] = kv[start:end].to(swa.dtype)
            key_pos = torch.arange(max(0, computed - self.window + 1), total, device=x.device)
            keys = swa[caches.slots("swa", swa_table, key_pos)].to(q.dtype)
            diff = q_pos[:, None] - key_pos[None, :]
            mask = (diff >= 0) & (diff < self.window)
            if self.ratio and total >= self.ratio:
                keys, mask = self._add_compressed(
                    i, x[start:end], q_residual[start:end], q_pos, batch, caches, keys, mask
                )
            out[start:end] = ops.sink_attention(
                q[start:end], keys, mask, self.attn_sink, self.head_dim**-0.5
            )
        # K = V carried RoPE into the output's rope slice: rotate back by the query position.
        out = ops.apply_rope(out, cos, -sin)
        return self.wo_b(self.wo_a(out.view(t, self.o_groups, -1)))

    def _add_compressed(
        self,
        i: int,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        q_pos: torch.Tensor,
        batch: ForwardBatch,
        caches: KVCacheTensors,
        keys: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append request i's compressed entries to its keys, with per-query visibility."""
        num_entries = batch.seq_len(i) // self.ratio
        entry_ids = torch.arange(num_entries, device=x.device)
        table = batch.block_table(self.entry_group, i)
        rows = caches.flat(self.entry_group, self.layer_id)[
            caches.slots(self.entry_group, table, entry_ids)
        ]
        compressed = rows[:, : self.head_dim].to(keys.dtype)
        # Entry w is complete once token r*w + r - 1 has been seen.
        visible = entry_ids[None, :] < ((q_pos + 1) // self.ratio)[:, None]  # [S, Tc]
        if self.kind == CSA:
            cos, sin = self.rotary(q_pos, x.dtype)
            index_keys = rows[:, self.head_dim :].to(x.dtype)
            visible = self.indexer.select(x, q_residual, cos, sin, index_keys, visible)
        return torch.cat([keys, compressed]), torch.cat([mask, visible], dim=1)
