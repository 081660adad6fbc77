"""transformer_engine.pytorch.router: the fused MoE router kernels (TE v2.11 router.py).
megatron-core 0.16.1 imports these three names whenever TE >= 2.7 is installed
(extensions/transformer_engine.py:2488-2493, not inside a try) and calls them only with
--moe-router-fusion; the stand-in has the names and refuses the call."""


def _refuse(*args, **kwargs):
    raise NotImplementedError("the CPU stand-in of Transformer Engine does not imitate the fused "
                              "MoE router kernels (--moe-router-fusion)")


fused_topk_with_score_function = fused_compute_score_for_moe_aux_loss = fused_moe_aux_loss = \
    _refuse
