"""The forward-backward function megatron's training loop calls, running a V (or ZB) schedule.

It honours megatron-core's keyword contract (see ``get_forward_backward_func``) and config
hooks: timers, no_sync per chunk, param_sync_func, grad_sync_func, grad_scale_func,
finalize_model_grads_func (with the token count under calculate_per_token_loss),
deallocate_pipeline_outputs, variable_seq_lengths. The schedule comes from the registry, the
execution from the runtime's interpreter; per pipeline group, the stream groups are created once
(collectively, on the first call) and kept by the :class:`VShapeForwardBackward` instance.

Under a V the loss is computed on pipeline rank 0, where megatron's 1F1B has it on the last
rank. Megatron-LM's training loop and evaluation read the loss dicts on the last rank only, so
``losses_on_last_rank`` relays them there (and returns [] on rank 0), as megatron does, and
with multi-token prediction the step's MTP loss values for training_log (mtp.py).
``auto`` re-plans itself from measured costs after ``replan.after`` iterations (replan.py).
"""
from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field

import torch

from ..runtime.interpreter import PipelineRunner, RunnerConfig
from ..runtime.p2p import TensorSpec
from ..runtime.profile import PassProfile
from ..runtime.streams import StreamGroups
from ..schedule.model.costs import Costs, MemoryModel
from ..schedule.model.limits import MemoryLimit
from ..schedule.registry import VARIANTS, build_schedule
from ..schedule.names import AUTO, MEMORY_LEVELS, V_MIN, schedule_info
from ..schedule.model.simulate import simulate
from ..schedule.rewrite.weight_order import weights_in_backward_order
from .compute import MegatronStages
from .model import sum_tied_embedding_grads
from .mtp import relay_mtp_metrics
from .replan import Replanner
from .te_wgrad import te_wgrad_modules

__all__ = ["VShapeForwardBackward", "message_spec"]

log = logging.getLogger(__name__)

def replans(schedule: str, variant: str = "fastest") -> bool:
    """Whether a schedule is re-planned from measured costs: auto, and the memory levels
    (schedule/search/levels.py) unless their paper order was asked for."""
    info = schedule_info(schedule)
    return info.memory_limited or (info.level and variant == "fastest")


def checked_settings(schedule: str, variant: str, replan_after: int, timeout: float,
                     memory_limit: MemoryLimit | str | None) -> MemoryLimit | None:
    """The one check of a schedule choice's settings (``VShapeConfig`` and
    ``VShapeForwardBackward`` both run it); returns the memory limit parsed."""
    schedule_info(schedule)
    if variant not in VARIANTS:
        raise ValueError(f"unknown schedule variant {variant!r}; valid choices: "
                         f"{', '.join(VARIANTS)}")
    if not timeout > 0:
        raise ValueError(f"the point-to-point timeout must be > 0 seconds, got {timeout}")
    if replan_after < 0:
        raise ValueError(f"replan_after must be >= 0 iterations, got {replan_after}")
    if replan_after and not replans(schedule, variant):
        raise ValueError(f"replan_after re-plans auto and the fastest variant of "
                         f"{', '.join(MEMORY_LEVELS)}; {schedule!r} ({variant}) is a fixed "
                         "order: use replan_after=0")
    if isinstance(memory_limit, str):
        return MemoryLimit.parse(memory_limit, "memory_limit")
    return memory_limit


