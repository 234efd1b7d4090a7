"""Pipeline parallelism as the run's plan lays it out, on PyTorch's own engine
(`torch.distributed.pipelining`: a `PipelineStage` per rank and `Schedule1F1B` or `ScheduleGPipe`,
or one per chunk of the rank's blocks and `ScheduleInterleaved1F1B`).

Each rank keeps the whole model object pruned to its stage: its blocks in place (the others
replaced by empty modules), the input embedding on the first stage, the final norm and output
projection on the last. Parameter names stay the whole model's, so checkpoints (DCP, by name)
resume on any other layout, sharded or not, and back.

The update is the one-process update on the global batch: a micro-batch's loss is its summed token
loss over the global batch's token count (scale_grads off), the replicas' gradients of a stage are
summed (one all-reduce, or under a sharded stage FSDP2's reduce-scatter, which the schedule runs
once after the last micro-batch), and the gradient norm for clipping is taken over all stages. A replica with no samples in a
step runs one micro-batch at weight zero, so that every collective still has all its ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.utils.checkpoint import checkpoint

from hetforge.cluster.pipeline_plan import PipelinePlan
from hetforge.data.shards import batch_from_numpy
from hetforge.memory.executor import PlanRunner, parameter_storages
from hetforge.memory.plan import Plan
from hetforge.model.gpt_neox import GPTNeoX
from hetforge.train.parallel import sum_gradients


class _Absent(nn.Module):
    """Where a part of the model lives on another stage: no parameters, never called."""

    def forward(self, *args):
        raise RuntimeError("this part of the model is on another pipeline stage")


def prune_to_stage(model: GPTNeoX, blocks, first: bool, last: bool) -> GPTNeoX:
    """The model with only this stage's parts (others replaced by parameterless modules, names kept)."""
    for i in range(len(model.layers)):
        if i not in blocks:
            model.layers[i] = _Absent()
    if not first:
        model.embed_in = _Absent()
    if not last:
        model.final_layer_norm = _Absent()
        model.embed_out = _Absent()
    return model


class StageModule(nn.Module):
    """One stage's forward: token ids or hidden states in, hidden states or logits out. Each block
    in `recompute` keeps only its input and runs its forward again in the backward (non-reentrant
    checkpointing, the dropout masks replayed)."""

    def __init__(self, model: GPTNeoX, blocks: range, first: bool, last: bool, recompute: set[int] = frozenset()):
        # `model` is the rank's pruned model, shared by its chunks under the interleaved schedule
        super().__init__()
        self.model, self.blocks, self.first, self.last, self.recompute = model, blocks, first, last, recompute
        self.run_under(None)

    def run_under(self, runner: PlanRunner | None) -> None:
        """Run the blocks under a per-tensor activation plan's runner (made once the stage is
        sharded: it knows the weights by their storages), or plainly with None."""
        self.__dict__["runner"] = runner  # not a submodule: its blocks are the model's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.emb_dropout(m.embed_in(x)) if self.first else x
        cos, sin = m.rotary.cos_sin(h.shape[1], h.device)
        if self.runner is not None:
            h = self.runner([m.layers[i] for i in self.blocks], h, cos, sin)
            return m.embed_out(m.final_layer_norm(h)) if self.last else h
        for i in self.blocks:
            if i in self.recompute and torch.is_grad_enabled():
                h = checkpoint(m.layers[i], h, cos, sin, use_reentrant=False)
            else:
                h = m.layers[i](h, cos, sin)
        return m.embed_out(m.final_layer_norm(h)) if self.last else h


class StageLoss:
    """The last stage's loss per micro-batch: summed token cross-entropy x weight / tokens, times
    the fp16 loss scale (1 otherwise): the schedule runs the backward from it."""

    def __init__(self, loss_fn: nn.Module):
        self.loss_fn, self.weight, self.tokens, self.scale = loss_fn, 1.0, 1, 1.0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, targets) * (self.weight * self.scale / self.tokens)


