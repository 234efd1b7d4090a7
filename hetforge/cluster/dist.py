"""Process-group set-up and the few collectives the loop needs.

Launchers: `torchrun` (its agent store does the rendezvous), Slurm `srun` (SLURM_* variables mapped
to RANK / WORLD_SIZE / LOCAL_RANK; MASTER_ADDR and MASTER_PORT from the job script), or the plain
environment variables. Without WORLD_SIZE > 1 everything here is a no-op and the run is one process.
NCCL on GPUs, gloo on CPUs. The rendezvous has its own, short, timeout so that an unreachable
endpoint is a clear error in seconds instead of a hang.

A peer that dies or stops answering: every rank bumps a heartbeat counter in the rendezvous store
once a second (a thread with its own connection). Collectives time out after
`cluster.collective_timeout_s`; work only rank 0 does (preparing data, writing a checkpoint) is
waited for through the store instead, for as long as rank 0's heartbeat goes on, so a long
checkpoint never trips the timeout. When a collective fails, `peer_failure` reads the counters to
name the rank that stopped, and a rank that stops on its own error posts the message first, so the
others can say what it was.
"""

from __future__ import annotations

import gc
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from hetforge.core.errors import HetforgeError
from hetforge.core.process import env_int, launch_world_size


class ClusterError(HetforgeError, RuntimeError):
    pass


# A peer whose heartbeat stood still this long is reported lost (or the collective timeout, if shorter).
PEER_SILENCE_S = 6.0
_reported = threading.Event()  # one line per process, whichever of the main thread and the watchdog is first


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_rank: int = 0
    host: str = "localhost"
    backend: str | None = None
    # Host values (step times, stop requests, plans) go over gloo even when gradients go over NCCL,
    # so that exchanging them never waits for the GPU's queue.
    host_group: object | None = None
    store: object | None = None  # the run's rendezvous store (prefixed by restart attempt)
    heartbeat: "Heartbeat | None" = None
    timeout_s: float = 1800.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str, rendezvous_timeout_s: float, collective_timeout_s: float) -> DistContext:
    world = launch_world_size()
    if world <= 1:
        return DistContext(host=os.uname().nodename)
    rank = env_int("RANK", "SLURM_PROCID")
    local_rank = env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    node_rank = env_int("GROUP_RANK", "SLURM_NODEID", default=0)
    if rank is None:
        raise ClusterError("WORLD_SIZE > 1 but no RANK (launch with torchrun or srun)")
    backend = "nccl" if device_type == "cuda" else "gloo"
    ctx = DistContext(rank, world, local_rank, node_rank, os.uname().nodename, backend)
    if dist.is_initialized():
        return ctx
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=collective_timeout_s)
    # Under torchrun the agent did the rendezvous (bounded by its --rdzv-conf join_timeout) and
    # hosts the store; otherwise rank 0 hosts it. Keys are prefixed with the restart attempt: after
    # a rank failure and a torchrun restart, peers must not find the dead workers' addresses.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    addr = os.environ.get("MASTER_ADDR")
    port = env_int("MASTER_PORT")
    if not addr or port is None:
        raise ClusterError(f"rank {rank} of {world}: set MASTER_ADDR and MASTER_PORT (or launch with torchrun)")
    hosting = rank == 0 and not agent_store
    if not hosting:
        _reach(addr, port, rendezvous_timeout_s, rank, world)
    try:
        store = dist.TCPStore(addr, port, world, is_master=hosting,
                              timeout=timedelta(seconds=rendezvous_timeout_s), wait_for_workers=not agent_store)
    except (RuntimeError, OSError) as err:  # DistNetworkError / DistStoreError are RuntimeErrors
        raise ClusterError(
            f"rank {rank} of {world} could not reach the rendezvous at {addr}:{port} within "
            f"{rendezvous_timeout_s:g}s ({err.__class__.__name__}); check MASTER_ADDR/MASTER_PORT, "
            f"that rank 0 is running, and firewalls"
        ) from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"hetforge/attempt_{attempt}"
    ctx.store, ctx.timeout_s = dist.PrefixStore(prefix, store), collective_timeout_s
    dist.init_process_group(backend, store=ctx.store, rank=rank, world_size=world, timeout=timeout)
    if backend == "nccl":
        ctx.host_group = dist.new_group(backend="gloo", timeout=timeout)
    ctx.store.set(f"host/{rank}", ctx.host)
    ctx.heartbeat = Heartbeat(addr, port, prefix, rank, world, min(PEER_SILENCE_S, collective_timeout_s))
    return ctx


