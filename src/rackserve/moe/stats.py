"""Expert load statistics: per-step token counts in a device ring buffer, balancedness.

Shape legend: W window (steps), L MoE layers, E logical experts, S physical slots,
R expert-parallel ranks, T tokens, k experts per token.

Recording is a ``scatter_add_`` into the current step's row: no host sync, so it can run
inside the forward pass (and a CUDA graph). The host only moves an integer step pointer.
Physical counts give the load every rank actually processed (slots never change rank, so
they stay meaningful across rearrangements); logical counts are what the EPLB policy needs
and do not depend on the placement. Per step and layer, balancedness = mean rank load /
max rank load; the uniform reference routes the same batch uniformly at random (top-k).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rackserve.moe.placement import ExpertPlacement, choose_replicas

DEFAULT_WINDOW = 1000


def balancedness(rank_load: torch.Tensor) -> torch.Tensor:
    """rank_load: [..., R] tokens per rank -> [...] mean / max (1.0 where no tokens)."""
    load = rank_load.double()
    top = load.max(-1).values
    return torch.where(top > 0, load.mean(-1) / top.clamp(min=1e-30), torch.ones_like(top))


def slot_to_rank_load(slot_load: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """slot_load: [..., S] (rank-major slots) -> [..., R]."""
    return slot_load.unflatten(-1, (num_ranks, -1)).sum(-1)


class ExpertLoadRecorder:
    """Token counts per (step in window, layer, slot), physical and logical, on ``device``.

    The model's MoE layer calls ``record(layer, topk_ids, physical_ids)`` once per forward;
    the engine calls ``next_step()`` at each step boundary. With ``uniform_reference`` the
    same batch is also routed uniformly at random (top-k, under the current placement) so
    that the balancedness gap to the ceiling is visible.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_slots: int,
        window: int = DEFAULT_WINDOW,
        device: torch.device | str = "cpu",
        uniform_reference: bool = False,
        seed: int = 0,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        if num_slots < num_experts:
            raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts")
        # int32 halves the buffer; 2^31 tokens per slot per step is far out of reach. One row
        # more than the window: the step in progress never overwrites a completed one.
        rows = window + 1
        self.physical = torch.zeros(rows, num_layers, num_slots, dtype=torch.int32, device=device)
        self.logical = torch.zeros(rows, num_layers, num_experts, dtype=torch.int32, device=device)
        self.uniform = torch.zeros_like(self.physical) if uniform_reference else None
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.window = window
        self.num_steps = 0  # steps completed; the current row is num_steps % (window + 1)

    @property
    def row(self) -> int:
        return self.num_steps % (self.window + 1)

    def record(
        self,
        layer: int,
        topk_ids: torch.Tensor,
        physical_ids: torch.Tensor,
        placement: ExpertPlacement | None = None,
    ) -> None:
        """topk_ids, physical_ids: [T, k] of this rank's batch at MoE layer ``layer``.
        ``placement`` is needed (on the device) only for the uniform reference."""
        ones = torch.ones(topk_ids.numel(), dtype=torch.int32, device=topk_ids.device)
        self.logical[self.row, layer].scatter_add_(0, topk_ids.flatten().long(), ones)
        self.physical[self.row, layer].scatter_add_(0, physical_ids.flatten().long(), ones)
        if self.uniform is not None:
            if placement is None:
                raise ValueError("the uniform reference needs the placement in record()")
            num_tokens, top_k = topk_ids.shape
            noise = torch.rand(
                num_tokens,
                self.logical.shape[2],
                generator=self.generator,
                device=topk_ids.device,
            )
            uniform_ids = noise.topk(top_k, dim=1).indices
            slots = choose_replicas(
                uniform_ids, placement.logical_to_physical[layer], placement.replica_count[layer]
            )
            self.uniform[self.row, layer].scatter_add_(0, slots.flatten(), ones)

    def next_step(self) -> None:
        """Close the current step; the oldest step of the window is forgotten."""
        self.num_steps += 1
        self.physical[self.row].zero_()
        self.logical[self.row].zero_()
        if self.uniform is not None:
            self.uniform[self.row].zero_()

    def _window(self, buffer: torch.Tensor) -> torch.Tensor:
        """The completed steps of the window, oldest first: [W', L, *]."""
        filled = min(self.num_steps, self.window)
        rows = [(self.num_steps - filled + i) % (self.window + 1) for i in range(filled)]
        return buffer[rows]

    def logical_load(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Tokens per logical expert over the window, summed over the EP group when given:
        [L, E] int64 (the EPLB policy's input). Collective: every rank of ``group`` calls it."""
        load = self._window(self.logical).sum(0, dtype=torch.int64)
        if group is not None:
            dist.all_reduce(load, group=group)
        return load

    def step_balancedness(
        self, num_ranks: int, group: dist.ProcessGroup | None = None, uniform: bool = False
    ) -> torch.Tensor:
        """Per-step balancedness over the window, averaged over the steps that routed
        tokens: [L] float64. Counts are summed over ``group`` first (each rank records only
        its own batch); collective when ``group`` is given."""
        buffer = self.uniform if uniform else self.physical
        if buffer is None:
            raise ValueError("this recorder was built without the uniform reference")
        steps = self._window(buffer).to(torch.int64)  # [W', L, S]
        if group is not None:
            dist.all_reduce(steps, group=group)
        rank_load = slot_to_rank_load(steps, num_ranks)  # [W', L, R]
        active = rank_load.sum(-1) > 0
        value = torch.where(
            active,
            balancedness(rank_load),
            torch.zeros((), dtype=torch.float64, device=steps.device),
        )
        num_active = active.sum(0).clamp(min=1)
        return (value.sum(0) / num_active).cpu()


def routed_rank_load(
    topk_ids: torch.Tensor, placement: ExpertPlacement, layer: int, offset: int = 0
) -> torch.Tensor:
    """Tokens each rank receives when one layer's batch topk_ids [T, k] is dispatched under
    ``placement`` (replicas chosen as the dispatcher chooses them): [R] int64."""
    slots = choose_replicas(
        topk_ids, placement.logical_to_physical[layer], placement.replica_count[layer], offset
    )
    counts = torch.bincount(slots.flatten(), minlength=placement.num_slots)
    return slot_to_rank_load(counts, placement.num_ranks)