@dataclass
class Pipeline:
    """What the loop needs of this rank's stage (its chunks: one but under the interleaved schedule)."""

    plan: PipelinePlan
    stage_index: int
    replica: int
    modules: list[StageModule]
    stages: list[PipelineStage]
    schedule: object
    loss: StageLoss
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None

    @property
    def first(self) -> bool:
        """This rank feeds the token ids (it holds virtual stage 0)."""
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        """This rank computes the loss (it holds the last virtual stage)."""
        return self.stage_index == self.plan.stages - 1

    @property
    def micro_batches(self) -> int:
        return self.plan.micro_batches[self.replica]

    def run(self, x: torch.Tensor, y: torch.Tensor, weight: float, tokens_per_step: int,
            backward: bool = True, scale: float = 1.0) -> torch.Tensor:
        """The replica's micro-batches through the stages (`x` and `y` whole: the schedule cuts
        them), the backward from the loss times `scale`; this rank's part of the step loss,
        unscaled (the last stage's sum, float64; 0 elsewhere)."""
        self.loss.weight, self.loss.tokens, self.loss.scale = weight, tokens_per_step, scale
        losses: list[torch.Tensor] = []
        run = self.schedule.step if backward else self.schedule.eval
        args = (x,) if self.first else ()
        run(*args, **(dict(target=y, losses=losses) if self.last else {}))
        total = torch.zeros((), dtype=torch.float64, device=y.device)
        for loss in losses:
            total += loss.detach().double()
        return total / scale

    @property
    def norm_group(self) -> dist.ProcessGroup:
        """The ranks whose gradients together make the whole model's once: a replica's pipeline, or
        every rank where each stage is sharded over its replicas."""
        return dist.group.WORLD if self.plan.shard else self.pp_group

    def sync_gradients(self, params: list[nn.Parameter]) -> None:
        """Sum the stage's gradients over its replicas (one flat all-reduce; a sharded stage's
        were reduce-scattered by the schedule)."""
        if self.dp_group is None or self.plan.shard:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=self.dp_group)
        at = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[at:at + n].view_as(p.grad))
            at += n


