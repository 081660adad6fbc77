"""CPU patches of Megatron-LM's training code, for the real-loop test tiers only.

``tests/megatron/test_megatron_lm_e2e.py`` (tag core_v0.16.1) and ``tests/megatron/test_megatron_lm_019.py`` (the
0.19-era code) run ``scripts/pretrain_gpt_vshape.py`` -- Megatron-LM's own ``pretrain()`` loop
-- on gloo processes without a GPU. Megatron-LM assumes CUDA in about a dozen places; each
patch below names the line (../shared/megatron-lm, tag core_v0.16.1, with ``core/`` the pip
megatron-core 0.16.1; "0.19:" ../shared/megatron-lm-0.19 with megatron-core 0.19.2) and what
it changes. The same patches serve both: each is applied by the name it replaces. None changes
what is computed: they move device bookkeeping to the CPU, skip GPU-only compilation, and keep
RNG state objects that the CPU has no equivalent of. The megatron-core shims the CPU tests and the demo share live in
``megatron_vshape/harness/cpu.py`` and are applied first.

Nothing in the plugin imports this module: it is applied from outside, by the test launcher
(``support.megatron_lm_launch``) or, for a plain ``torchrun``, by ``support/mlm_site``'s
``sitecustomize``, exactly as a user's GPU-less checkout would have to be patched.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import types

import torch

__all__ = ["install_megatron_lm_cpu_patches", "install_moe_cpu_patches", "configure_run",
           "use_fused_adam", "CpuFusedAdam", "TORCH_ADAMW", "TE_STAND_IN", "TE_STAND_IN_PATH",
           "install_first_microbatch_probe", "WITHHOLD_FIRST_MICROBATCH", "FIRST_MICROBATCH_LOG"]

TE_STAND_IN = "VSHAPE_TE_STAND_IN"
"""Set to 1 in the environment of a process (a launch server, a torchrun) whose Megatron-LM
runs should see Transformer Engine: support/te_stand_in's CPU stand-in is put first on sys.path
before megatron is imported (:func:`install_megatron_lm_cpu_patches`). Read once, at import
time of megatron: megatron decides HAVE_TE when its modules are imported, so one process either
has TE or has not (support.megatron_lm_launch.Launcher(te_stand_in=True) starts its own server)."""
TE_STAND_IN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "te_stand_in")
"""The folder that holds the stand-in package ``transformer_engine``."""


class _NoStream:
    """torch.cuda.Stream stand-in: the CPU runs everything in order."""

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args, **kwargs) -> "_NoStream":
        """The alltoall dispatcher's device-to-host stream (core/transformer/moe/
        token_dispatcher.py:445 makes it with torch.cuda.Stream) records an event at :895 and
        :899 synchronizes on it (0.19.2: :469, :946/:950): the CPU has done the copy already."""
        return self


@contextlib.contextmanager
def _one_fake_device():
    """torch.cuda.device_count() == 1 and set_device a no-op, for the duration of a call."""
    count, set_device = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = count, set_device


def _with_one_fake_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _one_fake_device():
            return fn(*args, **kwargs)
    return wrapper


def _cuda_type_names(original):
    """Tensor.type() without arguments as on a GPU ('torch.cuda.FloatTensor')."""
    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
    return type_


def _forked_results_queue(module):
    def get_write_results_queue(*args, **kwargs):
        import multiprocessing

        if module._results_queue is None:
            module._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        return module._results_queue
    return get_write_results_queue


def _stand_in_batch_invariant_kernels() -> None:
    """initialize.py:25 imports core/transformer/custom_layers/batch_invariant_kernels.py, which
    imports triton (GPU only, absent from CPU torch). A stand-in module takes its place; a fake
    ``triton`` would stay importable and mislead torch's inductor, which probes for it (0.19:
    initialize.py:26 imports it too; megatron-core 0.19 needs the triton stand-in anyway,
    :func:`_let_megatron_import`, and this module still takes the kernels' place).

    Not from megatron-core main (0.20) on: megatron.core itself imports more of its names
    (core/tensor_parallel/inference_layers.py:28, core/inference/moe/batch_invariant.py:14),
    and the real module imports under the triton stand-in (it falls back to stand-ins of its
    own where triton's pieces are missing, batch_invariant_kernels.py:17-28)."""
    if _megatron_core_minor() >= 20:
        return
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"

    def refuse(*args, **kwargs):
        raise RuntimeError("--batch-invariant-mode needs triton kernels (GPU); not on CPU")

    module = types.ModuleType(name)
    module.enable_batch_invariant_mode = module.disable_batch_invariant_mode = refuse
    module.set_batch_invariant_mode = refuse
    module.is_batch_invariant_mode_enabled = lambda: False
    sys.modules.setdefault(name, module)


def _patch_torch() -> None:
    """CUDA calls of Megatron-LM and megatron-core that have a CPU meaning."""
    # training.py:1258 get_model moves each chunk with Module.cuda(current_device()) (0.19:
    # training.py:1818).
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    # training.py:1325-1344 get_model builds DDP on a side stream (cuda.Stream, stream(),
    # current_stream().wait_stream) (0.19: training.py:1876-1896).
    torch.cuda.Stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    # core/rerun_state_machine.py:957 and checkpointing.py:343 save, checkpointing.py:1866/1878
    # restore the CUDA RNG state: there is none; an empty state round-trips (0.19:
    # core/rerun_state_machine.py:979, checkpointing.py:417 save, :2665/:2677 restore).
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.zeros(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *args, **kwargs: None
    # utils.py:284 report_memory (first logged iteration) and training.py:1940 read CUDA memory
    # statistics: no device memory on the CPU (0.19: utils/common_utils.py:322,
    # training.py:2742).
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *args, **kwargs: 0)
    torch.cuda.memory_stats = lambda *args, **kwargs: {}
    # arguments.py:852-854 asserts a compute capability >= 8 for --moe-grouped-gemm (0.19:
    # arguments.py:1338-1340): answer as a Hopper GPU, as get_device_arch_version below.
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    # core/optimizer/clip_grads.py:167, core/optimizer/optimizer.py:671/690 and
    # core/optimizer/distrib_optimizer.py:361/420/582 compare Tensor.type() with
    # 'torch.cuda.FloatTensor' / 'torch.cuda.HalfTensor' / 'torch.cuda.BFloat16Tensor' (0.19.2:
    # clip_grads.py:174, optimizer.py:1009/1028, distrib_optimizer.py:401/466).
    if not getattr(torch.Tensor.type, "vshape_cuda_names", False):
        torch.Tensor.type = _cuda_type_names(torch.Tensor.type)
        torch.Tensor.type.vshape_cuda_names = True


def _patch_megatron_lm() -> None:
    from megatron.training import arguments, initialize, training

    # initialize.py:60 asserts torch.cuda.is_available() unless allow_no_cuda (pretrain, at
    # training.py:136, imported initialize_megatron by name) (0.19: initialize.py:66, called
    # at training.py:1091).
    original_initialize = initialize.initialize_megatron

    @functools.wraps(original_initialize)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original_initialize(*args, **kwargs)

    initialize.initialize_megatron = training.initialize_megatron = initialize_megatron
    # initialize.py:319/350 initialize model parallelism only when torch.cuda.device_count() > 0
    # (then :331 set_device); initialize.py:422 seeds the model-parallel RNG tracker (which
    # checkpoints save and checkpointing.py:1867 requires on resume) under the same condition
    # (0.19: initialize.py:270/281/358, :447).
    initialize._initialize_distributed = _with_one_fake_device(initialize._initialize_distributed)
    initialize._set_random_seed = _with_one_fake_device(initialize._set_random_seed)
    # initialize.py:186 runs `make` for the dataset index helpers (the pip wheel ships them
    # built) and :224 compiles fused CUDA kernels with nvcc (0.19: :155/:165).
    initialize._compile_dependencies = lambda *args, **kwargs: None
    # initialize.py:460 warms up the GPU fusions (bias-GeLU, bias-dropout-add) with
    # torch.compile: on CPU that is an inductor C++ build per process, seconds each, for
    # fusions the tiny test model does not use (0.19: :494 passes tp_size=).
    initialize._warmup_jit_function = lambda *args, **kwargs: None
    # core/dist_checkpointing/strategies/filesystem_async.py:54 starts the checkpoint writer's
    # results-queue manager with the spawn method: a fresh interpreter per rank that imports
    # torch and megatron again (~10 s per rank and first save on 2 cores). Fork it from the rank,
    # which has them imported (speed only; the same queue). megatron-core 0.19 names it
    # get_write_results_queue (filesystem_async.py:53, called at :200).
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        for name in ("_get_write_results_queue", "get_write_results_queue"):
            if hasattr(filesystem_async, name):
                setattr(filesystem_async, name, _forked_results_queue(filesystem_async))
    # arguments.py:928 reads the GPU architecture when TP > 1 (then asks for
    # CUDA_DEVICE_MAX_CONNECTIONS=1, which the launcher sets): answer as a Hopper GPU (0.19:
    # arguments.py:1414/1444/1484 ask it for every run).
    arguments.get_device_arch_version = lambda: 9


class CpuFusedAdam(torch.optim.Optimizer):
    """apex's / Transformer Engine's FusedAdam (adam_w_mode) on the CPU, for megatron-core's
    optimizer path that GPU clusters take.

    megatron-core falls back to torch.optim.AdamW without apex or TE, and its distributed
    optimizer cannot checkpoint that fallback (core/optimizer/distrib_optimizer.py:642 asserts
    one per-parameter 'step' before any step exists, :940 expects 'step' among the loaded
    tensors). FusedAdam keeps the step in each param group instead, which is what megatron's
    TE/apex branches handle. Same update as FusedAdam: bias-corrected moments, decoupled
    weight decay.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, **unused):
        if not adam_w_mode:
            raise NotImplementedError("the CPU FusedAdam stand-in implements adam_w_mode only")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas,
                                      eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            step = group["step"]
            correction1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            correction2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["exp_avg"].mul_(beta1).add_(param.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / correction2).sqrt_().add_(group["eps"])
                update = (state["exp_avg"] / correction1) / denom
                update.add_(param, alpha=group["weight_decay"])
                param.add_(update, alpha=-group["lr"])


def use_fused_adam(enabled: bool = True) -> None:
    """Make megatron-core build :class:`CpuFusedAdam` where a GPU cluster builds apex/TE's
    FusedAdam (core/optimizer/__init__.py:13-34 and distrib_optimizer.py:21-36 choose at
    import); ``enabled=False`` restores torch's AdamW, megatron's CPU fallback."""
    from megatron.core import optimizer
    from megatron.core.optimizer import distrib_optimizer

    optimizer.Adam = CpuFusedAdam if enabled else torch.optim.AdamW
    optimizer.USING_PYTORCH_OPTIMIZER = not enabled
    distrib_optimizer.Adam = CpuFusedAdam if enabled else torch.optim.Adam
    distrib_optimizer.HAVE_APEX_OR_TE = distrib_optimizer.USING_APEX_OPTIMIZER = enabled


TORCH_ADAMW = "VSHAPE_E2E_TORCH_ADAMW"
"""Set to 1 for a run that keeps megatron-core's torch AdamW fallback (see :func:`use_fused_adam`)."""


def configure_run() -> None:
    """Per-run choices, read from the environment of the run's processes."""
    use_fused_adam(not os.environ.get(TORCH_ADAMW))


def _let_megatron_import() -> None:
    """What the 0.19-era training code needs to import on Python 3.11 with CPU torch
    (../shared/megatron-lm-0.19/README.md); nothing changes for core_v0.16.1.

    - training/models/gpt.py:5 and models/hybrid.py:5 import ``typing.override`` (Python
      3.12): the plugin's identity stand-in, where typing lacks it.
    - megatron-core >= 0.17 imports triton at module level (core/transformer/moe/ops/
      paged_stash.py:4, core/fusions/fused_indices_converter.py:12-15, the inference modules):
      the plugin's CPU stand-in, installed before any megatron import; not for 0.16, whose
      tier runs as before without one (:func:`_stand_in_batch_invariant_kernels`).
    """
    from megatron_vshape.harness.cpu import install_triton_stand_in, install_typing_override

    install_typing_override()
    if _megatron_core_minor() >= 17:
        install_triton_stand_in()


def _megatron_core_minor() -> int:
    """The installed megatron-core's minor version (0.16.1 -> 16), read without importing it."""
    from importlib.metadata import version

    return int(version("megatron-core").split(".")[1])


def _ints(split_sizes):
    """All-to-all split sizes as a list of ints (None stays None)."""
    if isinstance(split_sizes, torch.Tensor):
        return [int(n) for n in split_sizes.tolist()]
    return split_sizes


def install_moe_cpu_patches() -> None:
    """The two megatron-core problems of MoE on the CPU (gloo, no Transformer Engine).

    - core/transformer/moe/moe_utils.py:1192 (RouterGatingLinearFunction.forward; :1225 its
      backward) reads ``te_general_gemm``, which 0.16.1 defines only when Transformer Engine
      imports (:34): NameError. Define it as None, megatron's own meaning of "no TE" (0.19.2
      does so itself at moe_utils.py:52, read at :1326).
    - core/tensor_parallel/mappings.py:444 (_AllToAll.forward; 0.19.2: mappings.py:450/:460)
      passes the alltoall dispatcher's split sizes as tensors (token_dispatcher.py:531/:554
      make them; moe_utils.py:1093 turns them into numpy arrays only for CUDA tensors);
      gloo's all_to_all_single takes lists of ints only. Hand it the same sizes as a list
      (its backward reads the lists the forward stored on ctx).

    Idempotent; part of :func:`install_megatron_lm_cpu_patches`, and applied alone by the
    megatron-core MoE worker (support.megatron_workers.moe_weight_grads_in_w).
    """
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    forward = mappings._AllToAll.forward
    if getattr(forward, "vshape_int_splits", False):
        return

    @functools.wraps(forward)
    def int_splits(ctx, group, input_, output_split_sizes, input_split_sizes, *rest, **kwargs):
        return forward(ctx, group, input_, _ints(output_split_sizes), _ints(input_split_sizes),
                       *rest, **kwargs)

    int_splits.vshape_int_splits = True
    mappings._AllToAll.forward = staticmethod(int_splits)


def _use_te_stand_in() -> bool:
    """With $VSHAPE_TE_STAND_IN=1: the Transformer Engine stand-in first on sys.path (before any
    megatron import), checked to be the stand-in and not a real TE. Whether TE is there."""
    if os.environ.get(TE_STAND_IN) != "1":
        return False
    if "megatron.core" in sys.modules and "transformer_engine" not in sys.modules:
        raise RuntimeError(f"{TE_STAND_IN}=1 must be set before megatron is imported")
    if TE_STAND_IN_PATH not in sys.path:
        sys.path.insert(0, TE_STAND_IN_PATH)
    import transformer_engine

    if not getattr(transformer_engine, "STAND_IN", False):
        raise RuntimeError(f"{TE_STAND_IN}=1 imported {transformer_engine.__file__}, not the stand-in")
    return True


WITHHOLD_FIRST_MICROBATCH = "VSHAPE_TEST_WITHHOLD_FIRST_MICROBATCH"
"""A fault for the FP8 tier (tests/megatron/test_megatron_lm_fp8.py): set to a chunk index
(``vp_stage``: 0 or 1 under a V, 0 -- or unset vp_stage, read as 0 -- under megatron's
schedules), megatron's ``forward_step`` is called with ``is_first_microbatch=False`` for that
chunk, whatever the schedule passed. Transformer Engine then keeps the FP8 weights it cast at the
chunk's first forward for every later step (stale after each optimizer step). Read at every
call in the run's processes; only test support sets it."""
FIRST_MICROBATCH_LOG = "[fp8-probe] is_first_microbatch"
"""The line :func:`install_first_microbatch_probe` prints, in an FP8 run, for every forward
called with ``is_first_microbatch`` set: ``... chunk C microbatch M``."""


def install_first_microbatch_probe() -> None:
    """Wrap megatron's ``forward_step`` (core/pipeline_parallel/schedules.py, the function
    megatron's schedules call by its module-global name and the plugin's compute.py imports at
    each call) to apply :data:`WITHHOLD_FIRST_MICROBATCH` and, in FP8 runs (``config.fp8``), to
    print :data:`FIRST_MICROBATCH_LOG` for every forward that sets the flag. Idempotent."""
    from megatron.core.pipeline_parallel import schedules

    original = schedules.forward_step
    if getattr(original, "vshape_first_microbatch_probe", False):
        return

    @functools.wraps(original)
    def forward_step(*args, is_first_microbatch=False, current_microbatch=None, vp_stage=None,
                     **kwargs):
        chunk = vp_stage or 0
        if os.environ.get(WITHHOLD_FIRST_MICROBATCH) == str(chunk):
            is_first_microbatch = False
        config = args[6] if len(args) > 6 else kwargs.get("config")
        if is_first_microbatch and getattr(config, "fp8", None):
            print(f"{FIRST_MICROBATCH_LOG} chunk {chunk} microbatch {current_microbatch}",
                  flush=True)
        return original(*args, is_first_microbatch=is_first_microbatch,
                        current_microbatch=current_microbatch, vp_stage=vp_stage, **kwargs)

    forward_step.vshape_first_microbatch_probe = True
    schedules.forward_step = forward_step


def install_megatron_lm_cpu_patches() -> None:
    """Apply every patch (idempotent); before Megatron-LM's training code runs."""
    if getattr(torch, "_vshape_megatron_lm_cpu", False):
        return
    with_te = _use_te_stand_in()
    _let_megatron_import()
    _stand_in_batch_invariant_kernels()
    from megatron_vshape.harness.cpu import allow_sequence_parallel_norms, install_cpu_shims

    install_cpu_shims()
    # Megatron-LM's local spec takes megatron's torch norm, which refuses --sequence-parallel
    # (the norms that accept it are apex/TE GPU builds): the CPU stand-in computes the same.
    # With Transformer Engine (the stand-in) megatron takes TE's norms, which accept it
    # (core/transformer/transformer_block.py:54-61 LayerNormImpl = TENorm).
    if not with_te:
        allow_sequence_parallel_norms()
    _patch_torch()
    _patch_megatron_lm()
    install_moe_cpu_patches()
    if with_te:
        install_first_microbatch_probe()
    torch._vshape_megatron_lm_cpu = True
