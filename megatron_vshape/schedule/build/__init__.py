"""How orders are made: the paper's building blocks repeated and squeezed (blocks, family,
compose, cooldown, named), the list schedulers that time them (list_scheduler, periodic,
zbv, timed, greedy, wave), and rewrites of a finished order (slot_reorder, shapes, wfill).
Imports only model/."""
