"""The router in front of engines: P/D two-step (app.py), forwarding to an engine and relaying
its response (relay.py), policies (policies.py), the KV index fed by engine KV events or its
own record (kv_index.py), engine health (engines.py)."""
