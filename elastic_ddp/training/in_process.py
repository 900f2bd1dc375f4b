"""A worker's side of re-forming the process group in process when a node is lost or joins (issue 44).

torchrun ends every worker of every node when the membership changes, and starts new ones. With our
rendezvous (`--rdzv_backend elastic-c10d` or `etcd-v3`, `--rdzv_conf in_process=1`, the default), a
worker whose process group broke because a peer died keeps its process instead:

1. `ElasticRun` catches the broken collective where the run owns the call (the gradients'
   all-reduce in `step.backward`, the drain vote at a step boundary, the run's own work after a
   commit, and DDP's own collectives in its forward: `InterruptibleDDP`; `lost_peer`), abandons
   the step in progress and stops its watchdog. A rank whose collective waits on a neighbour
   that left rather than died sees no error from gloo: its
   collectives are waited for through `BrokenGroupAlarm`, which fails them once the agent
   announces a newer round.
2. `Regroup.rejoin` asks this node's agent for a new round (`round_handoff.request_reform`),
   destroys the broken group, and waits for the agent's answer: the round the survivors' handlers
   ran for their workers (agent/rendezvous/handler.py), or a refusal (then the worker ends as
   before, keeping its last committed step in node memory on the way out, and torchrun restarts
   it: the fallback).
3. It rewrites RANK, WORLD_SIZE, GROUP_RANK, ... and MASTER_ADDR/MASTER_PORT from the round, and
   initialises the default group on the round's fresh port (env://; the new rank 0 hosts its
   store); `ElasticRun` closes the old incarnation and opens one on the new group: every survivor
   holding the same committed step keeps its own state (`SnapshotSession.resume_live`; else they
   restore as after a restart), a new DDP, and the steps go on from the last committed one.

A node that joins is let in the same way: its torchrun arrives at the next round, the running
agents take that round in process, and each running worker switches at its next step boundary
(`Regroup.replaced`), its step committed: every rank of the new group then restores as after a
restart (the survivors' kept step is the newest; the newcomers' fresh workers receive it).

A frozen or cut-off peer raises nothing: the peer watchdog finds it silent and, when its store
answered that read (this node is not the one cut off) and one of the run's collectives waits
through `BrokenGroupAlarm` (the training thread is blocked where the alarm can end it), asks the agent for a round without it instead of ending the worker
(`Regroup.ask_for_round`, from the watchdog's thread; the verdict it sent first lets the agents
leave the node out at once); that collective then fails once the round is announced, and the
worker re-forms as above. gloo cannot abort it: it stays in gloo's thread until its timeout, in
the old group, which is kept referenced. Blocked elsewhere (a snapshot's collective, the loop's
own), the worker ends the watchdog's way, as does one whose training thread does not begin the
re-form within the watchdog's deadline (training/stop_guard.py).

Under `--sharding fsdp` FSDP2's own collectives go through the alarm the same way
(`InterruptibleFSDPCollectives`; the reduce-scatter as an all-reduce, whose gloo work has a
future); a re-form keeps each rank's parts in its node's memory, builds the model again over the
new group (its classes from a copy taken before it was first sharded, training/sharding.py), the
optimizer and schedule from their factories, and restores the last committed step as after a
restart (the parts resharded from the nodes' memory).

When it applies (`Regroup.start` says why not, in one log line): the agent published a round for
its workers (our rendezvous with `in_process=1`, which sets ELASTIC_DDP_IN_PROCESS=1), gloo, DDP
or `--sharding fsdp` with a model the run could copy, a process group. Not re-formed in process:
a failure in the loop's own code (its model's own collectives, its own all-reduces), a step that
broke again right after a re-form (no re-form loop on a bug), a node lost while the new group
forms (rank 0's store waits for it until the group's timeout). Each ends in torchrun's restart
with the last committed step kept.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_ddp.handoff import rounds as round_handoff
from elastic_ddp.handoff.rounds import IN_PROCESS_ENV, RoundAnnouncement
from elastic_ddp.runtime.distributed import (
    DistributedContext,
    agent_pid,
    destroy_default_group,
    end_worker_now,
    init_default_group,
    keep_until_exit,
)

logger = logging.getLogger(__name__)

# How long a worker waits for its agent's round and the new group, at most, before it ends itself
# (the agent's own bound on its round is 10 s; init and the first collective come after it).
REJOIN_DEADLINE_S = 30.0
ROUND_WAIT_S = 20.0  # for the agent's answer, then the restart takes over (the agent's own bound is 10 s)
ROUND_POLL_S = 0.005
# The exit code of a worker whose re-form hung past the deadline: a failure, torchrun restarts it.
REJOIN_TIMED_OUT_EXIT_CODE = 1
ALARM_POLL_S = 0.01  # how often a worker waiting on a collective looks for the agent's next round
# What a collective that the agent's next round made pointless fails with (`BrokenGroupAlarm`).
REPLACED_GROUP = "elastic_ddp: the agent re-formed the group while this collective waited"
# What gloo's TCP transport says when a peer's process is gone (docs/design/in-process-regroup.md): it
# raises a plain RuntimeError, so the message is what tells a lost peer from a bug.
_LOST_PEER_MARKS = ("gloo/transport/tcp", "by peer", REPLACED_GROUP)


class RejoinRefused(RuntimeError):
    """The agent could not re-form the group in process; torchrun restarts the workers."""


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc`, raised by a collective, says that a peer of the group is gone."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(mark in str(exc) for mark in _LOST_PEER_MARKS)


def what_broke(exc: BaseException) -> str:
    """`exc`'s message, short: gloo's own words, without the future's wrapping or its advice."""
    message = str(exc).split("RuntimeError: ")[-1].split(". This is typically")[0]
    return (message.splitlines()[0] if message else type(exc).__name__)[:200]


