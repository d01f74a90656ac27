"""Cache groups: which paged KV tensors a DeepSeek-V4 model needs, derived from its config.

A cache group is one paged tensor per layer of the group, all sharing one block table. A block
covers ``block_tokens`` token positions and holds ``block_tokens // ratio`` entries of
``entry_width`` elements. Full-history groups keep every block of [0, L); sliding groups keep
only the rows a future query can read (positions >= L - window + 1 once L tokens are computed).

Units: ``*_tokens`` are token positions, ``*_bytes`` are bytes, ``entry_width`` is elements.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rackserve.config import CSA, HCA, ModelConfig


@dataclass(frozen=True)
class CacheGroupSpec:
    """One paged cache group.

    Per layer the group's tensor is ``[num_blocks, block_tokens // ratio, entry_width]``.
    ``window=None``: full history. ``window=W``: sliding; rows below ``L - W + 1`` are dead
    once ``L`` tokens are computed.
    """

    name: str
    layer_ids: tuple[int, ...]
    block_tokens: int
    ratio: int
    window: int | None
    entry_width: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a cache group needs a name")
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"group {self.name!r}: layer_ids must be non-empty and unique")
        if self.block_tokens < 1 or self.ratio < 1 or self.block_tokens % self.ratio:
            raise ValueError(
                f"group {self.name!r}: block_tokens ({self.block_tokens}) must be a positive "
                f"multiple of ratio ({self.ratio})"
            )
        if self.entry_width < 1 or self.dtype_bytes < 1:
            raise ValueError(f"group {self.name!r}: entry_width and dtype_bytes must be >= 1")
        if self.window is not None:
            if self.ratio != 1:
                raise ValueError(f"sliding group {self.name!r} stores raw rows: use ratio=1")
            if not 1 <= self.block_tokens <= self.window:
                raise ValueError(
                    f"sliding group {self.name!r}: block_tokens ({self.block_tokens}) must be "
                    f"<= window ({self.window}); use a smaller block"
                )

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def entries_per_block(self) -> int:
        return self.block_tokens // self.ratio

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers of the group."""
        return self.num_layers * self.entries_per_block * self.entry_width * self.dtype_bytes

    @property
    def bytes_per_token(self) -> float:
        """Bytes per token position over all layers (fractional for compressed groups)."""
        return self.bytes_per_block / self.block_tokens

    def first_live_slot(self, num_computed_tokens: int) -> int:
        """Sliding groups: the first table slot holding a row a query still reads once
        ``L = num_computed_tokens`` tokens are computed. The window rule, in one place::

            positions  ......[ L-W+1 ........ L)
            slots      dead  | first_live_slot(L) ...
        """
        assert self.window is not None, f"{self.name} is not a sliding group"
        return max(0, num_computed_tokens - self.window + 1) // self.block_tokens

    def release_point(self, slot: int) -> int:
        """Sliding groups: the least L at which ``slot`` leaves the window, the inverse of
        :meth:`first_live_slot` (``first_live_slot(L) > slot`` iff ``L >= release_point``)."""
        assert self.window is not None, f"{self.name} is not a sliding group"
        return (slot + 1) * self.block_tokens + self.window - 1

    def ring_blocks(self, max_step_tokens: int) -> int:
        """Sliding groups: the width R of the group's block-table ring, the most table slots
        one request uses within one step of at most ``max_step_tokens`` new positions (the
        scheduled tokens plus any lookahead a drafter writes past them)::

            positions  [ L-W+1 ....... L)[ L ............. L+n )      n <= max_step_tokens
            slots        first_live_slot(L) ........ (L+n-1) // block_tokens
                         <------------------- at most R slots ------------------->

        Slot j lives in ring column ``j % R``: the slots of one step are distinct columns,
        and a slot's column is only reused once it has left every later query's window.
        Independent of max_model_len. (Bound: floor(a/T) - floor(b/T) <= ceil((a-b)/T).)
        """
        assert self.window is not None, f"{self.name} is not a sliding group"
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {max_step_tokens}")
        return -(-(self.window + max_step_tokens - 2) // self.block_tokens) + 1

    @property
    def max_blocks_per_request(self) -> int | None:
        """Sliding groups: blocks a request holds between steps (rows [L-W+1, L) plus the
        block being written); ``None`` for full-history groups (grows with the context)."""
        if self.window is None:
            return None
        return math.ceil((self.window - 1) / self.block_tokens) + 1


def sliding_block_tokens(cfg: ModelConfig) -> int:
    """P: the token span of a sliding-window page (V4-Flash: 64)."""
    return max(1, cfg.sliding_window // 2)


def _state_block_tokens(page: int, window: int) -> int:
    # A state group's block must fit in its window (CacheGroupSpec rule) and divide P so the
    # prefix alignment stays lcm(P, C). V4-Flash's C4 state (window 8) gets 8-token blocks,
    # which holds 16 rows per request instead of 128 (13.8 MB -> 1.7 MB of bf16 state).
    return max(d for d in range(1, min(page, window) + 1) if page % d == 0)


def cache_groups_for(
    cfg: ModelConfig,
    dtype_bytes: int = 2,
    state_dtype_bytes: int | None = None,
    num_mtp_layers: int = 0,
) -> list[CacheGroupSpec]:
    """The cache groups of a DeepSeek-V4 model, every size derived from ``cfg``.

    Groups (empty ones dropped): ``swa`` (every layer), ``csa_state`` / ``hca_state`` (raw
    compressor rows not yet closed into an entry), ``csa_kv`` (compressed KV + indexer key,
    full history), ``hca_kv`` (compressed KV, full history). ``dtype_bytes`` is the element
    size of KV data (bf16: 2), ``state_dtype_bytes`` that of compressor rows (default same).
    """
    state_bytes = dtype_bytes if state_dtype_bytes is None else state_dtype_bytes
    page = sliding_block_tokens(cfg)
    step = math.lcm(cfg.csa_ratio, cfg.hca_ratio, page)
    compressed_block = math.ceil(2 * cfg.sliding_window / step) * step
    csa_layers = tuple(i for i, t in enumerate(cfg.layer_types) if t == CSA)
    hca_layers = tuple(i for i, t in enumerate(cfg.layer_types) if t == HCA)
    d, di = cfg.head_dim, cfg.index_head_dim
    csa_window, hca_window = 2 * cfg.csa_ratio, cfg.hca_ratio
    # (name, layers, block_tokens, ratio, window, entry_width, dtype_bytes)
    table = (
        # MTP layers are sliding-window layers after the main ones (ids L, L+1, ...)
        ("swa", tuple(range(cfg.num_hidden_layers + num_mtp_layers)), page, 1,
         cfg.sliding_window, d,
         dtype_bytes),
        # kv + gate rows of the main and the indexer compressor, both overlap halves each.
        ("csa_state", csa_layers, _state_block_tokens(page, csa_window), 1, csa_window,
         2 * (2 * d) + 2 * (2 * di), state_bytes),
        ("hca_state", hca_layers, _state_block_tokens(page, hca_window), 1, hca_window,
         2 * d, state_bytes),
        ("csa_kv", csa_layers, compressed_block, cfg.csa_ratio, None, d + di, dtype_bytes),
        ("hca_kv", hca_layers, compressed_block, cfg.hca_ratio, None, d, dtype_bytes),
    )  # fmt: skip
    return [CacheGroupSpec(*row) for row in table if row[1]]


def prefix_alignment(specs: Sequence[CacheGroupSpec]) -> int:
    """A: a prefix hit length must be a multiple of every group's block (V4-Flash: 256)."""
    return math.lcm(*(s.block_tokens for s in specs))


def hash_granularity(specs: Sequence[CacheGroupSpec]) -> int:
    """G: token span of one link of the hash chain; every block end is a multiple of it."""
    return math.gcd(*(s.block_tokens for s in specs))


def bytes_per_token(specs: Sequence[CacheGroupSpec]) -> float:
    """Bytes of growing history per token of context (full-history groups only)."""
    return sum(s.bytes_per_token for s in specs if not s.is_sliding)


def bytes_per_request(specs: Sequence[CacheGroupSpec]) -> int:
    """Fixed bytes of sliding-window and compressor state one running request holds."""
    return sum(s.bytes_per_block * (s.max_blocks_per_request or 0) for s in specs)


def plan_num_blocks(
    specs: Sequence[CacheGroupSpec],
    budget_bytes: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> dict[str, int]:
    """Blocks per group (the null block included) for a KV budget of ``budget_bytes``.

    Sliding groups get ``2 * (max_num_seqs * max_blocks_per_request + transient)`` blocks,
    transient = ``ceil(max_num_batched_tokens / block_tokens) + max_num_seqs`` (the rows of
    one step's chunks); the factor 2 leaves room for cached state checkpoints. The rest goes
    to full-history groups in proportion to their bytes per token, so they all cover the same
    number of tokens. Raises ``ValueError`` when the budget cannot hold that minimum.
    """
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
    num_blocks: dict[str, int] = {}
    for s in specs:
        if s.is_sliding:
            transient = math.ceil(max_num_batched_tokens / s.block_tokens) + max_num_seqs
            per_request = s.max_blocks_per_request or 0
            num_blocks[s.name] = 2 * (max_num_seqs * per_request + transient) + 1
        else:  # at least one full chunk of history (+1 partial block, +1 null block)
            num_blocks[s.name] = math.ceil(max_num_batched_tokens / s.block_tokens) + 2
    minimum = sum(num_blocks[s.name] * s.bytes_per_block for s in specs)
    if budget_bytes < minimum:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes is below the {minimum} bytes needed for "
            f"max_num_seqs={max_num_seqs} and max_num_batched_tokens={max_num_batched_tokens}; "
            "raise --kv-cache-memory (or lower max_num_seqs / max_num_batched_tokens)"
        )
    full = [s for s in specs if not s.is_sliding]
    if full:
        sliding_bytes = sum(num_blocks[s.name] * s.bytes_per_block for s in specs if s.is_sliding)
        null_bytes = sum(s.bytes_per_block for s in full)
        num_tokens = int((budget_bytes - sliding_bytes - null_bytes) // bytes_per_token(full))
        for s in full:
            num_blocks[s.name] = num_tokens // s.block_tokens + 1
    return num_blocks


def capacity_tokens(specs: Sequence[CacheGroupSpec], num_blocks: Mapping[str, int]) -> int:
    """Tokens of context the cache can hold over all requests: the least over full-history
    groups (over sliding groups for a model without any, where it counts window rows)."""
    full = [s for s in specs if not s.is_sliding] or list(specs)
    return min((num_blocks[s.name] - 1) * s.block_tokens for s in full)
