"""One path trained across a machine's devices with data parallelism (``join --gpus ... --shard-path``).

The machine's workers form a ``torch.distributed`` group (NCCL on GPUs, gloo on CPUs). Rank 0 is
the peer: it claims tasks, fetches modules, draws each step's batch from the task's data slice,
keeps the path's inner state and pushes the deltas, exactly as a one-device peer does. The
other ranks (:func:`follow`) never talk to the coordinator: for each task rank 0 sends them the
model's shape, its parameters (through ``DistributedDataParallel``'s own broadcast when it wraps
the model) and the optimizer's state; for each step the global batch. Every rank trains its
contiguous share of the batch's rows; DDP averages the gradients, so each rank clips and steps
the same AdamW on the same gradient, and the replicas stay equal. The step is the step a single
process takes on the whole batch (the loss is a mean over equal-length windows): a test holds
the two within 1e-6.

Nothing crosses the group as a pickle: commands are int64 tensors, the model's settings and the
optimizer's non-tensor state are JSON, and tensors are broadcast as tensors.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dipaco.errors import ConfigError
from dipaco.model.optim import InnerSettings, make_optimizer, train_step
from dipaco.model.transformer import ModelConfig, PathModel
from dipaco.peer.training import PathTrainer, TaskRun, timed

QUIT, TASK, STEP = 0, 1, 2
TIMEOUT = datetime.timedelta(minutes=30)  # a rank waits this long for the others (a slow fetch)


@dataclass
class Group:
    """This process's place in the machine's group: rank, world size, and its device."""

    rank: int
    world: int
    device: str

    @classmethod
    def join(cls, init_method: str, rank: int, world: int, device: str) -> Group:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT
        )
        return cls(rank, world, device)

    def close(self, synchronise: bool = False) -> None:
        """Leave the group; with ``synchronise`` (a normal end, every rank alive) only once every
        rank got here, so that none tears its connections down under a rank still reading
        the last broadcast (gloo aborts that process)."""
        if dist.is_initialized():
            if synchronise:
                dist.barrier()
            dist.destroy_process_group()

    def share(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of a batch's rows (each rank the same number)."""
        if batch.shape[0] % self.world:
            raise ConfigError(
                f"a batch of {batch.shape[0]} windows does not split over {self.world} devices; "
                "use a number of devices that divides the run's batch size"
            )
        return batch.chunk(self.world, dim=0)[self.rank]

    # ---- what crosses the group -----------------------------------------------------------
    def command(self, values: list[int] | None = None) -> list[int]:
        """Rank 0 sends ``values`` (4 ints); the others receive them."""
        t = torch.zeros(4, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            assert values is not None
            t[: len(values)] = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(t, 0)
        return [int(v) for v in t.tolist()]

    def text(self, value: Any = None) -> Any:
        """A JSON value from rank 0 to all (length, then UTF-8 bytes as a uint8 tensor)."""
        data = json.dumps(value).encode() if self.rank == 0 else b""
        n = self.command([len(data)])[0]
        buf = torch.zeros(n, dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, 0)
        return json.loads(bytes(buf.cpu().tolist()))

    def tensor(self, t: torch.Tensor | None, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """``t`` (rank 0) or a received tensor of ``shape`` and ``dtype`` (the others)."""
        if self.rank == 0:
            assert t is not None
            t = t.to(self.device).contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(t, 0)
        return t


def broadcast_optimizer(group: Group, optimizer: torch.optim.Optimizer) -> None:
    """Make every rank's optimizer state rank 0's: its JSON skeleton, then its tensors."""
    tensors: list[torch.Tensor] = []
    skeleton = None
    if group.rank == 0:
        sd = optimizer.state_dict()
        layout: dict[str, dict[str, Any]] = {}  # parameter id (as JSON keys are) -> its entries
        for pid, entry in sd["state"].items():
            layout[str(pid)] = {}
            for k, v in entry.items():
                if isinstance(v, torch.Tensor):
                    layout[str(pid)][k] = {"shape": list(v.shape), "dtype": str(v.dtype)[6:]}
                    tensors.append(v)
                else:
                    layout[str(pid)][k] = {"value": v}
        skeleton = {"state": layout, "param_groups": sd["param_groups"]}
    skeleton = group.text(skeleton)
    sent = iter(tensors)
    state: dict[int, dict[str, Any]] = {}
    for pid, entry in skeleton["state"].items():
        state[int(pid)] = {}
        for k, v in entry.items():
            if "value" in v:
                state[int(pid)][k] = v["value"]
                continue
            ours = next(sent) if group.rank == 0 else None
            got = group.tensor(ours, v["shape"], getattr(torch, v["dtype"]))
            # AdamW keeps "step" on the CPU unless fused/capturable: keep each where it was.
            state[int(pid)][k] = got.cpu() if k == "step" and not got.is_cuda else got
    if group.rank != 0:
        optimizer.load_state_dict({"state": state, "param_groups": skeleton["param_groups"]})


def sharded_step(
    group: Group,
    model: torch.nn.Module,
    ddp: Callable[[torch.Tensor], torch.Tensor],  # the model in DistributedDataParallel
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    settings: InnerSettings,
    *,
    step: int,
    micro_batch: int | None = None,
    autocast: torch.dtype | None = None,
) -> torch.Tensor:
    """One inner step on this rank's share of ``batch`` (the global batch, the same on every
    rank); the global batch's mean loss, averaged over the ranks."""
    loss = train_step(
        model,
        optimizer,
        group.share(batch),
        settings,
        step=step,
        micro_batch=micro_batch,
        autocast=autocast,
        forward=ddp,
    )
    dist.all_reduce(loss)
    return loss / group.world


def start_task(
    group: Group, model: torch.nn.Module, optimizer, spec: dict
) -> DistributedDataParallel:
    """Rank 0, when a task's model and optimizer are ready: tell the others, wrap the model
    (DDP broadcasts rank 0's parameters), and send the optimizer's state."""
    group.command([TASK])
    group.text(spec)
    ddp = DistributedDataParallel(model)
    broadcast_optimizer(group, optimizer)
    return ddp


def send_step(group: Group, step: int, batch: torch.Tensor) -> torch.Tensor:
    """Rank 0: the step's number and global batch to the others."""
    group.command([STEP, step, *batch.shape])
    return group.tensor(batch, list(batch.shape), batch.dtype)


def follow(group: Group, on_task: Callable[[dict], None] | None = None) -> int:
    """A rank other than 0: train the tasks rank 0 leads until it says quit; the steps taken."""
    model: PathModel | None = None
    ddp: DistributedDataParallel | None = None
    optimizer: torch.optim.Optimizer | None = None
    settings: InnerSettings | None = None
    spec: dict[str, Any] = {}
    steps = 0
    while True:
        cmd = group.command()
        if cmd[0] == QUIT:
            return steps
        if cmd[0] == TASK:
            spec = group.text()
            model = PathModel(ModelConfig(**spec["model"])).to(group.device)
            model.train()
            settings = InnerSettings(**spec["settings"])
            ddp = DistributedDataParallel(model)
            optimizer = make_optimizer(model, settings)
            broadcast_optimizer(group, optimizer)
            if on_task is not None:
                on_task(spec)
        elif cmd[0] == STEP:
            if model is None or ddp is None or optimizer is None or settings is None:
                raise RuntimeError("rank 0 sent a step before a task")
            batch = group.tensor(None, cmd[2:4], torch.int64)
            sharded_step(
                group,
                model,
                ddp,
                optimizer,
                batch,
                settings,
                step=cmd[1],
                micro_batch=spec.get("micro_batch"),
                autocast=getattr(torch, spec["autocast"]) if spec.get("autocast") else None,
            )
            steps += 1


def quit_followers(group: Group) -> None:
    """Rank 0, leaving: the others stop."""
    if dist.is_initialized():
        group.command([QUIT])


class ShardedTrainer(PathTrainer):
    """Rank 0's :class:`PathTrainer`: each task's model and optimizer go to the other ranks when
    it opens, each step's global batch with it, and the step is :func:`sharded_step`. The task's
    model, optimizer, checkpoints, inner state and deltas are rank 0's, as on one device.
    ``torch.compile`` is off here (the DDP wrapper is what steps)."""

    def __init__(self, group: Group, config: dict[str, Any], **kwargs: Any) -> None:
        kwargs["features"] = {**kwargs["features"], "compile": False}
        super().__init__(config, **kwargs)
        self.group = group
        if self.train_cfg["batch_size"] % group.world:
            raise ConfigError(
                f"the run's batch of {self.train_cfg['batch_size']} windows does not split over "
                f"{group.world} devices; use a number of devices that divides it"
            )

    def open(self, task, modules, model, progress, lease_lost, *, resume=True, stream=None):
        run = super().open(task, modules, model, progress, lease_lost, resume=resume)
        autocast = self.features["autocast"]
        spec = {
            "model": dataclasses.asdict(self.model_cfg),
            "settings": dataclasses.asdict(run.settings),
            "micro_batch": self.micro_batch,
            "autocast": str(autocast).removeprefix("torch.") if autocast else None,
        }
        run.forward = start_task(self.group, run.model, run.optimizer, spec)
        return run

    def step(self, run: TaskRun) -> torch.Tensor:
        with timed(self.timings, "train"):
            step = run.task.step_offset + run.step
            if run.forward is None:  # open() wraps the model
                raise RuntimeError(f"{run.task.task_id} has no DistributedDataParallel model")
            batch = send_step(self.group, step, next(run.batches))
            return sharded_step(
                self.group, run.model, run.forward, run.optimizer, batch, run.settings,
                step=step, micro_batch=self.micro_batch, autocast=self.features["autocast"],
            )  # fmt: skip
