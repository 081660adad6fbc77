"""What a schedule is: actions and placements, the per-rank orders, pass costs, dependencies, the
simulator that times an order, the lowering to runtime actions, memory limits and the validator.
Imports nothing from construct/, rewrite/, search/ or io/ (but io's step renderer for error
messages)."""
