"""Prefill/decode disaggregation: a prefill engine's request KV pulled into blocks a decode
engine allocated (connector.py), over a named transport (transports.py: tcp, shm, nccl, nixl)
with a small control protocol (wire.py) and the prefill side's leased copies (store.py)."""
