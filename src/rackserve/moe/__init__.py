"""Expert parallelism: placement, load statistics, dispatch/combine, weight rearrangement.

The EPLB policy (a pure algorithm) lives in ``moe.eplb``.
"""