@dataclass
class VShapeForwardBackward:
    """Callable like megatron's forward_backward functions, for one schedule name."""

    schedule: str
    memory_limit: MemoryLimit | None = None
    """auto: the peak activation memory allowed (a fraction of 1F1B's, or bytes per GPU)."""
    costs: object = None
    """schedule.Costs for auto (None: uniform until re-planned from measurements)."""
    timeout: float = 600.0
    replan_after: int = 0
    """auto and the memory levels (zb-1p, v-min, v-half, v-zb): re-plan from the costs (and
    memory) measured in this many first iterations."""
    variant: str = "fastest"
    """The memory levels: ``fastest`` (re-planned from measured costs) or ``paper`` (fixed)."""
    losses_on_last_rank: bool = False
    """Relay the loss dicts from rank 0 (where the V computes them) to the last pipeline rank
    (where Megatron-LM's training loop reads them)."""
    profile: PassProfile = field(default_factory=PassProfile)
    """Pass durations of the training steps run so far (see runtime/profile.py)."""
    synchronize: bool = False
    """Synchronize the GPU around passes (accurate profiles, slower steps)."""
    emulate: Costs | None = None
    """Emulated device time (runtime/interpreter.py's emulated-cost mode): every compute pass
    lasts at least its time under these costs (per rank, each chunk half of it, or per stage:
    ``Costs.for_stages``, as the demo's stage layouts use). Processes sharing a few CPU
    cores then behave like one device each, so step times measure the schedule (comparable with
    ``simulate(schedule, emulate).makespan``) instead of Python and messaging overhead."""
    stream_groups: dict = field(default_factory=dict, repr=False)
    """The point-to-point groups, by (pipeline's global ranks, placement), created collectively
    on first use. Instances that run one after the other (the same model under several
    schedules, as the demo does) may share one dict: each gloo group keeps a thread that wakes
    every 10 ms, so groups made per instance slow every later step down."""
    last_step: object = field(default=None, repr=False)
    """The runtime's StepResult of the latest call (timeline, seconds)."""
    replanner: Replanner = field(default=None, repr=False)
    plans: list = field(default_factory=list, repr=False)
    """Every schedule built, in order: (training iterations before it, its description)."""
    last_schedule: object = field(default=None, repr=False)
    """The schedule of the latest call."""
    _relearn_ddp: bool = field(default=False, repr=False)
    _schedules: dict = field(default_factory=dict, repr=False)
    _runners: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.memory_limit = checked_settings(self.schedule, self.variant, self.replan_after,
                                             self.timeout, self.memory_limit)
        if self.emulate is not None and not isinstance(self.emulate, Costs):
            raise ValueError(f"emulate must be schedule Costs (F, B, W seconds per rank) or "
                             f"None, got {self.emulate!r}")
        if self.replanner is None:
            self.replanner = Replanner(self.replan_after, self.memory_limit)

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
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(
                barrier=getattr(config, "barrier_with_L1_time", False))
        schedule = self.schedule_for(pg.pp.size(), num_microbatches, len(chunks), len(iterators),
                                  config, fifo_weights=any(te_wgrad_modules(c) for c in chunks))
        spec = message_spec(config, pg, seq_length, micro_batch_size, decoder_seq_length,
                            adjust_tensor_shapes_fn, _device())
        stages = MegatronStages(schedule, pg.pp.rank(), chunks, forward_step_func, iterators,
                                config, pg.cp.size(), collect_non_loss_data, first_val_step,
                                forward_only)
        if self._relearn_ddp and not forward_only:
            _relearn_grad_ready_counts(chunks)
            self._relearn_ddp = False
        profiling = self.replanner.profiling and not forward_only
        runner = self._runner(schedule, pg, spec, config, profiling)
        runner.compute = stages  # this call's model, data and loss; order and buffers are kept
        tracker = self.replanner.start_step([p for c in chunks for p in c.parameters()]) \
            if profiling else None
        if not forward_only:
            stages.start_param_sync()
            stages.disable_grad_sync()
        with stages.tracking(tracker):
            runner.tracker = tracker
            self.last_step = runner.step(forward_only=forward_only)
            runner.tracker = None
        loss_rank = _loss_rank(schedule)
        if not forward_only:
            _finish_grads(stages, chunks, config, pg, force_all_reduce, loss_rank)
            self.profile.add(self.last_step.timeline)
            if self.replanner.end_step(schedule, pg.pp.rank(), self.last_step.pass_bytes):
                self._replan(schedule, pg, spec)
        if config.timers is not None:
            config.timers("forward-backward").stop()
        if self.losses_on_last_rank and not forward_only and getattr(config, "mtp_num_layers",
                                                                     None):
            relay_mtp_metrics(pg.pp, loss_rank, pg.pp.size() - 1, _device())
        if self.losses_on_last_rank:
            return _relay_to_last_rank(stages.forward_data_store, pg.pp, loss_rank)
        return stages.forward_data_store

    def measured_costs(self, num_microbatches: int, pg_collection=None, comm: float = 0.0):
        """The profiled F, B, W (seconds) of every pipeline stage over the steps run so far, as
        per-stage schedule Costs (``Costs.for_stages``: each stage's own pass times, the
        per-rank fields their sums, the uniform form where every stage costs the same;
        collective over the pipeline group): what ``auto``
        re-plans from, so a rank whose stages hold more (rank 0's LM head under a V) weighs
        as much as it costs."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        pg = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        schedule = self._schedules[(pg.pp.size(), num_microbatches)]
        return self.profile.gather_costs(schedule.placement, pg.pp.rank(), comm, group=pg.pp)

    # -- pieces --------------------------------------------------------------------------------
    def schedule_for(self, p, m, num_chunks, num_iterators, config, fifo_weights=False):
        """The schedule this function runs for ``p`` ranks and ``m`` microbatches (built once,
        then reused), after checking the model's chunks and data iterators fit it: the check
        runs before any pass, so a wrong model build fails with what to change.
        ``fifo_weights``: the model has Transformer Engine layers whose W passes must follow
        their stage's B order (weights_in_backward_order)."""
        chunks = schedule_info(self.schedule).chunks
        if num_chunks != chunks or num_iterators != num_chunks:
            raise ValueError(
                f"pipeline schedule {self.schedule!r} needs {chunks} model chunk(s) and as "
                f"many data iterators per rank, got {num_chunks} and {num_iterators}; build the "
                "model with megatron_vshape.megatron.model.build_v_chunks for V schedules")
        key = (p, m)
        if key not in self._schedules:
            built = self._build(p, m)
            self._schedules[key] = weights_in_backward_order(built) if fifo_weights else built
            self.plans.append((self.replanner.steps, self._schedules[key].description))
            _log_schedule(self._schedules[key], self.costs, self.memory_limit,
                          self.replanner.memory or MemoryModel())
        self.last_schedule = self._schedules[key]
        return self.last_schedule

    def _build(self, p, m):
        """The schedule for (p, m); ``auto`` under a byte limit starts as V-Min (the smallest
        memory) until the profiled iterations have measured the bytes of a unit."""
        memory = self.replanner.memory or MemoryModel()
        if not schedule_info(self.schedule).memory_limited:
            return build_schedule(self.schedule, p, m, costs=self.costs, variant=self.variant,
                                  memory=memory)
        if self.memory_limit is not None and self.memory_limit.needs_activation_bytes and \
                self.replanner.activation_bytes is None:
            return build_schedule(V_MIN, p, m)
        return build_schedule(self.schedule, p, m, costs=self.costs,
                              memory_limit=self.replanner.limit_units(p, m), memory=memory)

    def _replan(self, schedule, pg, spec) -> None:
        """Re-plan from what the profiled iterations measured (same on every rank)."""
        groups = self._stream_groups(schedule, pg)
        costs = self.replanner.measured(self.profile, schedule, pg.pp.rank(), pg.pp, groups,
                                        spec)
        if costs is None:  # not times (logged): keep what runs, on every rank alike
            return
        self.costs = costs
        self._schedules.clear()
        self._runners.clear()
        self._relearn_ddp = True
        memory = self.replanner.memory
        log.info("[vshape] re-planning %s from measured costs F,B,W,COMM=%s%s%s", self.schedule,
                 self.costs.as_list(), "" if self.replanner.activation_bytes is None else
                 f" and {self.replanner.activation_bytes:.4g} bytes per unit",
                 "" if memory is None else
                 f"; B leaves {-memory.weight:.3g} of a chunk's activations for W")

    def _runner(self, schedule, pg, spec, config, profiling=False) -> PipelineRunner:
        """One validated runner per (schedule, pipeline, tensor spec, sync and emulation
        settings), reused across steps."""
        synchronize = self.synchronize or (profiling and torch.cuda.is_available())
        key = (id(schedule), tuple(torch.distributed.get_process_group_ranks(pg.pp)), spec,
               bool(config.deallocate_pipeline_outputs), synchronize, self.emulate)
        if key not in self._runners:
            self._runners[key] = PipelineRunner(
                schedule, None, self._stream_groups(schedule, pg), spec,
                RunnerConfig(timeout=self.timeout, scale_loss=False,
                             deallocate_outputs=config.deallocate_pipeline_outputs,
                             synchronize=synchronize, emulate=self.emulate))
        return self._runners[key]

    def _stream_groups(self, schedule, pg):
        key = (tuple(torch.distributed.get_process_group_ranks(pg.pp)), schedule.placement)
        if key not in self.stream_groups:
            self.stream_groups[key] = StreamGroups.create(schedule.placement,
                                                          _all_pipelines(pg.pp))
        return self.stream_groups[key]


