"""Speculative decoding: drafters (the target's MTP layer, or a draft model) propose K tokens
per request; the target verifies 1 + K positions in one forward and keeps the longest run
that is exactly what it would have produced (``verify.py``); ``proposer.py`` drafts.

The scheduler reserves K lookahead positions and grants 1 + K tokens to a request with
drafts; the runner verifies, emits 1 .. K + 1 tokens and proposes the next drafts; the
scheduler counts back the rejected tokens before it commits, so the KV manager (and the
prefix cache's hashes) only ever see verified tokens. Acceptance counters:
``stats.SpecDecodingStats``.
"""
