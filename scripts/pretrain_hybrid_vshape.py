"""Megatron-LM's pretrain_hybrid (megatron-core's HybridModel, ``--hybrid-layer-pattern``) with
the megatron-vshape schedules (the 0.19-era training code with megatron-core 0.19.2).

    torchrun --nproc-per-node 8 scripts/pretrain_hybrid_vshape.py <pretrain_hybrid flags> \\
        --pipeline-schedule v-half

Run it like pretrain_hybrid.py, with Megatron-LM on PYTHONPATH; everything but the model is
scripts/pretrain_gpt_vshape.py's (``run``: the plugin's flags, the V's model provider, batch
and forward step). Under a V the pattern is read on the V's 2 x PP stages in V order: its
``|`` segments (2 x PP of them) or, without ``|``, an even split (megatron_vshape/megatron/
hybrid.py); attention (``*``), MLP (``-``) and MoE (``E``) layers only. 1f1b, interleaved-1f1b
and zb-1p keep megatron's own placement of the pattern. docs/training.md, "Hybrid models".
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # pretrain_gpt_vshape


def main() -> None:
    try:
        import pretrain_hybrid
        from hybrid_builders import hybrid_builder
    except ImportError as err:
        raise SystemExit(f"pretrain_hybrid_vshape.py needs Megatron-LM's training code of the "
                         f"megatron-core 0.19 era (pretrain_hybrid.py, hybrid_builders.py) on "
                         f"PYTHONPATH: export PYTHONPATH=$MEGATRON_LM:$PYTHONPATH ({err})")
    from megatron.training import get_args
    from pretrain_gpt_vshape import run

    from megatron_vshape.megatron.hybrid import v_hybrid_builder

    run(pretrain_hybrid, hybrid_builder, None,
        v_builder=lambda builder: v_hybrid_builder(
            builder, lambda: get_args().pipeline_model_parallel_size))


if __name__ == "__main__":
    main()
