"""Run a function on several local processes joined in a process group (tests, benchmarks).

:func:`run_workers` starts ``world_size`` worker processes (fork server or spawn, never a
plain fork of a process whose thread pools may be running), joins them through a
file-store rendezvous (``init_method="file://..."``, no network port), calls
``fn(rank, *args)`` in each, and returns every rank's return value. It is the harness of the
distributed tests and benchmarks: a worker's exception is re-raised in the caller as a
:class:`WorkerError` naming the rank, a job that runs past ``timeout`` is killed and raises
:class:`WorkerTimeoutError`, collectives fail after ``collective_timeout`` instead of waiting
forever, and the process group is destroyed on every exit path.
"""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .env import BACKENDS, destroy_process_group, import_before_init

__all__ = ["WorkerError", "WorkerTimeoutError", "run_workers"]

_RESULT_FILE = "result-rank{rank}.pt"
_FAILURE_FILE = "failure-rank{rank}.json"
_STORE_FILE = "rendezvous-store"
_START_METHODS = ("forkserver", "spawn")


class WorkerError(RuntimeError):
    """A worker process raised or died.

    ``rank`` is the rank that failed first (its peers usually fail next, with "connection
    closed by peer"); the message carries that rank's traceback.
    """

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class WorkerTimeoutError(TimeoutError):
    """The workers did not all finish within ``timeout`` seconds; they were killed."""


def _worker_entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    workdir: str,
    backend: str,
    collective_timeout: float,
    num_threads: int,
    args: tuple,
) -> None:
    # One intra-op thread per worker by default: W workers on a few shared cores must not
    # oversubscribe them, and a fixed thread count keeps reductions bitwise reproducible.
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)
    # torchrun's variables, so code written for torchrun (init_from_env) finds this rank; one host
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":  # one device per rank; nccl and its object collectives use the current one
            torch.cuda.set_device(rank)
        import_before_init()  # or a DDP in fn keeps the group (and its threads) alive past exit
        dist.init_process_group(
            backend,
            init_method="file://" + os.path.join(workdir, _STORE_FILE),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
    except BaseException:
        _record_failure(workdir, rank)
        raise
    try:
        result = fn(rank, *args)
        torch.save(result, os.path.join(workdir, _RESULT_FILE.format(rank=rank)))
    except BaseException:
        _record_failure(workdir, rank)  # before the group is destroyed and the peers fail
        raise
    finally:
        destroy_process_group()  # a no-op if fn destroyed the group itself


def _record_failure(workdir: str, rank: int) -> None:
    # One rank's failure makes its peers fail too ("connection closed by peer"); a timestamp
    # per failure lets the parent report the rank that failed first, not the first it noticed.
    record = {"rank": rank, "time": time.time(), "traceback": traceback.format_exc()}
    path = os.path.join(workdir, _FAILURE_FILE.format(rank=rank))
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)


def _first_failure(
    workdir: str, world_size: int, fn: Callable[..., Any], error: Exception
) -> WorkerError:
    records = []
    for rank in range(world_size):
        path = os.path.join(workdir, _FAILURE_FILE.format(rank=rank))
        if os.path.exists(path):
            with open(path) as handle:
                records.append(json.load(handle))
    name = getattr(fn, "__qualname__", repr(fn))
    if not records:  # killed by a signal or crashed without a Python exception
        rank = getattr(error, "error_index", -1)
        return WorkerError(f"worker rank {rank} exited abnormally in {name}: {error}", rank)
    records.sort(key=lambda r: (r["time"], r["rank"]))
    first, others = records[0], [r["rank"] for r in records[1:]]
    also = f" (then ranks {others} failed too)" if others else ""
    return WorkerError(
        f"worker rank {first['rank']} raised first in {name}{also}:\n{first['traceback']}",
        first["rank"],
    )


def _check_picklable_function(fn: Callable[..., Any]) -> None:
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not callable(fn) or "<lambda>" in qualname or "<locals>" in qualname or module is None:
        raise ValueError(
            f"fn must be a module-level function importable by the spawned workers, got {fn!r}; "
            "define it at the top level of an importable module"
        )


def _kill(context: mp.ProcessContext) -> None:
    for process in context.processes:
        if process.is_alive():
            process.kill()
    for process in context.processes:
        process.join()


