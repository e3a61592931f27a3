"""The processes of a tensor-parallel target: rank 0 (the service) and N-1 supervised workers.

    rank 0 (the verifier process)                  worker rank r (python -m specsplit.parallel.worker)
    TPGroup.launch: start N-1 workers  ----------> read ("init", cfg, spec, ...) from its socket
    init_process_group (gloo | nccl)   <---------> init_process_group
    build_rank: load, shard, profile, size  <----> build_rank (the same, in step)
    serve: every model forward first sends  ----->  loop: recv ("forward", ids, meta) -> the same
           (input_ids, BatchMetadata)                     forward on its shard and its own KV cache
    close: ("stop"), wait, kill             ----->  exit

Commands go over a socketpair per worker (pickled), not over torch.distributed: a worker waits
for the next forward for as long as the service is idle, with no collective timeout to hit, and
sees EOF when rank 0 goes away. The forwards' collectives use a process group with a short
timeout (SPECSPLIT_TP_TIMEOUT, default 4 s) so that nothing hangs in a collective when a peer dies.

Failure and shutdown:
* a supervisor thread polls the workers; one that exits marks the group failed (`failed` holds
  the reason) and calls the `on_failure` callbacks (the verifier turns NOT_SERVING and answers
  UNAVAILABLE); a forward in flight fails when its collective sees the peer gone (or times out).
* close() (service stop, atexit, test teardown) stops the workers: a stop command, then SIGKILL
  after a grace period. Workers also die with rank 0: PR_SET_PDEATHSIG(SIGKILL), and EOF on the
  command socket.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading and profiling: ranks may be minutes apart
COLLECTIVE_TIMEOUT_ENV = "SPECSPLIT_TP_TIMEOUT"


def collective_timeout() -> float:
    return float(os.environ.get(COLLECTIVE_TIMEOUT_ENV) or 4.0)


def backend_for(device: str) -> str:
    # NCCL on CUDA is written but NOT TESTED (no GPU where this was developed); gloo on the CPU is.
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _send(conn: Connection, msg) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())


class TPWorkerFailed(RuntimeError):
    """A tensor-parallel worker died or the group broke; the service cannot run forwards."""


def _store(port: int, rank: int, world: int) -> dist.TCPStore:
    """The rendezvous store (rank 0 serves it, on `port` 0: a free port it binds itself, read back
    as store.port and sent to the workers). Rank 0 does not block here: it waits for the workers
    in TPGroup._wait_for_workers, where it can see one die."""
    return dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
                         wait_for_workers=False)


def init_groups(backend: str, store: dist.TCPStore, rank: int, world: int):
    """(startup group: the default one, long timeout; compute group: short timeout, for forwards)."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    compute = dist.new_group(list(range(world)), timeout=timedelta(seconds=collective_timeout()), backend=backend)
    return dist.group.WORLD, compute