class BrokenGroupAlarm:
    """Fails the run's collectives still waiting in a group that the agent's next round leaves
    (`Regroup.abandons_the_group`: a node of the group is not in it, or the workers restart); a
    round that only adds nodes lets every collective of the step finish, and the group switches at
    its next step boundary, with every rank at the same step.

    A rank whose collective waits on a peer that is alive (a neighbour in gloo's ring that failed
    and left) sees no error until the collective's timeout: only the lost node's neighbours do, and
    the group's connections close only when it is freed, which itself waits for its collectives.
    So the run's collectives (the gradients' all-reduce through a DDP comm hook, the drain vote)
    go through `guard`: while one waits, a thread looks every ALARM_POLL_S at the round the agent
    announces, and once it leaves this worker's group it fails them with REPLACED_GROUP;
    the worker then re-forms as its neighbours do. The abandoned collective stays in gloo's thread
    until its timeout (the group is kept referenced, never freed while it waits)."""

    def __init__(self, regroup: Regroup):
        self._regroup = regroup
        self._also: Callable[[], bool] = lambda: False
        self._waiting: set[torch.futures.Future] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def guard(self, collective: torch.futures.Future, first: bool = False) -> torch.futures.Future:
        """A future with `collective`'s result (`first`: the first item of it, as a list of tensors
        holds an all-reduce's), or REPLACED_GROUP once the agent announced a newer round."""
        guarded: torch.futures.Future = torch.futures.Future()

        def forward(done: torch.futures.Future) -> None:
            with self._lock:  # whoever takes it out of the waiting set completes it: this, or the alarm
                if guarded not in self._waiting:
                    return
                self._waiting.discard(guarded)
            try:
                value = done.value()
            except Exception as exc:  # noqa: BLE001 - the collective's own error, handed on as it is
                guarded.set_exception(exc)
                return
            guarded.set_result(value[0] if first else value)

        with self._lock:
            self._waiting.add(guarded)
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="elastic-ddp-group-alarm", daemon=True)
            self._thread.start()
        collective.add_done_callback(forward)
        return guarded

    def also_when(self, condition: Callable[[], bool]) -> None:
        """Fail the waiting collectives also once `condition()` (polled from the alarm's thread) holds:
        the run's word that a peer left the group for the next round before this step."""
        self._also = condition

    def waiting(self) -> bool:
        """Whether a collective of the run's waits through this alarm now."""
        with self._lock:
            return bool(self._waiting)

    def _watch(self) -> None:
        # A poll, not a wake-up per collective: a thread woken at every step costs the step a
        # thread switch (docs/benchmarks.md, "Steady state and memory").
        while True:
            time.sleep(ALARM_POLL_S)
            if not self._waiting or not (self._regroup.abandons_the_group() or self._also()):
                continue
            with self._lock:
                waiting, self._waiting = self._waiting, set()
            for future in waiting:
                future.set_exception(RuntimeError(REPLACED_GROUP))