def message_spec(config, pg, seq_length, micro_batch_size, decoder_seq_length, adjust,
                 device) -> TensorSpec:
    """What one pipeline message is (megatron's own shape rule, ``adjust_tensor_shapes_fn``
    applied), on ``device``. Ranks sharing a GPU over gloo get ``wire = "cpu"``: NCCL refuses
    two ranks on one GPU and gloo cannot send CUDA tensors, so messages go through host memory.

    With ``variable_seq_lengths`` each message carries its shape (``TensorSpec.variable``) and
    the spec's shape is the largest message, ``seq_length`` long (what re-planning measures a
    hop with). megatron-core 0.19 on answers ``[()]`` for variable lengths (no fixed shape), so
    the shape comes from its rule for fixed lengths, asked through a view of the three fields
    it reads; 0.16 to 0.18 ignore the setting and give that shape already."""
    from megatron.core.pipeline_parallel.schedules import get_tensor_shapes

    shapes = get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size,
                               decoder_seq_length=decoder_seq_length,
                               config=_fixed_lengths(config), tp_group=pg.tp, cp_group=pg.cp)
    if adjust is not None:
        recv, send = adjust(shapes, shapes)
        if recv != send or len(recv) != 1:
            raise ValueError("adjust_tensor_shapes_fn must keep one shape, the same for "
                             f"sends and receives, under V schedules; got {recv}, {send}")
        shapes = recv
    staged = device != "cpu" and torch.distributed.get_backend(pg.pp) == "gloo"
    return TensorSpec(tuple(shapes[0]), config.pipeline_dtype or torch.float32, device,
                      variable=bool(config.variable_seq_lengths),
                      wire="cpu" if staged else None)


