"""nanomuon: compact GPT training built around a fused, distributed Muon+AdamW optimizer (see nanomuon/optim.py)."""