class InterruptibleCommHook:
    """The comm hook of every DDP the run builds while it can re-form in process: the loop's own
    hook (`register`, which takes the place of that DDP's `register_comm_hook`: DDP takes one hook
    only) or DDP's default all-reduce (each bucket divided by the world size, then summed: the same
    numbers), its future waited for through `alarm`. The loop's hook carries over to the DDP of a
    re-formed group, so its state must not hold a process group (pass None: the default group of
    the moment is used); one bound to the group it was registered in fails after a re-form."""

    def __init__(self, alarm: BrokenGroupAlarm):
        self.alarm = alarm
        self.loops_hook: tuple[object, Callable[[object, dist.GradBucket], torch.futures.Future]] | None = None
        self._group: dist.ProcessGroup | None = None  # the default group of the DDP installed last
        self._world_size = 1

    def install(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Hook `ddp`, a DDP of the default group of the moment (each re-form builds a new one)."""
        self._group, self._world_size = dist.group.WORLD, dist.get_world_size()
        ddp.register_comm_hook(self, _interruptible_hook)
        ddp.register_comm_hook = self.register  # the loop's hook goes through this one

    def register(self, state: object, hook: Callable[[object, dist.GradBucket], torch.futures.Future]) -> None:
        """What `run.model.register_comm_hook(state, hook)` does: `hook` runs in place of the default
        all-reduce, in this DDP and every later one. Once, as DDP allows."""
        if self.loops_hook is not None:
            raise RuntimeError("register_comm_hook: a comm hook is registered already; DDP takes one")
        self.loops_hook = (state, hook)

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self.loops_hook is not None:
            state, hook = self.loops_hook
            return self.alarm.guard(hook(state, bucket))
        tensor = bucket.buffer()
        tensor.div_(self._world_size)
        # The group's own call, as DDP's C++ hook makes it (dist.all_reduce adds its Python checks and logging).
        return self.alarm.guard(self._group.allreduce([tensor]).get_future(), first=True)


class InterruptibleDDP(DistributedDataParallel):
    """DDP whose own collectives in its forward give way to an in-process re-form.

    - The module's buffers (BatchNorm's statistics) are broadcast from rank 0 before a forward, when
      DDP's own `forward_sync_buffers` would, but by this class (DDP's is switched off), asynchronously
      and waited for through `alarm`: a rank whose neighbour left rather than died sees no error
      from gloo, and the alarm fails the wait once the agent announces the next round.
    - A lost peer there, or in DDP's rebuild of its buckets (the second forward of every DDP), is
      handed to `absorbs`, the run's (`lost_peer` and its own rules); when it takes it, the step in
      progress is abandoned and the forward runs on the module alone, so that the loop's body goes
      on to `step.backward` and the commit, which do nothing for an abandoned step.

    Anything else propagates, as does an error of that local forward (a model with collectives of
    its own, SyncBatchNorm's, on the broken group). Not guaranteed: the buckets' rebuild is one
    blocking call of DDP's; a rank waiting in it on a neighbour that left waits for the group's
    timeout (its watchdog ends it sooner), and the restart takes over."""

    def __init__(self, module: torch.nn.Module, alarm: BrokenGroupAlarm, absorbs: Callable[[RuntimeError], bool],
                 **kwargs):
        super().__init__(module, forward_sync_buffers=False, **kwargs)
        self._alarm = alarm
        self._absorbs = absorbs
        self._has_buffers = any(True for _ in module.buffers())  # (walking the modules costs every forward)

    def forward(self, *inputs, **kwargs):
        try:
            if self._has_buffers and self.require_forward_param_sync:  # when DDP itself would broadcast them
                self._broadcast_buffers()
            return super().forward(*inputs, **kwargs)
        except RuntimeError as exc:
            if not self._absorbs(exc):
                raise
        return self.module(*inputs, **kwargs)

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank, one broadcast per dtype and device."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for buffer in self.module.buffers():
            groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        for buffers in groups.values():
            flat = torch.cat([buffer.reshape(-1) for buffer in buffers])
            self._alarm.guard(dist.broadcast(flat, src=0, async_op=True).get_future()).wait()
            if dist.get_rank() != 0:
                offset = 0
                for buffer in buffers:
                    buffer.copy_(flat[offset:offset + buffer.numel()].view_as(buffer))
                    offset += buffer.numel()


class _GuardedWork:
    """What FSDP2 waits on for one of its collectives: the collective's future through the alarm (or
    nothing, for one not issued: the group broke before it). A lost peer is handed to `absorbs`;
    when it takes it, the wait returns and the output holds garbage (the step is abandoned)."""

    def __init__(self, future: torch.futures.Future | None, absorbs: Callable[[str, RuntimeError], bool], what: str):
        self._future, self._absorbs, self._what = future, absorbs, what

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the collective (at most `timeout`: then TimeoutError, as a c10d work's wait
        raises on its timeout; FSDP2 itself passes none)."""
        if self._future is not None:
            if timeout is not None and not _done_within(self._future, timeout.total_seconds()):
                raise TimeoutError(f"{self._what}: not done within {timeout.total_seconds():g} s")
            try:
                self._future.wait()
            except RuntimeError as exc:
                if not self._absorbs(self._what, exc):
                    raise
        return True


