"""Launch Megatron-LM training scripts on local gloo processes, as torchrun would, but fast.

A user runs ``torchrun --nproc-per-node N scripts/pretrain_gpt_vshape.py <flags>``: torchrun
starts N Python processes with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, and each runs the script as ``__main__``. On 2 CPU cores most of such a run is
N processes importing torch, megatron-core and Megatron-LM (about 30 s of the 35 s a tiny run
takes). The :class:`Launcher` keeps one server process that has imported them once (with
the CPU patches and the probe applied), and forks N workers per run that set exactly those
variables and run the script with ``runpy`` as ``__main__``, with the script's folder first
on ``sys.path``, stdout and stderr to ``<log_dir>/rank<R>.log``. A run is a fresh fork of an
untouched server, so runs share nothing. Both real-loop tiers (tests/megatron/test_megatron_lm_e2e.py,
tests/megatron/test_megatron_lm_019.py) check one run under a real ``torchrun`` against the same run
from here.

Server protocol (``python -m support.megatron_lm_launch``): one JSON request per stdin line
({script, args, nproc, env, log_dir, timeout}), one JSON reply per stdout line
({returncodes, seconds, timed_out}).

One run, as a command line torchrun's would stand for (``vshape trial --example tiny`` launches
each schedule so): ``python -m support.megatron_lm_launch --nproc N SCRIPT ARGS...`` imports
once, forks N workers, then prints every rank's log to stdout, each line prefixed
``[rankR]:`` (torchrun's ``--tee`` style), and exits 1 if a rank failed.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Launcher", "RunResult", "megatron_lm_env", "MEGATRON_LM", "REPO",
           "TAKES_CONFIG_CONTAINER", "TIER_PAIRS", "unpaired_reason"]

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def _default_training_code() -> Path:
    """The training code beside the checkout that pairs with the installed megatron-core:
    ../shared/megatron-lm (tag core_v0.16.1) for 0.16 and older, ../shared/megatron-lm-0.17,
    -0.18 and -0.19 for those, Megatron-LM main (../shared/megatron-lm-main, whose core says
    0.20.0) for anything newer."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        minor = int(version("megatron-core").split(".")[1])
    except PackageNotFoundError:
        minor = 16
    folder = ("megatron-lm" if minor <= 16 else "megatron-lm-main" if minor >= 20
              else f"megatron-lm-0.{minor}")
    return REPO.parent / "shared" / folder


MEGATRON_LM = Path(os.environ.get("MEGATRON_LM") or _default_training_code()).resolve()
"""Megatron-LM's training code: $MEGATRON_LM, else the one pairing with megatron-core."""
TAKES_CONFIG_CONTAINER = (MEGATRON_LM / "megatron" / "training" / "config" /
                          "container.py").is_file()
"""Whether that code's pretrain() takes a config container (the 0.19 era) rather than parsing
the flags itself (core_v0.16.1): which test tier it belongs to."""


TIER_PAIRS = (("0.16", False), ("0.19", True))
"""(megatron-core release, whether its training code takes a config container) of the two CI
environments that run every real-loop tier (the matrix releases run only their subset)."""


def unpaired_reason(pairs=TIER_PAIRS) -> str | None:
    """Why this environment cannot run a real-loop tier (None: it can): the training code is
    missing, megatron-core is not installed, or its release and the training code at
    :data:`MEGATRON_LM` are not one of ``pairs``."""
    from importlib.metadata import PackageNotFoundError, version

    if not (MEGATRON_LM / "megatron" / "training").is_dir():
        return f"Megatron-LM's training code is not at {MEGATRON_LM}"
    try:
        core = version("megatron-core")
    except PackageNotFoundError:
        return "megatron-core is not installed"
    if (core[:4], TAKES_CONFIG_CONTAINER) not in pairs:
        return f"megatron-core {core} does not pair with the training code at {MEGATRON_LM}"
    return None

_PRELOAD = ("megatron.training.training", "megatron.training.checkpointing", "pretrain_gpt",
            "gpt_builders", "model_provider", "megatron_vshape.megatron.arguments",
            "megatron_vshape.megatron.providers", "megatron_vshape.megatron.batch",
            "megatron_vshape.megatron.forward_backward")
_GRACE_SECONDS = 20.0
"""After one rank fails, how long the others get to fail on their own before being killed."""


def _installed_core_first() -> list:
    """Where the installed megatron-core lives, when the training code's folder carries a
    megatron/core of its own (Megatron-LM main, ../shared/megatron-lm-main): that source would
    shadow the installed build, whose compiled dataset helpers (megatron/core/datasets/
    helpers_cpp, built with the wheel) it lacks. Empty for the other folders."""
    from importlib.metadata import PackageNotFoundError, distribution

    if not (MEGATRON_LM / "megatron" / "core").is_dir():
        return []
    try:
        return [str(distribution("megatron-core").locate_file(""))]
    except PackageNotFoundError:
        return []


def megatron_lm_env(extra_paths=()) -> dict:
    """The environment of a CPU Megatron-LM run: Megatron-LM and the test support importable,
    one OpenMP thread per process (as torchrun sets), CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM
    asks for it with TP > 1)."""
    env = dict(os.environ)
    paths = [str(p) for p in extra_paths] + [str(TESTS), *_installed_core_first(),
                                             str(MEGATRON_LM)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1",
               CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    return env


@dataclass(frozen=True)
class RunResult:
    returncodes: list
    seconds: float
    timed_out: bool
    log_dir: Path

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.returncodes)

    def log(self, rank: int) -> str:
        return (self.log_dir / f"rank{rank}.log").read_text(encoding="utf-8", errors="replace")

    def failure(self, tail: int = 60) -> str:
        """What went wrong, for an assertion message: return codes and each failing log's tail."""
        lines = [f"return codes {self.returncodes}, timed out {self.timed_out}, "
                 f"{self.seconds:.1f} s, logs in {self.log_dir}"]
        for rank, code in enumerate(self.returncodes):
            if code != 0 or self.timed_out:
                lines.append(f"--- rank {rank} (exit {code}) ---")
                lines.extend(self.log(rank).splitlines()[-tail:])
        return "\n".join(lines)