def _reach(addr: str, port: int, timeout_s: float, rank: int, world: int) -> None:
    """Wait, quietly, until the rendezvous answers, for at most `timeout_s`: torch's store client
    retries for longer than its timeout and prints C++ stack frames for every failed try."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.2, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"rank {rank} of {world} could not reach the rendezvous at {addr}:{port} within {timeout_s:g}s "
                    f"({err.__class__.__name__}); check MASTER_ADDR/MASTER_PORT, that rank 0 is running, and "
                    f"firewalls") from None
            time.sleep(min(0.5, max(deadline - time.monotonic(), 0.0)))


class Heartbeat(threading.Thread):
    """Counts up `beat/RANK` in the store once a second, over a connection of its own, and watches
    everyone else's. A stopped, killed or cut-off rank stops counting; a busy one does not (the
    thread runs whenever the main thread waits in C++ or yields the GIL). A peer silent for
    `silence_s` (one that has not said it is done), or the store gone, is reported by `on_lost`
    from this thread: the main thread may be blocked in a collective that would wait much longer
    for the lost rank, and a signal's Python handler would not run before it returns."""

    INTERVAL_S = 1.0

    def __init__(self, addr: str, port: int, prefix: str, rank: int, world: int, silence_s: float):
        super().__init__(name="hetforge-heartbeat", daemon=True)
        self.rank, self.world, self.silence_s = rank, world, silence_s
        self.key = f"beat/{rank}"
        self.on_lost: Callable[[list[int] | None], None] | None = None
        self._stop_event = threading.Event()
        self.store = dist.PrefixStore(prefix, dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                                                            timeout=timedelta(seconds=30)))
        self.store.add(self.key, 1)
        self.start()

    def run(self) -> None:
        keys = [f"beat/{r}" for r in range(self.world)]
        seen = {r: (None, time.monotonic()) for r in range(self.world)}
        while not self._stop_event.wait(self.INTERVAL_S):
            try:
                self.store.add(self.key, 1)
                beats = [int(self.store.add(k, 0)) for k in keys]
                now = time.monotonic()
                silent = []
                for r, b in enumerate(beats):
                    if b != seen[r][0]:
                        seen[r] = (b, now)
                    elif b and r != self.rank and now - seen[r][1] > self.silence_s:  # (0: not started yet)
                        silent.append(r)
                if silent:
                    silent = [r for r in silent if not self.store.check([f"done/{r}"])]
            except Exception:  # the store's host is gone (rank 0's, where no launcher hosts it)
                silent = None
            if silent != [] and not self._stop_event.is_set() and self.on_lost is not None:
                self.on_lost(silent)
                return

    def stop(self) -> None:
        """This rank is done (it leaves; nobody is to report it), and the beats end."""
        self._stop_event.set()
        try:
            self.store.set(f"done/{self.rank}", "1")
        except Exception:
            pass


def _beats(store, world: int) -> list[int | None]:
    out: list[int | None] = []
    for r in range(world):
        try:
            out.append(store.add(f"beat/{r}", 0))
        except Exception:
            out.append(None)
    return out


def silent_ranks(ctx: DistContext, wait_s: float = 2.5 * Heartbeat.INTERVAL_S) -> list[int] | None:
    """Ranks whose heartbeat did not advance over `wait_s`; None when the store cannot be read."""
    try:
        first = _beats(ctx.store, ctx.world_size)
        time.sleep(wait_s)
        second = _beats(ctx.store, ctx.world_size)
    except Exception:
        return None
    if all(b is None for b in second):
        return None
    return [r for r, (a, b) in enumerate(zip(first, second)) if r != ctx.rank and (b is None or a == b)]


_COMM_FAILURE = re.compile(r"connection (reset|closed|refused)|broken pipe|timed out|socket timeout|gloo|nccl|"
                           r"unbound buffer|transport|aborted", re.IGNORECASE)


def is_comm_failure(err: BaseException) -> bool:
    """A collective that failed because a peer is gone or silent (not a bug of this rank)."""
    if isinstance(err, HetforgeError):
        return False
    dist_error = getattr(dist, "DistError", None)
    return (dist_error is not None and isinstance(err, dist_error)) or (
        isinstance(err, RuntimeError) and bool(_COMM_FAILURE.search(str(err))))


def post_error(ctx: DistContext, message: str) -> None:
    """Leave this rank's own error where the others look when they lose it."""
    if ctx.store is not None:
        try:
            ctx.store.set(f"error/{ctx.rank}", message)
        except Exception:
            pass


def _posted_errors(ctx: DistContext, store=None) -> dict[int, str]:
    store = store or ctx.store
    found = {}
    for r in range(ctx.world_size):
        try:
            if r != ctx.rank and store.check([f"error/{r}"]):
                found[r] = store.get(f"error/{r}").decode()
        except Exception:
            pass
    return found


def _host_of(ctx: DistContext, r: int, store=None) -> str:
    store = store or ctx.store
    try:
        return store.get(f"host/{r}").decode() if store.check([f"host/{r}"]) else "?"
    except Exception:
        return "?"