def _done_within(future: torch.futures.Future, seconds: float) -> bool:
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    return done.wait(seconds)


class InterruptibleFSDPCollectives:
    """FSDP2's all-gather and reduce-scatter for a run that can re-form in process, installed on each
    of its FSDP modules through FSDP2's public `set_custom_all_gather` and `set_custom_reduce_scatter`
    (`install`): the same calls as FSDP2's defaults (`all_gather_single`, `reduce_scatter_single`),
    always issued asynchronously and waited for through `alarm`, so that a rank waiting on a
    neighbour that left is freed once the agent announces the next round. A lost peer (gloo's
    error, or the alarm) is handed to `absorbs(what, error)`, the run's; when it takes it, FSDP2's
    forward or backward goes on with garbage in the collective's output, and no further collective
    is issued (`broken()`): the step is abandoned, and the module is rebuilt for the next group
    (training/sharding.py `rebuilt`). Anything else propagates."""

    def __init__(self, alarm: BrokenGroupAlarm, absorbs: Callable[[str, RuntimeError], bool],
                 broken: Callable[[], bool]):
        self.all_gather = _FSDPCollective(self, "FSDP's all-gather", dist.all_gather_single)
        self.reduce_scatter = _FSDPCollective(self, "FSDP's reduce-scatter", _reduce_scatter_as_all_reduce)
        self.alarm, self.absorbs, self.broken = alarm, absorbs, broken

    def install(self, model: torch.nn.Module) -> None:
        """On every FSDP module of `model`. ValueError where FSDP2 refuses a custom collective (a
        module with several parameter groups)."""
        from torch.distributed.fsdp import FSDPModule  # (FSDP2's import costs every DDP worker 0.7 s)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(self.all_gather)
                module.set_custom_reduce_scatter(self.reduce_scatter)


