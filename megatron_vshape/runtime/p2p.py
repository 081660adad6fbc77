"""Point-to-point transport for one rank: asynchronous sends, early receives, bounded waits.

Sends are posted with ``isend`` and checked at the end of the step. Receives are posted early
(the interpreter decides when, from the schedule) into buffers shaped by a :class:`TensorSpec`,
and waited for just before the pass that consumes them. Every wait has a timeout; when it
expires, or the peer dies, :class:`P2PError` names the rank, step, action and peer.

With ``TensorSpec.variable`` the sender first sends a small shape header on the same stream
(stream messages are first-in first-out, so header and payload stay paired), and the receiver
allocates the payload buffer once the header has arrived.

gloo cannot send or receive CUDA tensors; with ``TensorSpec.wire = "cpu"`` messages travel
through host memory (several ranks sharing one GPU over gloo, e.g. to debug a pipeline on a
single-GPU machine). NCCL moves device tensors directly and needs no wire device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..schedule.model.actions import Action
from .streams import Route, StreamGroups

__all__ = ["TensorSpec", "P2PError", "Transport"]

_MAX_DIMS = 8
_BLOCKED_S = 50e-6
"""A wait longer than this found its message missing (one that was there returns in ~10 us)."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of the tensors crossing a stage boundary (activations and gradients).

    ``shape`` may be a callable ``(boundary, microbatch) -> shape`` when stages differ; with
    ``variable=True`` shapes travel with every message instead (e.g. variable sequence lengths)
    and ``shape`` is the largest message (what a hop's latency is measured with).
    """

    shape: tuple | Callable[[int, int], tuple] = ()
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    variable: bool = False
    wire: torch.device | str | None = None
    """Where messages travel when the backend cannot move ``device`` tensors (gloo: "cpu");
    None: they travel as they are."""

    def shape_of(self, boundary: int, microbatch: int) -> tuple:
        return tuple(self.shape(boundary, microbatch) if callable(self.shape) else self.shape)

    @property
    def wire_device(self) -> torch.device | str:
        return self.device if self.wire is None else self.wire


class P2PError(RuntimeError):
    """A send or receive failed or timed out; the message names rank, step, action and peer."""


@dataclass
class _Posted:
    """A posted receive: header work (variable shapes) or payload work, and the buffers."""

    route: Route
    work: object = None
    buffer: torch.Tensor | None = None
    header: torch.Tensor | None = None
    header_work: object = None


class Transport:
    """Sends and receives of one pipeline rank over its :class:`StreamGroups`."""

    def __init__(self, groups: StreamGroups, spec: TensorSpec, timeout: float = 300.0):
        if timeout <= 0:
            raise ValueError(f"p2p timeout must be > 0 seconds, got {timeout}")
        self.groups = groups
        self.spec = spec
        self.timeout = timedelta(seconds=timeout)
        self._posted: dict[tuple, _Posted] = {}
        self._sends: list[tuple[object, Route, Action, torch.Tensor]] = []
        self.last_arrival: float | None = None
        """When the last :meth:`wait_recv` stopped blocking (None: the message was there)."""

    # -- receives -----------------------------------------------------------------------
    def post_recv(self, route: Route, where: str = "posting a receive") -> None:
        """Post the receive for ``route.message`` (idempotent); ``where`` names the rank, step
        and action in the error when the peer is already gone."""
        if route.message in self._posted:
            return
        posted = _Posted(route)
        if self.spec.variable:
            posted.header = torch.empty(_MAX_DIMS + 1, dtype=torch.int64,
                                        device=self.spec.wire_device)
            posted.header_work = self._irecv(posted.header, route, where)
        else:
            posted.buffer = self.receive_buffer(
                self.spec.shape_of(route.stream[1], route.message[2]))
            posted.work = self._irecv(posted.buffer, route, where)
        self._posted[route.message] = posted

    def wait_recv(self, route: Route, where: str) -> torch.Tensor:
        """Wait for the posted (or now posted) receive of ``route`` and return its tensor."""
        self.post_recv(route, where)
        posted = self._posted.pop(route.message)
        if posted.header_work is not None:
            self._wait(posted.header_work, route, where)
            ndim = int(posted.header[0])
            posted.buffer = self.receive_buffer(tuple(int(d) for d in posted.header[1:1 + ndim]))
            posted.work = self._irecv(posted.buffer, route, where)
        begin = time.perf_counter()
        self._wait(posted.work, route, where)
        end = time.perf_counter()
        # gloo marks a receive completed only inside wait(), so ask the clock instead.
        self.last_arrival = end if end - begin > _BLOCKED_S else None
        return posted.buffer if self.spec.wire is None else posted.buffer.to(self.spec.device)

    # -- sends ----------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, route: Route, action: Action,
             where: str = "sending") -> None:
        """Post an asynchronous send; the tensor is kept alive until :meth:`finish_sends`.
        ``where`` names the rank and step in the error when the peer is already gone."""
        tensor = tensor.detach().contiguous()
        if self.spec.wire is not None:
            tensor = tensor.to(self.spec.wire)
        if self.spec.variable:
            if tensor.dim() > _MAX_DIMS:
                raise ValueError(f"variable-shape p2p supports up to {_MAX_DIMS} dims, got "
                                 f"{tuple(tensor.shape)} at {action}")
            header = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=tensor.device)
            header[0] = tensor.dim()
            header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            self._sends.append((self._isend(header, route, where), route, action, header))
        self._sends.append((self._isend(tensor, route, where), route, action, tensor))

    def finish_sends(self, where: str) -> None:
        """Wait for every posted send (end of step), so their buffers can be freed."""
        sends, self._sends = self._sends, []
        for work, route, action, _ in sends:
            self._wait(work, route, f"{where}, completing the send of {action}")

    @property
    def pending(self) -> list[tuple]:
        """Messages with a posted receive nobody has waited for (must be empty after a step)."""
        return list(self._posted)

    def receive_buffer(self, shape: tuple) -> torch.Tensor:
        """An empty tensor to receive a message of ``shape`` into, on the wire's device (the
        host for gloo with CUDA tensors: ``TensorSpec.wire``)."""
        return torch.empty(shape, dtype=self.spec.dtype, device=self.spec.wire_device)

    # -- helpers --------------------------------------------------------------------------

    def _irecv(self, tensor: torch.Tensor, route: Route, where: str):
        src = self.groups.global_rank(route.peer)
        try:  # gloo raises at once when the peer's connection is already closed
            return dist.irecv(tensor, src=src, group=self.groups.group(route.stream))
        except RuntimeError as err:
            raise self._failure(f"{where}, posting the receive", route, err) from err

    def _isend(self, tensor: torch.Tensor, route: Route, where: str):
        dst = self.groups.global_rank(route.peer)
        try:
            return dist.isend(tensor, dst=dst, group=self.groups.group(route.stream))
        except RuntimeError as err:
            raise self._failure(f"{where}, posting the send", route, err) from err

    def _wait(self, work, route: Route, where: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as err:
            raise self._failure(where, route, err) from err

    def _failure(self, where: str, route: Route, err: RuntimeError) -> "P2PError":
        """The error naming the message, the peer and the timeout (both ranks' logs matter)."""
        kind, producer, mb = route.message
        return P2PError(
            f"{where}: {kind} of stage {producer}, microbatch {mb}, with peer pipeline rank "
            f"{route.peer} (global rank {self.groups.global_rank(route.peer)}) failed or "
            f"did not complete within {self.timeout.total_seconds():g} s: {err}. The peer "
            "has crashed, hangs, or runs a different schedule; check its log."
        )