class Launcher:
    """Client of one launch server (start it once per test session; close it after).

    ``te_stand_in``: the server's Megatron-LM imports support/te_stand_in's CPU stand-in of
    Transformer Engine (support.megatron_lm_cpu.TE_STAND_IN), for ``--transformer-impl
    transformer_engine`` runs; a server without it never sees TE, as before."""

    def __init__(self, te_stand_in: bool = False):
        from support.megatron_lm_cpu import TE_STAND_IN

        env = megatron_lm_env()
        env.pop(TE_STAND_IN, None)
        if te_stand_in:
            env[TE_STAND_IN] = "1"
        self._server = subprocess.Popen(
            [sys.executable, "-m", "support.megatron_lm_launch"], cwd=REPO, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = self._server.stdout.readline().strip()
        if ready != "ready":
            self.close()
            raise RuntimeError(f"the Megatron-LM launch server did not start: {ready!r}")

    def run(self, script, args, nproc: int, log_dir, env=None, timeout: float = 300) -> RunResult:
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        request = {"script": str(script), "args": [str(a) for a in args], "nproc": nproc,
                   "env": env or {}, "log_dir": str(log_dir), "timeout": timeout}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        reply = self._server.stdout.readline()
        if not reply:
            raise RuntimeError("the Megatron-LM launch server died")
        reply = json.loads(reply)
        return RunResult(reply["returncodes"], reply["seconds"], reply["timed_out"], log_dir)

    def close(self) -> None:
        if self._server.poll() is None:
            self._server.stdin.close()
            try:
                self._server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._server.kill()


# -- server ----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(request: dict, rank: int, port: int) -> None:
    """In the forked child: become rank ``rank`` of the run, run the script, exit."""
    code = 1
    try:
        log = os.open(os.path.join(request["log_dir"], f"rank{rank}.log"),
                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        nproc = request["nproc"]
        os.environ.update(request["env"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                          LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        from support.megatron_lm_cpu import configure_run

        configure_run()
        script = os.path.abspath(request["script"])
        sys.argv = [script, *request["args"]]
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 -- reported in the rank's log, then the exit code
        traceback.print_exc()
    finally:
        # what interpreter exit would run: multiprocessing shuts down the managers and joins
        # the processes the run started (the checkpoint writer's, the data loader's)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pids: list, timeout: float) -> tuple:
    """Exit codes of every worker; kill all at ``timeout``, the rest soon after one fails."""
    codes, deadline = {}, time.monotonic() + timeout
    timed_out = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0:
                    deadline = min(deadline, time.monotonic() + _GRACE_SECONDS)
        if time.monotonic() > deadline:
            timed_out = all(code == 0 for code in codes.values())
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[pid] = -signal.SIGKILL
        time.sleep(0.05)
    return [codes[pid] for pid in pids], timed_out


def _serve_one(request: dict) -> dict:
    start, port, pids = time.monotonic(), _free_port(), []
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            _worker(request, rank, port)
        pids.append(pid)
    codes, timed_out = _wait(pids, request["timeout"])
    return {"returncodes": codes, "seconds": time.monotonic() - start, "timed_out": timed_out}


def serve() -> None:
    """Import and patch once, then fork one set of workers per request."""
    import importlib

    from support.megatron_lm_cpu import install_megatron_lm_cpu_patches
    from support.megatron_lm_probe import install_probe

    protocol = sys.stdout
    sys.stdout = sys.stderr  # what imports print must not reach the protocol
    install_megatron_lm_cpu_patches()
    for name in _PRELOAD:
        importlib.import_module(name)
    install_probe()
    protocol.write("ready\n")
    protocol.flush()
    for line in sys.stdin:
        reply = _serve_one(json.loads(line))
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


def run_once(argv: list) -> int:
    """``--nproc N SCRIPT ARGS...``: one run (module doc); its exit status."""
    import importlib
    import tempfile

    from support.megatron_lm_cpu import install_megatron_lm_cpu_patches

    if len(argv) < 3 or argv[0] != "--nproc":
        raise SystemExit("usage: python -m support.megatron_lm_launch --nproc N SCRIPT ARGS...")
    nproc, script, args = int(argv[1]), argv[2], argv[3:]
    sys.path[:0] = [*_installed_core_first(), str(MEGATRON_LM)]  # as megatron_lm_env puts them
    install_megatron_lm_cpu_patches()
    for name in _PRELOAD:
        importlib.import_module(name)
    # not a TemporaryDirectory: its clean-up is an exit function, which each worker runs
    log_dir = tempfile.mkdtemp(prefix="vshape-launch-")
    try:
        reply = _serve_one({"script": script, "args": args, "nproc": nproc, "env": {},
                            "log_dir": log_dir, "timeout": 1e9})
        for rank in range(nproc):
            with open(os.path.join(log_dir, f"rank{rank}.log"), errors="replace") as log:
                for line in log:
                    sys.stdout.write(f"[rank{rank}]:{line}")
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    sys.stdout.flush()
    return 0 if all(code == 0 for code in reply["returncodes"]) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(run_once(sys.argv[1:]))
    serve()