def _reduce_scatter_as_all_reduce(output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                                  group: dist.ProcessGroup | None = None, async_op: bool = False) -> dist.Work:
    """`reduce_scatter_single`'s result, through an all-reduce of `input` (which it overwrites): gloo's
    reduce-scatter work has no future to wait on through the alarm (torch 2.13: "Work::getFuture not
    implemented"), its all-reduce's has. The all-reduce moves twice the bytes; this rank's part of
    the sum is copied into `output` once it is done."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    work = dist.all_reduce(input, op=op, group=group, async_op=True)

    def copy_out(done: torch.futures.Future) -> torch.Tensor:
        done.value()  # (its error, if any, is the future's)
        output.copy_(input.view(world_size, -1)[rank].view_as(output))
        return output

    return _WorkOfFuture(work.get_future().then(copy_out))


class _WorkOfFuture:
    """A future as what `_FSDPCollective` issues: something with `get_future`."""

    def __init__(self, future: torch.futures.Future):
        self._future = future

    def get_future(self) -> torch.futures.Future:
        return self._future


class _FSDPCollective:
    """One of `InterruptibleFSDPCollectives`' two: FSDP2's `Comm` interface (`allocate`, then the call)."""

    def __init__(self, collectives: InterruptibleFSDPCollectives, what: str, call: Callable[..., dist.Work]):
        self._collectives, self._what, self._call = collectives, what, call

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 *args, async_op: bool = False, **kwargs) -> _GuardedWork | None:
        collectives = self._collectives
        future = None
        if not collectives.broken():
            try:
                work = self._call(output_tensor, input_tensor, *args, group=group, async_op=True, **kwargs)
            except RuntimeError as exc:  # (gloo may refuse at once a pair it knows broken)
                if not collectives.absorbs(self._what, exc):
                    raise
            else:
                future = collectives.alarm.guard(work.get_future())
        waiting = _GuardedWork(future, collectives.absorbs, self._what)
        if async_op:
            return waiting
        waiting.wait()
        return None


def _interruptible_hook(hook: InterruptibleCommHook, bucket: dist.GradBucket) -> torch.futures.Future:
    return hook(bucket)


# DDP checks a hook's annotations against the classes themselves; `from __future__ import
# annotations` made them strings.
_interruptible_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


class Regroup:
    """This worker's re-forms. `enabled` once `start` found everything it needs."""

    def __init__(self, context: DistributedContext, timeout: timedelta, not_in_process: str | None = None):
        """`not_in_process`: why the run cannot re-form in process, if it knows (its model cannot be
        rebuilt); then `start` says so and the worker takes torchrun's restart."""
        self.context = context
        self.timeout = timeout
        self.not_in_process = not_in_process
        self.enabled = False
        self.round: int | None = None  # the round this worker's group belongs to
        self.nodes = 0  # the nodes of that round
        self.joined = 0  # nodes new to the group in the last re-form (RoundAnnouncement.joined)
        self.alarm = BrokenGroupAlarm(self)
        self.comm_hook = InterruptibleCommHook(self.alarm)
        self._agent = 0
        self._seen_round_file: tuple[int, int] | None = None  # (inode, mtime) of round.json read last

    def replaced(self) -> bool:
        """Whether the agent announced a round after this worker's group (not a collective). Cheap
        enough for every step boundary: round.json is read only when it changed (the agent
        replaces it whole: a new inode)."""
        return self._newer_round() is not None

    def abandons_the_group(self) -> bool:
        """Whether the agent announced a round that ends this worker's group where it stands: one
        without some of its nodes (lost or silent), or the workers' restart. A round that only
        adds nodes (a join) does not: the group finishes its step and switches at the boundary
        (failing a collective of a healthy group could let some ranks commit the step and others not)."""
        announced = self._newer_round()
        return announced is not None and (not announced.in_process
                                          or announced.group_world_size - announced.joined < self.nodes)

    def _newer_round(self) -> RoundAnnouncement | None:
        if not self.enabled or self.round is None:
            return None
        try:
            info = os.stat(round_handoff.handoff_directory(self._agent) / round_handoff.ROUND_FILE)
        except OSError:
            return None
        if (info.st_ino, info.st_mtime_ns) == self._seen_round_file:
            return None
        announced = round_handoff.read_round(self._agent)
        if announced is not None and announced.round > self.round:
            return announced
        self._seen_round_file = (info.st_ino, info.st_mtime_ns)  # nothing newer in it: not read again
        return None

    def start(self) -> None:
        """Declare this worker able to re-form in process, or log once why it is not."""
        reason = self._why_not()
        if reason is not None:
            if os.environ.get(IN_PROCESS_ENV) == "1":
                logger.info("a lost node restarts this worker (no in-process re-form): %s", reason)
            return
        try:
            round_handoff.declare_capable(self._agent, self.context.local_rank, self.context.local_world_size)
        except OSError as exc:
            logger.info("a lost node restarts this worker: the agent's handoff directory refused it (%s)", exc)
            return
        self.enabled = True

    def _why_not(self) -> str | None:
        if os.environ.get(IN_PROCESS_ENV) != "1":
            return "the rendezvous does not re-form in process (torch's own backend, or --rdzv_conf in_process=0)"
        if not self.context.in_process_group:
            return "no process group"
        if self.context.backend != "gloo":
            return f"the {self.context.backend} backend (only gloo re-forms in process so far)"
        if self.not_in_process is not None:
            return self.not_in_process
        self._agent = agent_pid()
        announced = round_handoff.read_round(self._agent)
        if announced is None:
            return "the agent published no round for its workers"
        self.round, self.nodes = announced.round, announced.group_world_size
        return None

    def stop(self) -> None:
        """This worker no longer re-forms (it is leaving the run)."""
        if self.enabled:
            round_handoff.withdraw_capable(self._agent, self.context.local_rank)
            self.enabled = False

    def ask_for_round(self, reason: str) -> None:
        """Ask the agent for the round after this worker's group, which broke (`reason`). Errors as
        `round_handoff.request_reform`'s."""
        round_handoff.request_reform(self._agent, self.context.local_rank, self.round, reason)

    def rejoin(self, reason: str, stop_requested: Callable[[], bool]) -> DistributedContext:
        """Leave the broken group and join the round the agent runs for its workers; the new
        context, its default group initialised. `stop_requested` (SIGTERM: torchrun stops the
        workers) ends the wait. RejoinRefused when the agent falls
        back to a restart, or on SIGTERM. Ends the process (a failure) when the whole takes over
        REJOIN_DEADLINE_S: any step of it may hang on a peer lost in the meantime."""
        assert self.enabled and self.round is not None
        started = time.monotonic()
        timer = threading.Timer(REJOIN_DEADLINE_S, self._give_up)
        timer.daemon = True
        timer.start()
        try:
            if not self.replaced():  # (a join: the agent took the round already)
                self.ask_for_round(reason)
            # Never freed: freeing a broken gloo group waits for the collectives still in its threads
            # (a DDP keeps its group; a rebuilt FSDP model lets its old one go).
            keep_until_exit(dist.group.WORLD)
            destroy_default_group()
            announced = self._wait_for_round(started, stop_requested)
            if not announced.in_process:
                raise RejoinRefused(f"the agent restarts the workers instead: {announced.reason}")
            apply_round(announced, self.context.local_rank, self.context.local_world_size)
            context = DistributedContext.from_env(self.context.device.type, self.context.backend)
            self._form_group(context, stop_requested)
        finally:
            timer.cancel()
        self.context, self.round, self.joined = context, announced.round, announced.joined
        self.nodes = announced.group_world_size
        logger.info("re-formed in process as rank %d of %d (round %d, %d new node(s)) in %.2f s", context.rank,
                    context.world_size, announced.round, announced.joined, time.monotonic() - started)
        return context

    def _wait_for_round(self, started: float, stop_requested: Callable[[], bool]) -> RoundAnnouncement:
        while True:
            announced = round_handoff.read_round(self._agent)
            if announced is not None and announced.round > self.round:
                return announced
            if stop_requested():
                raise RejoinRefused("SIGTERM while waiting for the agent's round (torchrun stops the workers)")
            if time.monotonic() - started > ROUND_WAIT_S:
                raise RejoinRefused(f"no round from the agent within {ROUND_WAIT_S:g} s")
            time.sleep(ROUND_POLL_S)

    def _form_group(self, context: DistributedContext, stop_requested: Callable[[], bool]) -> None:
        """Initialise the new default group in a thread of its own while this one watches for
        SIGTERM: rank 0's store and gloo's connections wait for every rank of the round, and a rank
        that never comes (its workers ended otherwise: torchrun restarts them) would hold this
        worker, deaf to torchrun's SIGTERM, until the group's timeout. RejoinRefused on SIGTERM
        (the thread is left waiting; the worker ends)."""
        failed: list[BaseException] = []

        def form() -> None:
            try:
                init_default_group(context, self.timeout)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                failed.append(exc)

        forming = threading.Thread(target=form, name="elastic-ddp-form-group", daemon=True)
        forming.start()
        while forming.is_alive():
            forming.join(ROUND_POLL_S)
            if stop_requested():
                raise RejoinRefused("SIGTERM while the new group formed (torchrun stops the workers)")
        if failed:
            raise failed[0]

    def _give_up(self) -> None:
        logger.error("the in-process re-form did not end within %.0f s; ending this worker (torchrun restarts it); "
                     "where its threads are:", REJOIN_DEADLINE_S)
        faulthandler.dump_traceback(all_threads=True)  # to stderr: what held the re-form up
        end_worker_now(REJOIN_TIMED_OUT_EXIT_CODE)


def apply_round(announced: RoundAnnouncement, local_rank: int, local_world_size: int) -> None:
    """torchrun's variables of a worker of this node in `announced`'s round (in process), as torchrun
    would set them for a fresh worker: its global rank is the node's first rank (torch's assignment,
    which the agent announces) plus `local_rank`. ValueError when this node's `local_world_size`
    workers do not fit in the round's world from there."""
    first_rank, world_size = announced.first_rank, announced.world_size
    if first_rank is None or world_size is None or first_rank + local_world_size > world_size:
        raise ValueError(f"round {announced.round}: {local_world_size} worker(s) from rank {first_rank} do not fit "
                         f"in a world of {world_size}")
    os.environ.update({
        "RANK": str(first_rank + local_rank),
        "WORLD_SIZE": str(world_size),
        "GROUP_RANK": str(announced.group_rank),
        "GROUP_WORLD_SIZE": str(announced.group_world_size),
        "ROLE_RANK": str(first_rank + local_rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": announced.master_addr,
        "MASTER_PORT": str(announced.master_port),
    })
