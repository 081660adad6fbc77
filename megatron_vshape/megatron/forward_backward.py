"""The forward-backward function megatron's training loop calls, running a V (or ZB) schedule.

It honours megatron-core's keyword contract (see ``get_forward_backward_func``) and config
hooks: no_sync per chunk, grad_sync_func, grad_scale_func, finalize_model_grads_func,
deallocate_pipeline_outputs, variable_seq_lengths. The schedule comes from the registry, the
execution from the runtime's interpreter; per pipeline group, the stream groups are created once
(collectively, on the first call) and kept by the :class:`VShapeForwardBackward` instance.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..runtime.interpreter import PipelineRunner, RunnerConfig
from ..runtime.p2p import TensorSpec
from ..runtime.profile import PassProfile
from ..runtime.streams import StreamGroups
from ..schedule.registry import SCHEDULES, build_schedule
from .compute import MegatronStages
from .model import sum_tied_embedding_grads

__all__ = ["VShapeForwardBackward"]

log = logging.getLogger(__name__)

TWO_CHUNK = ("v-min", "v-half", "v-zb", "auto")


@dataclass
class VShapeForwardBackward:
    """Callable like megatron's forward_backward functions, for one schedule name."""

    schedule: str
    memory_limit: float | None = None
    """Units of one microbatch's activations of one rank's layer share (auto only)."""
    costs: object = None
    """schedule.Costs for auto (None: uniform)."""
    timeout: float = 600.0
    profile: PassProfile = field(default_factory=PassProfile)
    """Pass durations of the training steps run so far (see runtime/profile.py)."""
    synchronize: bool = False
    """Synchronize the GPU around passes (accurate profiles, slower steps)."""
    _groups: dict = field(default_factory=dict, repr=False)
    _schedules: dict = field(default_factory=dict, repr=False)
    _runners: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {self.schedule!r}; valid choices: "
                             f"{', '.join(SCHEDULES)}")

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                 micro_batch_size, decoder_seq_length=None, forward_only=False,
                 collect_non_loss_data=False, first_val_step=None, adjust_tensor_shapes_fn=None,
                 p2p_communicator=None, pg_collection=None, force_all_reduce=False, **unknown):
        if unknown:
            log.warning("ignoring forward-backward arguments this version does not know: %s",
                        sorted(unknown))
        chunks = model if isinstance(model, list) else [model]
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        config, pg = _config_and_groups(chunks, pg_collection)
        schedule = self._schedule(pg.pp.size(), num_microbatches, len(chunks), len(iterators),
                                  config)
        spec = self._spec(config, pg, seq_length, micro_batch_size, decoder_seq_length,
                          adjust_tensor_shapes_fn)
        stages = MegatronStages(schedule, pg.pp.rank(), chunks, forward_step_func, iterators,
                                config, pg.cp.size(), collect_non_loss_data, first_val_step,
                                forward_only)
        runner = self._runner(schedule, pg, spec, config)
        runner.compute = stages  # this call's model, data and loss; order and buffers are kept
        if not forward_only:
            stages.disable_grad_sync()
        result = runner.step(forward_only=forward_only)
        if not forward_only:
            _finish_grads(stages, chunks, config, pg, force_all_reduce)
            self.profile.add(result.timeline)
        return stages.forward_data_store

    def measured_costs(self, num_microbatches: int, pg_collection=None, comm: float = 0.0):
        """The profiled per-rank F, B, W (seconds) of the steps run so far, as schedule Costs
        (collective over the pipeline group): what ``auto`` re-plans from."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        pg = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        schedule = self._schedules[(pg.pp.size(), num_microbatches)]
        return self.profile.gather_costs(schedule.placement, pg.pp.rank(), comm, group=pg.pp)

    # -- pieces --------------------------------------------------------------------------------
    def _schedule(self, p, m, num_chunks, num_iterators, config):
        two = self.schedule in TWO_CHUNK or self.schedule == "interleaved-1f1b"
        if num_chunks != (2 if two else 1) or num_iterators != num_chunks:
            raise ValueError(
                f"pipeline schedule {self.schedule!r} needs {2 if two else 1} model chunk(s) and as "
                f"many data iterators per rank, got {num_chunks} and {num_iterators}; build the "
                "model with megatron_vshape.megatron.model.build_v_chunks for V schedules")
        if getattr(config, "calculate_per_token_loss", False):
            raise ValueError("calculate_per_token_loss is not supported with V schedules yet "
                             "(the token count lives on rank 0, megatron broadcasts it from the "
                             "last rank); turn it off")
        key = (p, m)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(self.schedule, p, m, costs=self.costs,
                                                  memory_limit=self.memory_limit)
        return self._schedules[key]

    def _runner(self, schedule, pg, spec, config) -> PipelineRunner:
        """One validated runner per (schedule, pipeline, tensor spec), reused across steps."""
        key = (id(schedule), tuple(torch.distributed.get_process_group_ranks(pg.pp)), spec,
               bool(config.deallocate_pipeline_outputs))
        if key not in self._runners:
            self._runners[key] = PipelineRunner(
                schedule, None, self._stream_groups(schedule, pg), spec,
                RunnerConfig(timeout=self.timeout, scale_loss=False,
                             deallocate_outputs=config.deallocate_pipeline_outputs,
                             synchronize=self.synchronize))
        return self._runners[key]

    def _stream_groups(self, schedule, pg):
        key = (tuple(torch.distributed.get_process_group_ranks(pg.pp)), schedule.placement)
        if key not in self._groups:
            self._groups[key] = StreamGroups.create(schedule.placement, _all_pipelines(pg.pp))
        return self._groups[key]

    @staticmethod
    def _spec(config, pg, seq_length, micro_batch_size, decoder_seq_length, adjust):
        from megatron.core.pipeline_parallel.schedules import get_tensor_shapes

        shapes = get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size,
                                   decoder_seq_length=decoder_seq_length, config=config,
                                   tp_group=pg.tp, cp_group=pg.cp)
        if adjust is not None:
            recv, send = adjust(shapes, shapes)
            if recv != send or len(recv) != 1:
                raise ValueError("adjust_tensor_shapes_fn must keep one shape, the same for "
                                 f"sends and receives, under V schedules; got {recv}, {send}")
            shapes = recv
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        return TensorSpec(tuple(shapes[0]), config.pipeline_dtype or torch.float32, device,
                          variable=bool(config.variable_seq_lengths))


def _config_and_groups(chunks, pg_collection):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    pg = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    return config, pg


def _all_pipelines(pp_group):
    """Every pipeline's global ranks (StreamGroups.create is collective over the world)."""
    world = torch.distributed.get_world_size()
    mine = torch.distributed.get_process_group_ranks(pp_group)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    return sorted({tuple(r) for r in gathered})


def _finish_grads(stages, chunks, config, pg, force_all_reduce):
    for c in range(len(chunks)):
        stages.enable_grad_sync(c)
    if config.grad_sync_func is not None:
        funcs = config.grad_sync_func
        for c, chunk in enumerate(chunks):
            (funcs[c] if isinstance(funcs, (list, tuple)) else funcs)(chunk.parameters())
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(chunks, None, pg_collection=pg,
                                         force_all_reduce=force_all_reduce)
    sum_tied_embedding_grads(chunks)
