"""The processes of one parallel DeepInfer job and what they say to each other (torch.distributed).

Two ways in. Under ``torchrun`` every process runs the user's script and joins the group torchrun describes
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); every rank makes the same API calls. Without it, ``LLM(...)`` in the
user's process becomes rank 0 and spawns the other ranks (``multiprocessing``'s spawn method, so the user's script
needs the usual ``if __name__ == "__main__":`` guard); rank 0 then mirrors each API call to them.

Two process groups: ``device`` carries the experts' token exchange (NCCL on GPUs, Gloo on CPUs) and ``control``
(Gloo, host objects) carries calls, step agreement and outputs. A rank that fails makes the others fail too: a
spawned rank reports its traceback on a queue and exits, which breaks every collective rank 0 is in; rank 0 then
raises that traceback. Under torchrun the failing process exits and torchrun ends the others and names it.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import socket
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deepinfer.logger import init_logger, set_rank
from deepinfer.plugins.manager import load_plugins, register_modules, registered_modules

logger = init_logger(__name__)

# a rank that never answers (hung kernel, lost host) ends the job after this long instead of never
_TIMEOUT = datetime.timedelta(minutes=30)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass(slots=True)
class Ranks:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    device_group: object
    control_group: object
    torchrun: bool = False  # every process runs the user's script and makes the calls itself
    workers: list = field(default_factory=list)  # rank 0 of a spawned job: the other ranks' processes
    errors: object = None  # rank 0 of a spawned job: (rank, traceback) from a rank that failed
    closed: bool = False
    threads_before: int = 0  # a CPU job shares the host's cores between its ranks until it ends

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def spawned(self) -> bool:
        return bool(self.workers)

    # -- collectives on host objects ---------------------------------------------------------
    def any(self, flag: bool) -> bool:
        """Whether any rank says ``flag``: the step agreement of ranks that must run every step together."""
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.control_group)
        return bool(value.item())

    def mirror(self, call: str, *args) -> None:
        """Rank 0 of a spawned job: the other ranks make the same API call (they wait for it in ``serve``)."""
        if self.spawned:
            self._broadcast((call, args))

    def gather(self, obj) -> list | None:
        """Every rank's ``obj``, on rank 0 of a spawned job (None elsewhere) or on every rank under torchrun."""
        if not self.torchrun:
            gathered = [None] * self.world_size if self.leader else None
            dist.gather_object(obj, gathered, dst=0, group=self.control_group)
            return gathered
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.control_group)
        return gathered

    def check_same(self, what: str, value) -> None:
        """Under torchrun every rank must make the same calls, else a clear error (spawned ranks are mirrored)."""
        if not self.torchrun:
            return
        values = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.control_group)
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            raise ValueError(f"{what} differs between ranks: ranks {differ} got {[values[r] for r in differ]}, rank 0 "
                             f"got {values[0]}; under torchrun every rank must make the same calls with the same inputs")

    def _broadcast(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    # -- a spawned job's lifetime -------------------------------------------------------------
    def serve(self, calls: Mapping[str, Callable]) -> None:
        """A spawned rank's loop: make each call rank 0 mirrors, one of ``calls`` by its name, until it says
        close."""
        while True:
            call, args = self._broadcast()
            if call == "close":
                return
            if call not in calls:
                raise RuntimeError(f"rank 0 mirrored {call!r}, which a spawned rank does not serve "
                                   f"(it serves {sorted(calls)})")
            calls[call](*args)

    def guarded(self, work):
        """Rank 0 of a spawned job runs ``work``; if it or another rank fails, every rank is ended and the failing
        rank's error is raised here (another rank's as a RuntimeError carrying its traceback)."""
        if not self.spawned:
            return work()
        try:
            return work()
        except BaseException as error:
            # a broken collective raises RuntimeError here; anything else is this rank's own error, reported as is
            failed = self._worker_error(wait=5.0) if type(error) is RuntimeError else None
            self.terminate()
            if failed is None:
                raise
            rank, trace = failed
            raise RuntimeError(f"rank {rank} of {self.world_size} failed, so the job ended:\n{trace}") from error

    def _worker_error(self, wait: float) -> tuple[int, str] | None:
        try:
            return self.errors.get(timeout=wait)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(self.workers, start=1) if p.exitcode not in (None, 0)]
            return (dead[0][0], f"its process exited with code {dead[0][1]}") if dead else None

    def terminate(self) -> None:
        if self.closed:
            return
        self.closed = True
        for process in self.workers:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
        self.workers.clear()
        self._end()

    def close(self) -> None:
        """Ends the job: rank 0 of a spawned job tells the other ranks to stop and waits for them."""
        if self.closed:
            return
        self.closed = True
        if self.spawned:
            try:
                self._broadcast(("close", ()))
            except RuntimeError as error:  # a rank already gone: nothing left to tell
                logger.warning("closing the parallel job: %s", error)
            for process in self.workers:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
            self.workers.clear()
        self._end()

    def _end(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self.threads_before)
        set_rank(None)


