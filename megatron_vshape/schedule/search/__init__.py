"""Choosing the best order: the adaptive search under a memory limit (adaptive.py) and lower
bounds on any schedule's makespan (bounds.py)."""
from .adaptive import InfeasibleMemoryError, SearchResult, frontier, memory_limit_units, search

__all__ = ["InfeasibleMemoryError", "SearchResult", "frontier", "memory_limit_units", "search"]