def _fixed_lengths(config):
    """``config`` as get_tensor_shapes sees it for fixed sequence lengths (the caller's config
    is left as it is): the fields it reads (schedules.py get_tensor_shapes, 0.16 to 0.20)."""
    if not config.variable_seq_lengths:
        return config
    return types.SimpleNamespace(variable_seq_lengths=False, hidden_size=config.hidden_size,
                                 sequence_parallel=config.sequence_parallel)


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


def _loss_rank(schedule) -> int:
    """The pipeline rank that computes the loss: the one holding the last stage (rank 0 under
    a V, the last rank for zb-1p)."""
    return schedule.placement.rank_of(schedule.placement.num_stages - 1)


def _finish_grads(stages, chunks, config, pg, force_all_reduce, loss_rank):
    for c in range(len(chunks)):
        stages.launch_grad_sync(c)  # the chunks whose reduction has not started yet
    if config.finalize_model_grads_func is not None:
        num_tokens = None
        if config.calculate_per_token_loss:
            # megatron broadcasts the count from the last rank; the loss rank counted it
            num_tokens = stages.total_num_tokens.to(_device())
            torch.distributed.broadcast(num_tokens, src=_pp_global_rank(pg.pp, loss_rank),
                                        group=pg.pp)
        config.finalize_model_grads_func(chunks, num_tokens, pg_collection=pg,
                                         force_all_reduce=force_all_reduce)
    sum_tied_embedding_grads(chunks)


def _relearn_grad_ready_counts(chunks) -> None:
    """Make megatron's DDP learn its gradient-ready counts again after a schedule change.

    With overlap_grad_reduce, DDP records in the first iteration how often each weight's hook
    fires once no_sync is left (under a V, several W passes can follow a chunk's last B) and
    launches a bucket's reduction when later iterations reach those counts; a new schedule has
    other counts, so the bucket groups go back to their first-iteration mode.
    """
    for chunk in chunks:
        for group in (getattr(chunk, "bucket_groups", []) +
                      getattr(chunk, "expert_parallel_bucket_groups", [])):
            group.is_first_batch = True
            group.golden_per_param_grad_ready_counts = {}


def _device():
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def _pp_global_rank(pp_group, pipeline_rank: int) -> int:
    return torch.distributed.get_process_group_ranks(pp_group)[pipeline_rank]


def _relay_to_last_rank(store: list, pp_group, loss_rank: int) -> list:
    """Move the loss dicts from ``loss_rank`` to the last pipeline rank (collective on those
    two; nothing to do when the loss already is on the last rank, as under zb-1p)."""
    rank, last = pp_group.rank(), pp_group.size() - 1
    if loss_rank == last:
        return store
    if rank == loss_rank:
        torch.distributed.send_object_list([_map_tensors(store, lambda t: t.detach().cpu())],
                                           _pp_global_rank(pp_group, last), group=pp_group)
        return []
    if rank == last:
        box = [None]
        torch.distributed.recv_object_list(box, _pp_global_rank(pp_group, loss_rank),
                                           group=pp_group)
        return _map_tensors(box[0], lambda t: t.to(_device()))
    return store


def _map_tensors(value, fn):
    """``value`` (loss dicts: nested dicts, lists, tuples) with ``fn`` applied to its tensors."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _log_schedule(schedule, costs, limit, memory) -> None:
    """One line per schedule built (``vshape collect`` parses it from training logs); the peak
    under the memory model the schedule was planned with (measured once re-planned)."""
    result = simulate(schedule, costs, memory)
    log.info("[vshape] schedule=%s ranks=%d microbatches=%d peak_memory_vs_1f1b=%.4f "
             "bubble_rate=%.4f memory_limit=%s description=%s", schedule.name, schedule.ranks,
             schedule.microbatches, result.peak_memory_vs_1f1b, result.bubble_rate,
             limit if limit is not None else "none", schedule.description)