def _device(device: torch.device, local_rank: int) -> torch.device:
    """Rank r drives GPU r of its host; a CPU job's ranks share the CPU."""
    if device.type in ("cuda", "npu"):
        if device.index not in (None, local_rank):
            raise ValueError(f"device {device} was asked for, but under parallelism each rank takes the device of its "
                             f"local rank ({device.type}:{local_rank}); pass device={device.type!r} or 'auto'")
        return torch.device(device.type, local_rank)
    return device


def _join(rank: int, world_size: int, local_rank: int, device: torch.device, init_method: str) -> Ranks:
    device = _device(device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    set_rank(rank)
    threads = torch.get_num_threads()
    if device.type == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, threads // world_size))
    logger.info("rank %d of %d on %s (%s)", rank, world_size, device, backend)
    return Ranks(rank, world_size, local_rank, device, dist.group.WORLD, control, threads_before=threads)


def start(world_size: int, device: torch.device, config, rank_main: Callable[[object, Ranks], None]) -> Ranks:
    """This process's place in a job of ``world_size`` ranks: joined under torchrun, else rank 0 of a job whose
    other ranks are spawned here, each running ``rank_main(config, ranks)`` (a module-level function: spawn
    pickles it by name)."""
    if under_torchrun():
        got = int(os.environ["WORLD_SIZE"])
        if got != world_size:
            raise ValueError(f"torchrun started {got} processes but the engine arguments ask for {world_size} ranks "
                             "(data_parallel_size); start as many processes as ranks")
        ranks = _join(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", 0)), device, "env://")
        ranks.torchrun = True
        return ranks
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process but not by torchrun: close the "
                           "other parallel LLM first (LLM.close())")
    load_plugins()
    plugins = registered_modules()  # the spawned ranks run exactly this process's plugins
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    workers = [context.Process(target=_spawned_rank,
                               args=(rank, world_size, device, init_method, config, plugins, errors, rank_main),
                               name=f"deepinfer-rank{rank}") for rank in range(1, world_size)]
    for process in workers:
        process.start()
    logger.info("spawned ranks 1-%d of a %d-rank job", world_size - 1, world_size)
    try:
        ranks = _join(0, world_size, 0, device, init_method)
    except BaseException:  # re-raised: the spawned ranks just must not outlive it
        for process in workers:
            process.kill()
        raise
    ranks.workers, ranks.errors = workers, errors
    return ranks


def _spawned_rank(rank: int, world_size: int, device: torch.device, init_method: str, config,
                  plugins: list[tuple[str, str]], errors, rank_main) -> None:
    try:
        register_modules(plugins)
        ranks = _join(rank, world_size, rank, device, init_method)
        rank_main(config, ranks)
        ranks._end()
    except BaseException:  # not swallowed: rank 0 raises this traceback as the job's error
        trace = traceback.format_exc()
        logger.error("rank %d failed: %s", rank, trace.strip().splitlines()[-1])
        errors.put((rank, trace))
        errors.close()
        errors.join_thread()  # the traceback must reach rank 0 before this process ends
        os._exit(1)  # not a clean shutdown: the job is over, and a collective may still hold this process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
