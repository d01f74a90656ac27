"""One model's expert parallelism on one rank: placement, dispatch, load statistics, EPLB.

Shape legend: L MoE layers, E logical experts, S physical slots, R EP ranks,
S_r = S / R slots per rank, T tokens on this rank, k top-k, D hidden.

The model's MoE layers hold a reference to this object (passed at construction, never a
global) and call ``dispatcher.dispatch`` / ``combine`` and ``recorder.record``. The engine
calls ``end_step()`` on every rank at every step boundary (the ranks step together: the DP
sync in ``engine/dp.py`` guarantees it), which closes the statistics step, swaps in a
rearranged layer when its weights have landed, and every ``step_interval`` steps starts a
rebalance::

    step s:  forward (dispatch / combine, record)  -> end_step: recorder.next_step()
                                                      rearranger.step()   (one layer)
                                                      s % interval == 0: rebalance()
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from rackserve.config import EPLBConfig
from rackserve.moe.dispatch import AllToAllDispatcher, LocalDispatcher, MoEDispatcher
from rackserve.moe.eplb import rebalance_experts, rebalance_with_move_cap
from rackserve.moe.placement import ExpertPlacement
from rackserve.moe.rearrange import ExpertRearranger
from rackserve.moe.stats import ExpertLoadRecorder
from rackserve.parallel.groups import ParallelGroups


class ExpertParallel:
    """This rank's share of a model's routed experts and the EPLB schedule.

    ``eplb`` None: the placement never changes (statistics are still recorded, for the
    balancedness metric). A draft model with its own expert count gets its own object.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_slots: int,
        groups: ParallelGroups,
        device: torch.device | str = "cpu",
        eplb: EPLBConfig | None = None,
        window_size: int | None = None,
    ) -> None:
        num_ranks = groups.ep_size
        placement = ExpertPlacement.default(num_layers, num_experts, num_ranks, num_slots)
        placement = placement.to(device)
        self.groups = groups
        self.dispatcher: MoEDispatcher
        if num_ranks == 1:
            self.dispatcher = LocalDispatcher(placement)
        else:
            if groups.ep_group is None:
                raise ValueError("expert parallelism over several ranks needs the EP group")
            self.dispatcher = AllToAllDispatcher(placement, groups.ep_group)
        self.eplb = eplb
        config = eplb or EPLBConfig()
        self.recorder = ExpertLoadRecorder(
            num_layers,
            num_experts,
            num_slots,
            window=window_size or config.window_size,
            device=device,
            uniform_reference=config.uniform_reference,
        )
        self.rearranger: ExpertRearranger | None = None
        self.moe_layers: list[nn.Module] = []
        self.num_steps = 0
        self.num_rebalances = 0
        self.window_size = window_size or config.window_size
        # (real [L], uniform [L] or None), refreshed once per window and before a rebalance
        self.last_balancedness: tuple[list[float], list[float] | None] | None = None

    # ---- placement ------------------------------------------------------------------------
    @property
    def placement(self) -> ExpertPlacement:
        return self.dispatcher.placement

    @property
    def ep_rank(self) -> int:
        return self.dispatcher.ep_rank

    @property
    def num_ranks(self) -> int:
        return self.dispatcher.num_ranks

    def local_experts(self, layer: int) -> list[int]:
        """Logical expert held by each of this rank's slots in ``layer``: [S_r] as a list."""
        per_rank = self.placement.physical_to_logical[layer].view(self.num_ranks, -1)
        return per_rank[self.ep_rank].tolist()

    def bind(self, moe_layers: list[nn.Module]) -> None:
        """Attach the model's MoE modules (in layer order; each has ``experts.w13`` [S_r,
        2I, D] and ``experts.w2`` [S_r, D, I]) so weights can move and idle ranks can run
        the dummy pass."""
        if len(moe_layers) != self.placement.num_layers:
            raise ValueError(
                f"{len(moe_layers)} MoE layers for a placement of {self.placement.num_layers}"
            )
        self.moe_layers = list(moe_layers)

    def _rearranger_for_weights(self) -> ExpertRearranger:
        # Built at the first rebalance, not in bind(): loading may still replace the
        # parameters' tensors (a dtype cast), and the moves write into the final ones.
        if self.rearranger is None:
            weights = [[m.experts.w13.data, m.experts.w2.data] for m in self.moe_layers]
            self.rearranger = ExpertRearranger(weights, self.dispatcher, self.groups.ep_move_group)
        return self.rearranger

    # ---- per step -------------------------------------------------------------------------
    @torch.inference_mode()
    def dummy_pass(self) -> None:
        """An idle rank's step: every MoE layer with zero tokens, so the dispatch
        collectives of the other ranks complete (this rank still runs its experts on the
        rows it receives)."""
        for moe in self.moe_layers:
            weight = moe.gate.weight
            x = weight.new_empty((0, weight.shape[1]))
            input_ids = torch.empty(0, dtype=torch.int64, device=weight.device)
            moe(x, input_ids)

    def end_step(self) -> None:
        """Every rank, at every step boundary, in the same order."""
        self.recorder.next_step()
        if self.rearranger is not None:
            self.rearranger.step()
        self.num_steps += 1
        rebalance = self.eplb is not None and self.num_steps % self.eplb.step_interval == 0
        if rebalance or self.num_steps % self.window_size == 0:
            # Collective, on every rank at the same step: the metric the front end exports.
            self.last_balancedness = self.balancedness()
        if rebalance:
            self.rebalance()

    def rebalance(self) -> ExpertPlacement | None:
        """Compute a placement from the window's loads (summed over EP) and start moving to
        it. Collective over the EP group. Returns the target (None while a move runs)."""
        if not self.moe_layers:
            raise ValueError("bind() the model's MoE layers before rebalancing")
        rearranger = self._rearranger_for_weights()
        if rearranger.busy:
            return None  # the previous move is still landing: skip this interval
        load = self.recorder.logical_load(self.groups.ep_group if self.num_ranks > 1 else None)
        load = load.cpu().double()
        current = self.placement.to("cpu")
        cap = self.eplb.max_moves_per_layer if self.eplb is not None else None
        if cap is None:
            target = rebalance_experts(load, current.num_slots, 1, 1, self.num_ranks)
        else:
            target = rebalance_with_move_cap(load, current, cap)
        self.num_rebalances += 1
        # Every rank computed the same target from the same all-reduced loads.
        rearranger.start(target.to(self.placement.physical_to_logical.device))
        return target

    @property
    def rearranging(self) -> bool:
        return self.rearranger is not None and self.rearranger.busy

    def balancedness(self) -> tuple[list[float], list[float] | None]:
        """Per-layer balancedness over the window, real routing and the uniform reference
        (None without it): ([L], [L]). Collective over the EP group."""
        group = self.groups.ep_group if self.num_ranks > 1 else None
        real = self.recorder.step_balancedness(self.num_ranks, group).tolist()
        if self.recorder.uniform is None:
            return real, None
        uniform = self.recorder.step_balancedness(self.num_ranks, group, uniform=True)
        return real, uniform.tolist()


def ep_barrier(groups: ParallelGroups) -> None:
    """Wait for every EP rank (tests and shutdown)."""
    if groups.ep_group is not None and groups.ep_size > 1:
        dist.barrier(group=groups.ep_group)
