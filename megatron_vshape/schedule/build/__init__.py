"""How orders are made: the paper's building blocks repeated and squeezed (blocks, family,
compose, cooldown, named), and the list schedulers that time them (list_scheduler, periodic,
zbv, timed). Imports only model/."""
