"""Quotas, model groups, priorities and admission (issue 11; seeds 001 and 003): limits (limits.py), the buckets
that enforce them (buckets.py)."""
