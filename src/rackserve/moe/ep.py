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

EPLB state is per model (``ExpertParallelModels``, keyed by name): the target's decoder
layers ("main"), its MTP layers ("mtp"), a separate draft model with its own expert count.
Each has its own placement, loads, EPLB schedule and dummy pass, and steps only when its
layers ran, so one model's traffic never skews another's placement.

Why the MTP layers' experts are sharded too (not whole on every rank): a draft step at
64 requests x top-k touches nearly every expert, so a replicated MTP layer reads all E
experts per rank per draft step (V4-Flash: ~3 GB in FP4, ~0.8 ms at 4 TB/s) and holds them
in every rank's memory, where a sharded one reads E / R and pays one dispatch/combine. The
cost is that a draft step becomes collective, like a target step: every rank runs it (an
idle rank, the MTP model's dummy pass) in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from rackserve.config import EngineConfig, EPLBConfig
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
    ``first_layer``: the model layer id of this object's layer 0 (the MTP layers' ids
    continue the decoder's: ``num_hidden_layers + k``); ``name`` keys it per model.
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
        first_layer: int = 0,
        name: str = "main",
    ) -> None:
        self.name = name
        self.first_layer = first_layer
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

    def layer_index(self, model_layer_id: int) -> int:
        """This object's index of the MoE layer the model numbers ``model_layer_id``."""
        index = model_layer_id - self.first_layer
        if not 0 <= index < self.placement.num_layers:
            raise ValueError(
                f"layer {model_layer_id} is not one of EP model {self.name!r}'s layers "
                f"[{self.first_layer}, {self.first_layer + self.placement.num_layers})"
            )
        return index

    def local_experts(self, layer: int) -> list[int]:
        """Logical expert held by each of this rank's slots in ``layer``: [S_r] as a list."""
        per_rank = self.placement.physical_to_logical[layer].view(self.num_ranks, -1)
        return per_rank[self.ep_rank].tolist()

    def bind(self, moe_layers: list[nn.Module]) -> None:
        """Attach the model's MoE modules (in layer order; each has ``experts.w13`` [S_r,
        2I, D] and ``experts.w2`` [S_r, D, I]; FP4 experts: packed ``w13`` / ``w2`` and
        their ``w13_scale`` / ``w2_scale``) so weights can move and idle ranks can run the
        dummy pass."""
        if len(moe_layers) != self.placement.num_layers:
            raise ValueError(
                f"{len(moe_layers)} MoE layers for a placement of {self.placement.num_layers}"
            )
        self.moe_layers = list(moe_layers)

    def _rearranger_for_weights(self) -> ExpertRearranger:
        # Built at the first rebalance, not in bind(): loading may still replace the
        # parameters' tensors (a dtype cast), and the moves write into the final ones.
        if self.rearranger is None:
            weights = [expert_tensors(m.experts) for m in self.moe_layers]
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


def expert_tensors(experts: object) -> list[torch.Tensor]:
    """Every per-slot tensor of an ``Experts`` module, each [S_r, ...]: what EPLB moves
    together when a slot changes expert. FP4 experts: the packed weights and their scales
    (a slot's scales must travel with its bytes, or the moved expert dequantizes wrong)."""
    names = ["w13", "w2"]
    if getattr(experts, "fp4", False):
        names = ["w13", "w13_scale", "w2", "w2_scale"]
    return [getattr(experts, name).data for name in names]


class ExpertParallelModels:
    """Every model's EP state on this rank, keyed by name ("main", "mtp", a draft's).

    Each model is balanced on its own: its loads, placement and rebalance schedule never
    mix with another's, so a draft model with a different expert count (or MTP layers that
    run only on draft steps) is balanced separately. ``end_step(ran)`` closes the step of
    the models whose layers ran (every rank passes the same names: the step is collective).
    """

    def __init__(self, models: list[ExpertParallel] | None = None) -> None:
        self.models: dict[str, ExpertParallel] = {}
        for model in models or []:
            self.add(model)

    def add(self, model: ExpertParallel) -> None:
        if model.name in self.models:
            raise ValueError(f"an EP model named {model.name!r} is already registered")
        self.models[model.name] = model

    def get(self, name: str) -> ExpertParallel | None:
        return self.models.get(name)

    def __getitem__(self, name: str) -> ExpertParallel:
        if name not in self.models:
            raise KeyError(f"no EP model {name!r}; registered: {sorted(self.models)}")
        return self.models[name]

    def __contains__(self, name: object) -> bool:
        return name in self.models

    def __len__(self) -> int:
        return len(self.models)

    def end_step(self, ran: tuple[str, ...] = ("main",)) -> None:
        """At a step boundary, on every rank: close the step of the models that ran."""
        for name in ran:
            self[name].end_step()

    def balancedness(self) -> dict[str, tuple[list[float], list[float] | None]]:
        """Per model: (real [L], uniform [L] or None). Collective over the EP group."""
        return {name: model.balancedness() for name, model in self.models.items()}


def expert_parallel_models(
    config: EngineConfig, groups: ParallelGroups, device: torch.device | str
) -> ExpertParallelModels:
    """This rank's EP models under ``--enable-expert-parallel`` (none without it): "main",
    the decoder layers, and "mtp", the MTP layers (when the config declares them; used
    only when the checkpoint has them), each with the same slots and EPLB settings."""
    par = config.parallel
    if not par.expert_parallel:
        return ExpertParallelModels()
    if groups.ep_size != par.expert_parallel_size:
        raise ValueError(
            f"expert parallelism over {par.expert_parallel_size} ranks needs process groups of "
            f"that size (got {groups.ep_size}): launch the ranks with engine/dp.py"
        )
    cfg = config.model_config
    common = {
        "num_experts": cfg.n_routed_experts,
        "num_slots": par.num_physical_experts(cfg.n_routed_experts),
        "groups": groups,
        "device": device,
        "eplb": par.eplb if par.enable_eplb else None,
        "window_size": par.eplb.window_size,
    }
    models = [ExpertParallel(cfg.num_hidden_layers, **common)]
    if cfg.num_nextn_predict_layers > 0:
        models.append(
            ExpertParallel(
                cfg.num_nextn_predict_layers,
                first_layer=cfg.num_hidden_layers,
                name="mtp",
                **common,
            )
        )
    return ExpertParallelModels(models)


def ep_barrier(groups: ParallelGroups) -> None:
    """Wait for every EP rank (tests and shutdown)."""
    if groups.ep_group is not None and groups.ep_size > 1:
        dist.barrier(group=groups.ep_group)
