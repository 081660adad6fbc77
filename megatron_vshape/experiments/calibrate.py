"""The paper's predictions calibrated: the planner with measured per-layer costs.

``vshape gpu-check`` on a GPU writes ``cuda-<model>-s<S>.yaml`` (per-layer F, B, W of a TP
shard at TP 1, 2, 4, 8; committed into configs/profiles/). Where such a file
exists for a paper case, ``vshape paper`` plans the case again from it and adds a section to
docs/paper-reproduction.md: the predicted and the calibrated best 1F1B and best V side by side,
and how far the shape cost model (plan/layer_kernels.py) was from the measured layer time at
each TP. Without profiles the page is unchanged.

The profiles time megatron's local layers without flash attention and without TP communication,
so at long sequences they are slower than the flash-attention layers the grids plan for, and at
TP > 1 faster than a real TP rank: the calibrated column says what measured compute changes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..configs import CONFIG_DIR
from ..plan.cost import analytic_times
from ..plan.profile_file import MeasuredProfile, load_profile
from ..plan.settings import ClusterConfig, TrainingConfig, gpu_limits
from ..schedule.names import REFERENCE
from .predict import CasePrediction, predict_case

__all__ = ["PROFILE_DIR", "Calibration", "profile_name", "find_profile", "calibrate",
           "as_profiled", "render_calibrated"]

PROFILE_DIR = CONFIG_DIR / "profiles"


def profile_name(model: str, seq_length: int) -> str:
    """The file gpu-check writes for ``model`` at ``seq_length`` (cli/gpu_profiles.py)."""
    return f"cuda-{model}-s{seq_length}.yaml"


def find_profile(folder: Path, model: str, seq_length: int) -> MeasuredProfile | None:
    """The CUDA profile of ``model`` at ``seq_length`` in ``folder``, or None."""
    path = Path(folder) / profile_name(model, seq_length)
    return load_profile(path) if path.is_file() else None


@dataclass(frozen=True)
class Calibration:
    """One paper case planned twice: analytic costs and measured ones."""

    analytic: CasePrediction
    measured: CasePrediction
    profile: MeasuredProfile
    time_ratio: dict[int, float]
    """Per measured TP: (F + B + W measured) / (F + B + W analytic) of one layer, micro
    batch 1, the analytic model predicting the measured layers (:func:`as_profiled`): above 1,
    it was optimistic."""
    mfu_ratio: dict[int, float]
    """The same against the one-MFU model (``--cost-model mfu``)."""


def calibrate(case: CasePrediction, folder: Path = PROFILE_DIR, auto_candidates: int = 3
              ) -> Calibration | None:
    """``case`` planned again from its profile in ``folder`` (None without one)."""
    grid, seq = case.grid, case.seq_length
    profile = find_profile(folder, grid.model.name, seq)
    if profile is None:
        return None
    training, cluster = as_profiled(case.result.training, case.result.cluster,
                                    profile.machine.device if profile.machine else "")
    ratios, mfu_ratios = {}, {}
    mfu = replace(cluster, cost_model="mfu")
    for tp in sorted({m.tensor_parallel for m in profile.measurements}):
        analytic = analytic_times(grid.model, training, cluster, tp, 1)
        measured = _total(profile.times(tp, 1, analytic).layer)
        ratios[tp] = measured / _total(analytic.layer)
        mfu_ratios[tp] = measured / _total(analytic_times(grid.model, training, mfu, tp, 1).layer)
    measured_case = predict_case(grid, seq, auto_candidates, profile, compare_mfu=False)
    return Calibration(case, measured_case, profile, ratios, mfu_ratios)


def as_profiled(training: TrainingConfig, cluster: ClusterConfig, device: str
                ) -> tuple[TrainingConfig, ClusterConfig]:
    """The settings gpu-check's profiles ran under, so the shape model predicts the very
    layers that were timed: megatron's local layers (unfused fp32 softmax, no flash
    attention), no dropout, one TP shard's shapes with no TP communication (a collective of
    unbounded bandwidth leaves only its per-kernel cost, microseconds), on the profile's GPU."""
    training = replace(training, flash_attention=False, fp32_softmax_copy=True, dropout=False,
                       sequence_parallel=False)
    cluster = replace(cluster, intra_node_gbps=1e9, **gpu_limits(device))
    return training, cluster


def _total(times) -> float:
    return times.forward + times.backward + times.weight


def render_calibrated(calibrations: list[Calibration]) -> list[str]:
    """The markdown section (empty without calibrations)."""
    if not calibrations:
        return []
    lines = ["", "## Calibrated with measured per-layer costs", "",
             "Where `vshape gpu-check` measured the model's layers on a GPU "
             f"(`configs/profiles/cuda-<model>-s<S>.yaml`), the same case planned "
             "from measured F, B, W (predicted | calibrated). `measured / predicted`: one layer's "
             "F + B + W at micro batch 1, per TP, against the shape cost model's and the "
             "one-MFU model's prediction of the very layers timed (megatron's local layers: "
             "unfused fp32 softmax, no flash attention, no dropout, one TP shard without TP "
             "communication, on the GPU named). The calibrated plans use the measured times; "
             "settings not measured are scaled from the nearest measured one by the model's "
             "ratio. So at long sequences the calibrated column is slower than the "
             "flash-attention layers the predicted one plans for "
             "(megatron_vshape/experiments/calibrate.py).",
             "", "| model, GPUs | seq | measured on | measured / predicted per TP: shape model "
             "\\| one MFU | best 1F1B tok/s | best V tok/s | best V / 1F1B |",
             "|---|---|---|---|---|---|---|"]
    for c in calibrations:
        lines.append(_row(c))
    return lines


def _row(c: Calibration) -> str:
    def tokens(case, family):
        best = case.best_v() if family == "v" else case.best.get(family)
        return f"{best.tokens_per_second_per_gpu:.0f}" if best else "-"

    def gain(case):
        value = case.gain_over(REFERENCE)
        return f"x{value:.3f}" if value is not None else "-"

    a, m = c.analytic, c.measured
    machine = c.profile.machine.device if c.profile.machine else "?"
    ratios = ", ".join(f"TP{tp} {r:.2f} \\| {c.mfu_ratio[tp]:.2f}"
                       for tp, r in c.time_ratio.items())
    return (f"| {a.grid.model.name}, {a.grid.gpus.total} | {a.seq_length} | {machine} | {ratios} "
            f"| {tokens(a, REFERENCE)} \\| {tokens(m, REFERENCE)} | {tokens(a, 'v')} \\| "
            f"{tokens(m, 'v')} | {gain(a)} \\| {gain(m)} |")
