"""Workloads, their replay against running balancers, and what a replay measured."""