def clip_over_stages(params: list[nn.Parameter], max_norm: float, group: dist.ProcessGroup) -> torch.Tensor:
    """`clip_grad_norm_` for a model cut into stages: the norm over every stage's gradients (the
    squared norms summed over `group`: a pipeline, or every rank's shards), each scaled alike."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        square += torch.linalg.vector_norm(g.float()) ** 2
    dist.all_reduce(square, group=group)
    norm = square.sqrt()
    if max_norm > 0 and math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm


@dataclass
class StageParts:
    """What a rank makes of its stage before the optimizer: its process groups and chunk modules."""

    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None
    modules: list[StageModule]


def stage_parts(plan: PipelinePlan, rank: int, model: GPTNeoX, device: torch.device,
                param_dtype: torch.dtype | None, activation_plan: Plan | None = None) -> StageParts:
    """This rank's groups (every rank creates every group, in one order) and its chunks' modules,
    sharded over the stage's replicas where the plan says so, its blocks run under the stage's
    activation plan where there is one."""
    pp_groups = [dist.new_group(plan.pipeline_ranks(r)) for r in range(plan.replicas)]
    dp_groups = [dist.new_group(plan.stage_ranks(s)) if plan.replicas > 1 else None for s in range(plan.stages)]
    s, r = plan.stage_of(rank), plan.replica_of(rank)
    last = plan.virtual_stages - 1
    redone = plan.recomputed_blocks(s)
    modules = [StageModule(model, plan.virtual_blocks(g), g == 0, g == last, redone) for g in plan.chunks(s)]
    if plan.shard:
        mesh = DeviceMesh.from_group(dp_groups[s], device.type, mesh_dim_names=("replicas",))
        shard_stage(modules[0], mesh, param_dtype)
    if activation_plan is not None:  # one chunk (the config refuses the interleaved schedule with a plan)
        blocks = [model.layers[i] for i in modules[0].blocks]
        runner = PlanRunner(activation_plan, parameter_storages(model), model.cfg.parallel_residual,
                            random=model.cfg.dropout > 0)
        runner.measure = False
        runner._handles = runner.install_labels(blocks)
        modules[0].run_under(runner)
    return StageParts(pp_groups[r], dp_groups[s], modules)


def shard_stage(module: StageModule, mesh: DeviceMesh, param_dtype: torch.dtype | None) -> None:
    """FSDP2 over the stage's replicas: the embedding, each block, and the final norm with the
    output projection as units, the stage module as root (PyTorch's schedules recognise it, keep
    its weights gathered through the step's micro-batches and reduce-scatter once after the last).
    Gradients are summed, not averaged, as the loss is already over the global batch's tokens."""
    kw = dict(mesh=mesh, reshard_after_forward=False,
              mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    m = module.model
    if module.first:
        fully_shard(m.embed_in, **kw)
    for i in module.blocks:
        fully_shard(m.layers[i], **kw)
    if module.last:
        fully_shard([m.final_layer_norm, m.embed_out], **kw)
    fully_shard(module, **kw)
    sum_gradients(module)


def build_pipeline(plan: PipelinePlan, rank: int, parts: StageParts, device: torch.device,
                   loss_fn: nn.Module) -> Pipeline:
    """This rank's stages and its replica's schedule."""
    s, r = plan.stage_of(rank), plan.replica_of(rank)
    stages = [PipelineStage(m, g, plan.virtual_stages, device, group=parts.pp_group)
              for m, g in zip(parts.modules, plan.chunks(s))]
    loss = StageLoss(loss_fn)
    n = max(plan.micro_batches[r], 1)  # a replica with no samples runs one micro-batch at weight zero
    if plan.schedules[r] == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n, loss_fn=loss, scale_grads=False)
    else:
        kind = Schedule1F1B if plan.schedules[r] == "1f1b" else ScheduleGPipe
        schedule = kind(stages[0], n, loss_fn=loss, scale_grads=False)
    return Pipeline(plan, s, r, parts.modules, stages, schedule, loss, parts.pp_group, parts.dp_group)


@torch.no_grad()
def evaluate_pipeline(pipe: Pipeline, samples, batch_size: int, device: torch.device, max_batches: int | None,
                      byte_lengths: list[int] | None, autocast) -> tuple[float, int, float]:
    """(summed NLL, tokens, bytes) of this replica's validation batches (replica r takes batches
    r, r + replicas, ...; each of `batch_size` samples, the size the stages' buffers have): the
    last stage's figures, 0 elsewhere, for the caller to sum over all ranks. Where stages are
    sharded, a replica left without a batch still runs one, uncounted: its first forward gathers
    the stage's weights with the other replicas'."""
    plan = pipe.plan
    per_batch = batch_size * pipe.micro_batches if pipe.micro_batches else batch_size
    n = len(samples) // per_batch * per_batch
    if max_batches is not None:
        n = min(n, max_batches * per_batch)
    lengths = torch.tensor(byte_lengths, dtype=torch.float64) if byte_lengths else None
    nll, tokens, nbytes = 0.0, 0, 0.0
    starts = list(range(pipe.replica * per_batch, n, plan.replicas * per_batch))
    if plan.shard and not starts:
        x = torch.zeros((per_batch, samples.seq_len), dtype=torch.long, device=device)
        with autocast():
            pipe.run(x, x, 0.0, 1, backward=False)
    for start in starts:
        x, y = batch_from_numpy(samples.batch(list(range(start, start + per_batch))), device)
        with autocast():
            total = pipe.run(x, y, 1.0, 1, backward=False)
        if pipe.last:
            nll += float(total)
            tokens += y.numel()
            if lengths is not None:
                nbytes += float(lengths[y.flatten().cpu().clamp_max(len(lengths) - 1)].sum())
    return nll, tokens, nbytes