def _check_seconds(name: str, value: Any) -> None:
    # a bool is an int to Python: timeout=True would be taken as 1 s
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    collective_timeout: float | None = None,
    backend: str = "gloo",
    num_threads: int = 1,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``world_size`` spawned processes sharing a process group.

    Each worker sets its thread count, sets torchrun's ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK`` (all on one host: ``LOCAL_RANK`` is the rank), with ``nccl`` makes CUDA device
    ``rank`` its current device, joins the default process group through a file store in a fresh
    temporary directory, runs ``fn``, saves the return value with :func:`torch.save`, and
    destroys the process group whether ``fn`` returned or raised.

    Args:
        fn: a module-level function (the workers import it by name); its return value must
            be tensors or plain data (numbers, strings, lists, tuples, dicts of them): results
            are loaded with ``torch.load(weights_only=True)``.
        world_size: number of processes, ``>= 1``.
        *args: passed to ``fn`` after the rank; picklable.
        timeout: seconds for the whole job (start-up included); past it every worker is
            killed and :class:`WorkerTimeoutError` is raised.
        collective_timeout: seconds a collective may wait (the process group's timeout);
            defaults to ``timeout``.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one CUDA device per rank: rank ``r`` runs
            on ``cuda:r``).
        num_threads: :func:`torch.set_num_threads` in each worker.
        start_method: ``"forkserver"`` or ``"spawn"``; ``None`` picks ``forkserver`` where
            the platform has it. A fork server imports torch and this package once and forks
            each worker from that clean, thread-free process, so later jobs start in a fraction
            of a second instead of importing torch again (seconds per worker); ``spawn``
            always starts a fresh interpreter.

    Returns:
        ``[result_rank0, result_rank1, ...]``.

    Raises:
        ValueError: a bad argument (a timeout that is a bool, not a number, not finite or not
            positive; a ``world_size`` or ``num_threads`` that is not an int ``>= 1``), ``fn``
            that the workers cannot import, or ``nccl`` with fewer CUDA devices than
            ``world_size``.
        WorkerError: a worker raised or exited abnormally; the others are terminated. Also one
            that exited with code 0 without returning (``sys.exit(0)``, ``KeyboardInterrupt``,
            ``os._exit(0)`` in ``fn``), naming its rank.
        WorkerTimeoutError: the job ran past ``timeout``.
    """
    _check_picklable_function(fn)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    _check_seconds("timeout", timeout)
    collective_timeout = timeout if collective_timeout is None else collective_timeout
    _check_seconds("collective_timeout", collective_timeout)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' needs one CUDA device per rank: world_size={world_size} but "
                         f"{torch.cuda.device_count()} visible; use backend='gloo' or fewer ranks")
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    available = multiprocessing.get_all_start_methods()
    if start_method is None:
        start_method = "forkserver" if "forkserver" in available else "spawn"
    if start_method not in _START_METHODS or start_method not in available:
        valid = [m for m in _START_METHODS if m in available]
        raise ValueError(
            f"start_method must be one of {', '.join(valid)} or None, got {start_method!r}"
        )
    if start_method == "forkserver":
        # only takes effect when this process starts its fork server (the first job)
        multiprocessing.set_forkserver_preload([__name__])

    with tempfile.TemporaryDirectory(prefix="manifoldlib-workers-") as workdir:
        deadline = time.monotonic() + timeout
        context = mp.start_processes(
            _worker_entry,
            args=(fn, world_size, workdir, backend, float(collective_timeout), num_threads, args),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        try:
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise WorkerTimeoutError(
                        f"{world_size} workers running {fn.__qualname__} did not finish within "
                        f"{timeout} s; they were killed"
                    )
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            failure: Exception | None = error
        else:
            failure = None
        finally:
            _kill(context)
        if failure is not None:
            raise _first_failure(workdir, world_size, fn, failure) from None
        paths = [os.path.join(workdir, _RESULT_FILE.format(rank=r)) for r in range(world_size)]
        missing = [r for r, path in enumerate(paths) if not os.path.exists(path)]
        if missing:  # exited with code 0 without returning: SystemExit(0), KeyboardInterrupt, os._exit(0)
            raise _unreturned(workdir, world_size, fn, missing) from None
        return [_load_result(path, r) for r, path in enumerate(paths)]


def _unreturned(workdir: str, world_size: int, fn: Callable[..., Any], missing: list[int]) -> WorkerError:
    """The error for workers that exited with code 0 but returned nothing: the first recorded
    failure (``sys.exit(0)``, ``KeyboardInterrupt``: a ``BaseException`` that torch's spawn wrapper
    turns into exit code 0), else the ranks that left without a word (``os._exit(0)``)."""
    error = _first_failure(workdir, world_size, fn, RuntimeError("exit code 0"))
    if error.rank >= 0:
        return error
    name = getattr(fn, "__qualname__", repr(fn))
    return WorkerError(f"worker rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} exited with "
                       f"code 0 in {name} without returning a result (os._exit(0)?)", missing[0])


def _load_result(path: str, rank: int) -> Any:
    """One worker's return value, loaded with ``weights_only=True``: tensors and plain data
    (numbers, strings, lists, tuples, dicts) only, so a result file runs no code."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()
        raise WorkerError(
            f"refusing to load {path}: rank {rank}'s result holds objects other than tensors "
            f"and plain data ({reason[-1] if reason else 'unpickling refused'}); return "
            f"tensors, numbers, strings, lists, tuples or dicts",
            rank,
        ) from None
