"""Quotas, model groups, priorities and admission (after "LLM-Load-Balancer" and "Why I Built a Priority Queue for
Ollama"): limits (limits.py), the buckets that enforce them (buckets.py)."""
