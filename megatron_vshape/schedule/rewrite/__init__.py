"""Rewrites of a finished order: each takes per-rank orders and gives back new ones with the same
passes, each stage's microbatches in order (so they lower like their input). replay (an order
as a priority, re-timed with real costs under a memory limit), reshape_ends (warm-up and
cool-down re-laid in the paper code's shapes), gap_fill (unit-slot bubbles filled), weight_deferral
(W passes moved to where their rank would wait), critical_path_cooldown (the cool-down
re-scheduled critical path first). The search (search/) decides which to apply and keeps a
result only where it is faster: docs/design.md. weight_order (each stage's W passes relabelled
into its B order, for Transformer Engine's queue) is applied by the megatron glue, not the
search. Imports model/ and construct/."""
