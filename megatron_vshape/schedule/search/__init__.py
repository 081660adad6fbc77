"""Choosing the best order: the adaptive search under a memory limit (adaptive.py's step table,
running constructions.py's candidates and improvements.py's steps over a pool.py pool, sized by
settings.py), the local search over per-rank orders (local.py), the named schedules as memory
levels (levels.py), and lower bounds on any schedule's makespan (bounds.py)."""
from .adaptive import InfeasibleMemoryError, SearchResult, frontier, memory_limit_units, search

__all__ = ["InfeasibleMemoryError", "SearchResult", "frontier", "memory_limit_units", "search"]
