"""The one dispatch point for model ops: the model calls ``ops.<name>`` only.

Every op has a plain-torch reference in ``reference.py`` (the specification, CPU-tested);
device kernels register here as they land, each tested against its reference.
"""

from rackserve.ops.reference import (
    apply_rope,
    compress_windows,
    hc_collapse,
    hc_expand,
    hc_weights,
    indexer_scores,
    moe_experts,
    rms_norm,
    rope_cos_sin,
    router_scores,
    sink_attention,
    sinkhorn,
    swiglu,
)

__all__ = [
    "apply_rope",
    "compress_windows",
    "hc_collapse",
    "hc_expand",
    "hc_weights",
    "indexer_scores",
    "moe_experts",
    "rms_norm",
    "rope_cos_sin",
    "router_scores",
    "sink_attention",
    "sinkhorn",
    "swiglu",
]
