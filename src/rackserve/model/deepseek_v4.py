"""DeepSeek-V4, top to bottom, over a flat batch and paged caches.

Shape legend: T tokens in the flat batch, N mHC streams, D hidden, V vocabulary.

    tokens -> embed [T, D] -> N identical streams [T, N, D]
      per layer:  streams -> mHC(attn) -> attention -> mHC(ffn) -> MoE -> streams
    -> hyper head [T, D] -> norm -> head -> logits [T, V]

Parameter names are the checkpoint's (``model.layers.{i}.attn.wq_a.weight``, ...), so
``load_state_dict`` on a checkpoint written by transformers' ``save_pretrained`` needs no
renaming (see ``loader.py`` for the other spellings accepted).
"""

from __future__ import annotations

import torch
from torch import nn

from rackserve import ops
from rackserve.config import SLIDING, ModelConfig
from rackserve.model.attention import Attention
from rackserve.model.batch import KVCacheTensors, StepMetadata
from rackserve.model.layers import (
    FP32_PARAM_SUFFIXES,
    HyperHead,
    RMSNorm,
    Rotary,
    hc_params,
    is_plain_linear,
    linear,
)
from rackserve.model.moe import MoE
from rackserve.moe.ep import ExpertParallel

# the input of a block as mHC prepares it: (x [T, D], post [T, N], comb [T, N, N])
HcInput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        kind: str,
        hashed: bool,
        rotary: Rotary,
        kernels: ops.Kernels,
        expert_parallel: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.kernels = cfg, kernels
        self.attn = Attention(cfg, layer_id, kind, rotary, kernels)
        self.ffn = MoE(cfg, hashed, kernels, layer_id, expert_parallel)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = hc_params(cfg)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = hc_params(cfg)

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        meta: StepMetadata,
        caches: KVCacheTensors,
        expert_counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # streams: [T, N, D] -> [T, N, D]; each sub-layer: mHC weights + collapse + norm,
        # the block, then mix the block output back into the streams.
        streams, _ = self.run(streams, input_ids, meta, caches, expert_counts)
        return streams

    def attn_pre(self, streams: torch.Tensor) -> HcInput:
        """``hc_pre`` of the attention: (x [T, D], post [T, N], comb [T, N, N])."""
        c = self.cfg
        return self.kernels.hc_pre(
            streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
            self.attn_norm.weight, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
        )  # fmt: skip

    def run(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        meta: StepMetadata,
        caches: KVCacheTensors,
        expert_counts: torch.Tensor | None = None,
        attn_in: HcInput | None = None,
        next_layer: DecoderLayer | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, HcInput | None]:
        """The layer, with the mHC of its neighbours fused in: ``attn_in`` is this layer's
        attention input when the previous layer computed it (else ``hc_pre`` runs here);
        with ``next_layer`` the FFN's post runs fused with that layer's attention pre
        (one ``hc_post_pre``), whose result is returned for it. ``rope``: the cos/sin of
        this step's positions for this layer's rotary (computed here when None).
        Returns (streams [T, N, D], the next layer's input or None)."""
        c, k = self.cfg, self.kernels
        hc = (c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        x, post, comb = self.attn_pre(streams) if attn_in is None else attn_in
        block_out = self.attn(x, meta, caches, rope)
        streams, x, post, comb = k.hc_post_pre(  # the attention's post + the FFN's pre
            streams, block_out, post, comb,
            self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.ffn_norm.weight, *hc,
        )  # fmt: skip
        # the experts' slots unsummed on the fast path: the mHC post below sums them
        x = self.ffn(x, input_ids, expert_counts, meta.token_mask, defer_sum=True)
        if next_layer is None:
            return k.hc_post(streams, x, post, comb), None
        n = next_layer
        streams, *next_in = k.hc_post_pre(  # the FFN's post + the next attention's pre
            streams, x, post, comb, n.hc_attn_fn, n.hc_attn_base, n.hc_attn_scale,
            n.attn_norm.weight, *hc,
        )  # fmt: skip
        return streams, tuple(next_in)


class MTPLayer(nn.Module):
    """One multi-token-prediction layer (DeepSeek-V3 pattern, carried to mHC streams).

    Predicts token t+2 from the main model's final streams at t and the embedding of token
    t+1: streams = eh_proj([enorm(embed(x_{t+1})) ; hnorm(h_t)]) per stream, then a sliding
    attention + routed MoE block, its own hyper head and norm; embeddings and ``head`` are
    shared with the main model. Checkpoint names: ``mtp.{k}.enorm``, ``hnorm``,
    ``eh_proj``, the decoder-layer names, ``norm``, ``hc_head_{fn,base,scale}``.
    Its cache layer id is ``num_hidden_layers + k`` (sliding-window group only).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        k: int,
        rotary: Rotary,
        kernels: ops.Kernels,
        expert_parallel: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        layer_id = cfg.num_hidden_layers + k
        self.block = DecoderLayer(cfg, layer_id, SLIDING, False, rotary, kernels, expert_parallel)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg, kernels)


class DeepseekV4Model(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        kernels: ops.Kernels,
        expert_parallel: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.kernels = cfg, kernels
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rope_dim = cfg.qk_rope_head_dim
        self.rotary_main = Rotary(cfg.rope_main, rope_dim, kernels)
        self.rotary_compress = Rotary(cfg.rope_compress, rope_dim, kernels)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg,
                i,
                kind,
                cfg.mlp_layer_types[i] == "hash_moe",
                self.rotary_main if kind == SLIDING else self.rotary_compress,
                kernels,
                expert_parallel,
            )
            for i, kind in enumerate(cfg.layer_types)
        )
        self.hc_head = HyperHead(cfg, kernels)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: StepMetadata,
        caches: KVCacheTensors,
        expert_counts: torch.Tensor | None = None,
        head_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids: [T] -> (normed hidden [T, D], final streams [T, N, D]).

        expert_counts: optional [num_layers, E] accumulator of routed tokens per expert.
        head_rows: optional [S] rows of the hidden states wanted (the rows that need
        logits): the hyper head (which reads all N streams) and the norm run on those only
        and hidden is [S, D]; the streams stay whole.
        """
        # the streams start as copies of each token's embedding
        streams = self.kernels.embed_streams(input_ids, self.embed_tokens.weight, self.cfg.hc_mult)
        # cos/sin once per step for each rotary (the layers share two), not once per layer
        rope: dict[Rotary, tuple[torch.Tensor, torch.Tensor]] = {}
        for rotary in (self.rotary_main, self.rotary_compress):
            if any(layer.attn.rotary is rotary for layer in self.layers):
                rope[rotary] = rotary(meta.positions, streams.dtype)
        # the first layer's attention input here: each layer then runs its own attention
        # and FFN and the next layer's mHC pre (fused with its FFN's post)
        layers = list(self.layers)
        attn_in = None
        if layers:
            attn_in = layers[0].attn_pre(streams)
        for i, layer in enumerate(layers):
            counts = None if expert_counts is None else expert_counts[i]
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            streams, attn_in = layer.run(
                streams, input_ids, meta, caches, counts, attn_in, nxt, rope[layer.attn.rotary]
            )
        hidden = self.hc_head(streams, self.norm, head_rows)
        return hidden, streams


class DeepseekV4ForCausalLM(nn.Module):
    """The causal LM. ``kernels`` picks the op implementations once (see ``rackserve.ops``):
    "auto" runs the fast ones on a GPU and the references on the CPU. ``expert_parallel``:
    this rank's share of the decoder layers' routed experts (``moe/ep.py``), None for one
    rank; ``mtp_expert_parallel``: the MTP layers' (their own EP model, balanced apart,
    first layer ``num_hidden_layers``; None: every MTP expert on every rank)."""

    def __init__(
        self,
        cfg: ModelConfig,
        with_mtp: bool = True,
        kernels: str = "auto",
        expert_parallel: ExpertParallel | None = None,
        mtp_expert_parallel: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.kernels = ops.kernels(kernels)
        self.model = DeepseekV4Model(cfg, self.kernels, expert_parallel)
        if expert_parallel is not None:
            expert_parallel.bind([layer.ffn for layer in self.model.layers])
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        num_mtp = cfg.num_nextn_predict_layers if with_mtp else 0
        self.mtp = nn.ModuleList(
            MTPLayer(cfg, k, self.model.rotary_main, self.kernels, mtp_expert_parallel)
            for k in range(num_mtp)
        )
        if mtp_expert_parallel is not None and num_mtp:
            mtp_expert_parallel.bind([layer.block.ffn for layer in self.mtp])

    @property
    def has_mtp(self) -> bool:
        return len(self.mtp) > 0

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: StepMetadata,
        caches: KVCacheTensors,
        expert_counts: torch.Tensor | None = None,
        head_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden [T, D] (or of ``head_rows`` only), final streams [T, N, D]);
        logits via ``compute_logits``."""
        return self.model(input_ids, meta, caches, expert_counts, head_rows)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [S, D] (only the rows that need logits) -> [S, V] float32, into ``out``
        when given (the decode graphs' one logits buffer)."""
        if is_plain_linear(self.head):
            return self.kernels.logits(hidden, self.head.weight, out)
        y = linear(self.kernels, self.head, hidden).float()  # a quantized head
        return y if out is None else out.copy_(y)

    def mtp_forward(
        self,
        k: int,
        next_ids: torch.Tensor,
        streams: torch.Tensor,
        meta: StepMetadata,
        caches: KVCacheTensors,
        head_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer k. next_ids: [T] (token t+1); streams: [T, N, D] at t; ``meta``
        positions are those of the next tokens. Returns (hidden [T, D], streams);
        ``head_rows``: as the model's (hidden of those rows only)."""
        layer = self.mtp[k]
        e = layer.enorm(self.model.embed_tokens(next_ids))  # [T, D]
        h = layer.hnorm(streams)  # [T, N, D]
        x = layer.eh_proj(torch.cat([e.unsqueeze(1).expand_as(h), h], dim=-1))
        x = layer.block(x, next_ids, meta, caches)
        return layer.hc_head(x, layer.norm, head_rows), x

    def cast(self, dtype: torch.dtype) -> DeepseekV4ForCausalLM:
        """Cast to ``dtype``, with the reference's float32 parameters in float32 and
        quantized weights (float8) as they are; then (fast path) fuse the weights, so that
        loading a checkpoint afterwards copies into the fused tensors and no forward has to
        build them."""
        for name, param in self.named_parameters():
            stored = param.element_size() == 1  # quantized weights (model/quant.py) stay
            if not param.is_floating_point() or stored:
                continue
            target = torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else dtype
            if param.dtype != target:  # (made in the model dtype: loader.parameters_made_in)
                param.data = param.data.to(target)
        return self.fuse_weights()

    def fuse_weights(self) -> DeepseekV4ForCausalLM:
        """Build every fused weight of the fast path now (one GEMM for the projections of
        a layer input, the shared expert as one more expert): parameters become views, so
        checkpoint names and loading are unchanged. A no-op on the reference path; a
        forward fuses again by itself when parameters were replaced since (``.to()``)."""
        for module in self.modules():
            if isinstance(module, (Attention, MoE)):
                module.fuse_weights()
        return self