class TPGroup:
    """Rank 0's handle on the workers: launch, supervise, drive forwards, close."""

    def __init__(self, world: int):
        self.world = world
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.failed: str | None = None
        self.on_failure: list = []
        self.closed = False
        self.loaded = None  # rank 0's LoadedModel (its config is rank 0's shard's)
        self._lock = threading.Lock()
        self._watch: threading.Thread | None = None

    # ---- start-up ---------------------------------------------------------------------------
    @classmethod
    def launch(cls, cfg, spec, world: int, threads: int = 0, show_progress: bool = False):
        """Start the workers and build rank 0: returns (group, engine, plan)."""
        from specsplit.parallel.build import build_rank

        group = cls(world)
        ref = weakref.ref(group)  # atexit must not keep a closed group (and its model) alive
        atexit.register(lambda: ref() is not None and ref().close())
        backend = backend_for(cfg.device)
        store = _store(0, 0, world)
        port = store.port
        try:
            for rank in range(1, world):
                parent, child = socket.socketpair()
                proc = subprocess.Popen([sys.executable, "-m", "specsplit.parallel.worker", str(child.fileno())],
                                        pass_fds=[child.fileno()], close_fds=True)
                child.close()
                conn = Connection(parent.detach())
                _send(conn, ("init", cfg, spec, rank, world, port, threads, logging.getLogger().level))
                group.procs.append(proc)
                group.conns.append(conn)
            group._start_watch()
            group._wait_for_workers(store)
            startup, compute = init_groups(backend, store, 0, world)
            engine, plan, group.loaded = build_rank(cfg, spec, 0, world, startup, compute, show_progress)
        except BaseException:
            group.close()
            raise
        if group.failed:
            group.close()
            raise TPWorkerFailed(group.failed)
        engine.runner.model.driver = group
        engine.tensor_parallel = group
        if spec.k_policy == "auto" and spec.num_speculative_tokens > 0:
            # Timed across the group: rank 0 drives every calibration forward on all ranks.
            from specsplit.calibration import calibrate_verifier

            try:
                engine.step_costs = calibrate_verifier(engine.runner, spec.num_speculative_tokens, cfg.max_num_seqs)
            except BaseException:
                group.close()
                raise
        log.info("tensor parallel: %d ranks (%s), workers %s", world, backend, [p.pid for p in group.procs])
        return group, engine, plan

    def _wait_for_workers(self, store: dist.TCPStore) -> None:
        """Until every worker has reached the store; a worker that exits first fails the start-up
        at once (instead of a rendezvous timeout minutes later)."""
        keys = [f"worker{rank}" for rank in range(1, self.world)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not store.check(keys):
            if self.failed:
                raise TPWorkerFailed(f"tensor-parallel start-up failed: {self.failed}")
            if time.monotonic() > deadline:
                raise TPWorkerFailed(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f}s")
            time.sleep(0.05)

    def _start_watch(self) -> None:
        self._watch = threading.Thread(target=self._supervise, name="tp-supervisor", daemon=True)
        self._watch.start()

    def _supervise(self) -> None:
        while not self.closed and self.failed is None:
            for rank, proc in enumerate(self.procs, start=1):
                rc = proc.poll()
                if rc is not None and not self.closed:
                    self._fail(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {rc}")
                    return
            time.sleep(0.1)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failed is not None:
                return
            self.failed = reason
        log.error("%s; the target cannot run forwards any more", reason)
        for cb in list(self.on_failure):
            try:
                cb(reason)
            except Exception:  # a callback must not stop the others
                log.exception("tensor-parallel failure callback failed")

    # ---- serving ----------------------------------------------------------------------------
    def check(self) -> None:
        if self.failed is not None:
            raise TPWorkerFailed(self.failed)

    def forward_started(self, input_ids: torch.Tensor, meta) -> None:
        """Rank 0's model is about to run a forward: every worker runs the same one."""
        self.check()
        msg = pickle.dumps(("forward", input_ids, meta), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(msg)
            except OSError as e:
                self._fail(f"tensor-parallel worker rank {rank} is gone ({e})")
                raise TPWorkerFailed(self.failed) from e

    # ---- shutdown ---------------------------------------------------------------------------
    def close(self, grace_s: float = 5.0) -> None:
        """Stop every worker (stop command, then SIGKILL after grace_s) and the process group."""
        if self.closed:
            return
        self.closed = True
        self.loaded = None
        for conn in self.conns:
            try:
                _send(conn, ("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group: the workers are gone either way
                pass


_COLLECTIVE_ERRORS = ("gloo", "Gloo", "NCCL", "Connection", "connection", "Timed out", "timed out", "peer")


def is_group_failure(group: TPGroup, error: BaseException, wait_s: float = 1.0) -> bool:
    """Whether `error` (raised by a forward on rank 0) means the group is broken: a dead worker, a
    collective that failed or timed out. Such an error marks the group failed for good."""
    if isinstance(error, TPWorkerFailed) or group.failed:
        return True
    dist_error = getattr(dist, "DistError", ())
    if not (isinstance(error, dist_error) or (isinstance(error, RuntimeError)
                                              and any(m in str(error) for m in _COLLECTIVE_ERRORS))):
        return False
    deadline = time.monotonic() + wait_s  # the supervisor usually names the dead worker first
    while group.failed is None and time.monotonic() < deadline:
        time.sleep(0.05)
    group._fail(f"a tensor-parallel collective failed ({type(error).__name__}: {error})")
    return True


# ---- the worker process -----------------------------------------------------------------------


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: EOF on the command socket still ends the worker
        pass


def worker_main(fd: int) -> int:
    _die_with_parent()
    parent = os.getppid()
    conn = Connection(fd)
    _, cfg, spec, rank, world, port, threads, level = _recv(conn)
    logging.basicConfig(level=level or logging.WARNING, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(name)s: %(message)s")
    if os.getppid() != parent:  # rank 0 died before PDEATHSIG was set
        return 1
    if threads:
        torch.set_num_threads(threads)
    from specsplit.parallel.build import build_rank

    store = _store(port, rank, world)
    store.set(f"worker{rank}", "1")
    startup, compute = init_groups(backend_for(cfg.device), store, rank, world)
    engine, _, _ = build_rank(cfg, spec, rank, world, startup, compute)
    model, kv = engine.runner.model, engine.runner.kv
    log.info("tensor-parallel worker rank %d/%d ready (pid %d)", rank, world, os.getpid())
    while True:
        try:
            msg = _recv(conn)
        except (EOFError, OSError):
            return 0  # rank 0 is gone
        if msg[0] == "stop":
            break
        _, input_ids, meta = msg
        model(input_ids, meta, kv)  # the collectives pair with rank 0's forward
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0
