"""Speculative decoding: drafters (the target's MTP layer, or a draft model) propose K tokens
per request; the target verifies 1 + K positions in one forward: greedy requests keep the
longest run equal to the target's argmax, random requests the standard rejection rule on
drafts sampled from the draft's distribution (``verify.py``); ``drafters.py`` drafts (on
``proposer.py``'s base and step), ``graphs.py`` captures the verify step and the draft
model's chain as CUDA graphs, ``checkpoint.py`` checks the configuration against the
checkpoints.

The scheduler reserves K lookahead positions and grants 1 + K tokens to a request with
drafts; the runner verifies, emits 1 .. K + 1 tokens and proposes the next drafts; the
scheduler counts back the rejected tokens before it commits, so the KV manager (and the
prefix cache's hashes) only ever see verified tokens. Acceptance counters:
``stats.SpecDecodingStats``.
"""