def peer_failure(ctx: DistContext, err: BaseException, step: int, resume_hint: str) -> ClusterError:
    """What to tell the user when a collective failed: which rank (and host) was lost or went
    silent, at which step, and how to go on; one line."""
    _reported.set()  # the heartbeat's watchdog leaves this one to the main thread
    timed_out = bool(re.search(r"timed out|timeout", str(err), re.IGNORECASE))
    me = f"rank {ctx.rank} ({ctx.host})"
    posted = _posted_errors(ctx)
    if posted:
        r, msg = min(posted.items())
        return ClusterError(f"{me}: rank {r} ({_host_of(ctx, r)}) stopped at step {step} with: {msg}")
    silent = silent_ranks(ctx)
    if silent is None:
        what = "lost the rendezvous store (rank 0's or the launcher's node is gone)"
    elif silent:
        names = ", ".join(f"rank {r} ({_host_of(ctx, r)})" for r in silent)
        what = (f"{names} stopped answering for {ctx.timeout_s:g}s (cluster.collective_timeout_s)" if timed_out
                else f"lost {names}")
    else:
        what = ("a collective timed out after "
                f"{ctx.timeout_s:g}s (cluster.collective_timeout_s) though every rank is alive" if timed_out
                else f"a peer closed its connection ({' '.join(str(err).split())[:120]})")
    return ClusterError(f"{me}: {what} at step {step}; {resume_hint}")


def watch_peers(ctx: DistContext, where: Callable[[], tuple[int, str]]) -> None:
    """Let the heartbeat report a lost peer itself: one line, as `peer_failure` words it, then this
    process exits (status 2) so that the launcher can restart the job. `where()`: the step now and
    how to resume."""
    hb = ctx.heartbeat
    if hb is None:
        return

    def lost(silent: list[int] | None) -> None:
        if _reported.is_set():
            return
        _reported.set()
        step, hint = where()
        me = f"rank {ctx.rank} ({ctx.host})"
        posted = _posted_errors(ctx, hb.store) if silent is not None else {}
        if posted:
            r, msg = min(posted.items())
            line = f"{me}: rank {r} ({_host_of(ctx, r, hb.store)}) stopped at step {step} with: {msg}"
        elif silent is None:
            line = f"{me}: lost the rendezvous store at step {step} (rank 0's node is gone); {hint}"
        else:
            names = ", ".join(f"rank {r} ({_host_of(ctx, r, hb.store)})" for r in silent)
            why = " (cluster.collective_timeout_s)" if hb.silence_s >= ctx.timeout_s else ""
            line = f"{me}: {names} stopped answering for {hb.silence_s:g}s{why} at step {step}; {hint}"
        print(f"error: {line}", file=sys.stderr, flush=True)
        os._exit(2)

    hb.on_lost = lost


def wait_for_main(ctx: DistContext, key: str, what: str) -> str:
    """Wait until rank 0 posts `key` (the outcome of work only it does), for as long as its
    heartbeat goes on; its value. A silent rank 0 is an error after the collective timeout."""
    if ctx.rank == 0:
        raise ValueError("rank 0 posts, it does not wait")
    last, since = None, time.monotonic()
    while True:
        try:
            if ctx.store.check([key]):
                return ctx.store.get(key).decode()
            if ctx.store.check(["error/0"]):
                raise ClusterError(f"rank {ctx.rank} ({ctx.host}): rank 0 ({_host_of(ctx, 0)}) stopped while "
                                   f"{what}: {ctx.store.get('error/0').decode()}")
            beat = ctx.store.add("beat/0", 0)
        except ClusterError:
            raise
        except Exception:
            raise ClusterError(f"rank {ctx.rank} ({ctx.host}): lost the rendezvous store while rank 0 was {what}") from None
        if beat != last:
            last, since = beat, time.monotonic()
        elif time.monotonic() - since > ctx.timeout_s:
            raise ClusterError(f"rank {ctx.rank} ({ctx.host}): rank 0 ({_host_of(ctx, 0)}) stopped answering for "
                               f"{ctx.timeout_s:g}s while {what} (cluster.collective_timeout_s)")
        time.sleep(0.1)


def post(ctx: DistContext, key: str, value: str) -> None:
    ctx.store.set(key, value)


def shutdown(ctx: DistContext | None = None) -> None:
    """Stop the heartbeat, destroy every group, and free the host group's object now: left to the
    interpreter's finalization, a gloo group's destructor can meet its worker threads' tensors
    there and abort the process ("terminate called without an active exception", seen once in a
    killed-rank restart test under load), after a run that had finished."""
    if ctx is not None and ctx.heartbeat is not None:
        ctx.heartbeat.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    if ctx is not None and ctx.host_group is not None:
        ctx.host_group = None
        gc.collect()


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def all_gather_rows(ctx: DistContext, row: torch.Tensor) -> torch.Tensor:
    """(world, len(row)) float64 tensor of every rank's row, on CPU, over the host group."""
    row = row.detach().to(torch.float64).flatten().cpu()
    if not ctx.distributed:
        return row.unsqueeze(0)
    out = [torch.empty_like(row) for _ in range(ctx.world_size)]
    dist.all_gather(out, row, group=ctx.host_group)
    return torch.stack(out)


def all_gather_object(ctx: DistContext, obj):
    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.host_group)
    return out


def broadcast_object(ctx: DistContext, obj):
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=ctx.host_group)
    return box[0]
