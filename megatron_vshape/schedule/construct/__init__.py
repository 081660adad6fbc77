"""Constructions: per-rank orders made from nothing but the setting. The paper's building blocks
repeated and squeezed (blocks, compose with its reorder variants cooldown_reorder,
list_scheduler and zbv; family; named), blocks built in real time (periodic), and orders made
in simulated time with the costs (greedy, wave) or pass by pass in slots (slot_reorder).
Where each is used: docs/design.md. Imports only model/."""
