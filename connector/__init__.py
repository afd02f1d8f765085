"""kvfill.connector: the DCP-aware block planner and (coming) the vLLM connector.

``planner`` is pure Python; ``specs`` adapts vLLM's KV cache specs to it.
"""
