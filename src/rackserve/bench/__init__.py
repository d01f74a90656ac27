"""Client-side benchmarks against any OpenAI-compatible server.

``workloads`` (seeded agent sessions), ``client`` (streaming load client, request timelines),
``metrics`` (pure functions of timelines), ``report`` (JSON, table, plots), ``agentic`` and
``serve`` (the two runners), ``cli`` (``rackserve bench ...``). See docs/bench.md.
"""
