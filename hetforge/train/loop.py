"""The training loop: read this file top to bottom to know what one run does.

`Trainer.train()` runs five phases over one `TrainState` (step, global sample position, ...):

    setup    join the process group (torchrun / srun; nothing as one process) -> one precision for
             all ranks -> prepare data (rank 0; cached) -> build the model -> its weights from the
             newest valid checkpoint
    plan     split the global batch over the ranks by measured speed and memory -> plan each rank's
             activation memory -> optimizer (on the host where the device is too small for it) ->
             parallelize (DDP) -> the checkpointed optimizer, scaler and RNG state
    step     each rank runs its micro-batches (gradient sync only on the last), clip, step; the
             next step's micro-batches are built meanwhile on a worker thread (`data.loader`)
    observe  global loss (reduced on the device, read once per log interval), metrics,
             re-balancing when step times drift
    persist  validation and atomic checkpoints

Exact update on unequal ranks: every micro-batch's loss is its *sum* of token losses divided by the
number of tokens in the whole global batch, so after the all-reduce the gradient is that of the mean
loss over the global batch, whatever share and micro-batch split each rank has (DDP averages over
ranks, so each rank multiplies by the world size). A rank with no samples in a step runs one dummy
micro-batch with weight zero, so it still takes part in every collective (HetSeq's dummy batch).

Exact resume: the sample order is a function of the global sample position, the learning rate a
function of the step, and optimizer, loss-scaler and every rank's RNG state are checkpointed, so an
interrupted and resumed run produces bitwise the same losses as an uninterrupted one (fp32, CPU).
Checkpoints store the global position only, so a run can resume on a different number or mix of
ranks.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from rich.markup import escape
from rich.progress import TextColumn
from rich.table import Table

from hetforge import __version__
from hetforge.cluster.assign import PLAN_FILE, DriftMonitor, plan_for_run
from hetforge.cluster.balance import BalancePlan
from hetforge.cluster.dist import (
    DistContext,
    all_gather_object,
    all_gather_rows,
    barrier,
    broadcast_object,
    init_distributed,
    is_comm_failure,
    launch_world_size,
    peer_failure,
    post,
    post_error,
    shutdown,
    wait_for_main,
)
from hetforge.cluster.probe import activation_need
from hetforge.cluster.spec import (
    Slowdown,
    check_launch,
    cluster_nodes,
    declared_devices,
    device_memory_bytes,
    device_name,
    rank_device,
)
from hetforge.config import ConfigError, RunConfig, dump_config
from hetforge.core.checkpoint_io import rng_state
from hetforge.core.console import console, make_progress, warn
from hetforge.core.errors import HetforgeError
from hetforge.core.hardware import compile_decision, detect, padded_head_dim, run_precision
from hetforge.core.metrics import MetricsLogger
from hetforge.core.precision import Precision, resolve_device
from hetforge.core.process import process_peak_rss_bytes
from hetforge.core.sizes import format_bytes
from hetforge.data.loader import Prefetcher
from hetforge.data.prepare import PrepareResult, prepare
from hetforge.data.shards import MixedOrder, PackedSamples, SampleOrder, TokenShard, batch_from_numpy, weighted_regions
from hetforge.data.tokenizer import load_tokenizer, token_byte_lengths
from hetforge.evaluate.perplexity import EvalResult, evaluate
from hetforge.memory.device_plan import plan_for_config
from hetforge.memory.milp import PlanError
from hetforge.memory.sharding import (HOST_OPTIMIZER, NoStrategyFits, RankNeed, choose_strategy, pick_strategy,
                                      unit_size_that_fits)
from hetforge.memory.executor import apply_plan
from hetforge.memory.verify import PlanCheck
from hetforge.model.accounting import (STRATEGIES, ShardLayout, block_forward_flops, flops_per_token, matmul_params,
                                       parameter_sizes, state_shares)
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig, set_head_padding
from hetforge.model.load import TOKENIZER
from hetforge.scaling.accounting import PowerMeter, rank_power, write_report
from hetforge.scaling.flops import measure_matmul_peak
from hetforge.train.checkpoint import (
    CheckpointError,
    begin_publish,
    finish_publish,
    latest_valid,
    load_components,
    load_model_state,
    load_optimizer_state,
    read_state,
    remove_stale_temps,
    save_checkpoint,
    save_sharded,
    write_extras,
)
from hetforge.train.checkpoint import resolve as ckpt_resolve
from hetforge.train.metrics import plot_loss_curve
from hetforge.train.optim import build_optimizer, lr_at, param_order
from hetforge.train.parallel import (
    ComputeTimer,
    Parallel,
    compile_blocks,
    device_mesh,
    init_sharded,
    local_sharding,
    local_state_bytes,
    parallelize,
    shard_group_size,
    shard_model,
)


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    losses: dict[int, float]  # step -> global train loss, for the steps run by this call
    val: EvalResult | None
    tokens_per_s: float
    tflops: float
    mfu: float
    peak_tflops: float
    checkpoint: Path | None
    interrupted: bool = False
    extra: dict = field(default_factory=dict)


@dataclass
class TrainState:
    """What changes as the run goes: everything a checkpoint's position needs, and the log's."""

    step: int = 0
    consumed: int = 0  # global sample position
    steps_this_call: int = 0
    last_checkpoint: Path | None = None
    losses: dict[int, float] = field(default_factory=dict)
    # (step, loss tensor still on the device or in flight, its reduction's handle, grad-norm tensor)
    pending: list[tuple[int, torch.Tensor, object, torch.Tensor]] = field(default_factory=list)
    rank_times: list[float] = field(default_factory=list)
    rate: dict[str, float] = field(default_factory=lambda: {"tokens_per_s": 0.0, "tflops": 0.0, "mfu": 0.0})


class StopSignals:
    """SIGINT / SIGTERM ask the loop to stop after the current step and checkpoint; a second
    Ctrl-C aborts at once. Only the main thread may install handlers, so elsewhere this is inert."""

    def __init__(self, announce: bool = True):
        self.signum: int | None = None
        self.announce = announce
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        if self.announce:
            console.print(f"\n[yellow]{signal.Signals(signum).name}: stopping after this step, writing a checkpoint[/yellow]")

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return process_peak_rss_bytes() / 2**20


class TokenLoss(torch.nn.Module):
    """Summed next-token cross-entropy, in fp32. A module so that hooks run around it as around the
    model's units: a simulated slow device (`Slowdown.install_per_module`, under FSDP) is slow at
    the loss as a real one is, and as the probe's rule (one sleep after forward and loss) has it.
    At a vocabulary of thousands the loss and its gradient are a large part of a small model's
    compute."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


_TOKEN_LOSS = TokenLoss()


def backward_share(
    par: Parallel,
    samples: PackedSamples,
    order: SampleOrder,
    micro_batches: list[tuple[int, int]],
    consumed: int,
    tokens_per_step: int,
    precision: Precision,
    scaler: torch.amp.GradScaler,
    device: torch.device,
    after_forward=None,
    after_backward=None,
    loader: Prefetcher | None = None,
    timer: ComputeTimer | None = None,
    loss_fn: torch.nn.Module = _TOKEN_LOSS,
) -> tuple[torch.Tensor, ComputeTimer]:
    """Forward/backward of this rank's micro-batches (given as (global position, count)), with
    DDP's gradient sync only on the last one. Returns this rank's part of the step loss (float64,
    on the device) and the timer of its compute, waiting for other ranks excluded where the
    strategy lets it be seen (the balancer needs this rank's own speed; `timer.step_seconds()`).

    A micro-batch of count 0, or a rank with none, runs one sample with weight 0: the rank still
    takes part in every collective (HetSeq's dummy batch; under FSDP each micro-batch is one)."""
    net = par.net
    work = micro_batches or [(consumed, 0)]
    step_loss = torch.zeros((), device=device, dtype=torch.float64)
    timer = timer or ComputeTimer(device, par.clock)
    for j, (start, count) in enumerate(work):
        last = j == len(work) - 1
        synced = last and par.clock is not None
        weight = par.grad_weight if count else 0.0
        with par.sync(last):
            timer.start()
            t0 = Slowdown.clock() if after_forward is not None else 0.0
            n = max(count, 1)
            x, y = (loader.get(start, n) if loader is not None
                    else batch_from_numpy(samples.batch(order.indices(start, n)), device))
            with precision.autocast():
                logits = net(x)
            token_loss = loss_fn(logits, y)
            # Nothing saved for the backward refers to the logits: let them go now, not after the
            # backward (or the next micro-batch's forward). At a 50k vocabulary that is GBs.
            del logits
            if after_forward is not None:  # the forward's time includes the loss's
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                after_forward(Slowdown.clock() - t0)
            c1 = Slowdown.clock() if after_backward is not None else 0.0
            scaler.scale(token_loss * weight / tokens_per_step).backward()
            if after_backward is not None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                after_backward(Slowdown.clock() - c1)
            timer.stop(synced)  # with the sync: when the last gradient bucket was ready
        if count:
            step_loss += token_loss.detach() / tokens_per_step
    return step_loss, timer


def train(
    cfg: RunConfig,
    resume: Literal["auto", "always", "never"] = "auto",
    stop_after: int | None = None,
    plan_only: bool = False,
) -> TrainResult:
    """Train (or, with plan_only, stop once the batch balance is made: `hetforge balance`)."""
    device = resolve_device(cfg.train.device)
    world = launch_world_size()
    check_launch(cfg.cluster, world)  # before any connection: every rank fails alike
    declared = declared_devices(cluster_nodes(cfg.cluster))
    if world == 1 and declared > 1 and not plan_only:
        warn(f"the cluster declares {declared} devices but this is one process: it trains alone; launch one rank "
             f"per device (torchrun --nproc-per-node / srun) to use them")
    ctx = init_distributed(device.type, cfg.cluster.rendezvous_timeout_s, cfg.cluster.collective_timeout_s)
    if ctx.distributed and device.type == "cuda":
        device = torch.device("cuda", ctx.local_rank)
    trainer = None
    try:
        if ctx.distributed:
            check_launch(cfg.cluster, ctx.world_size, all_gather_object(ctx, (ctx.node_rank, ctx.local_rank)))
        trainer = Trainer(cfg, ctx, device)
        trainer.setup(resume)
        if plan_only:
            plan = trainer.balance()
            trainer.write_run_config()
            return TrainResult(trainer.run_dir, trainer.state.step, {}, None, 0.0, 0.0, 0.0, 0.0,
                               trainer.state.last_checkpoint,
                               extra={"plan": plan.to_dict(), "rank": ctx.rank, "world_size": ctx.world_size})
        trainer.plan()
        return trainer.train(stop_after)
    except HetforgeError as err:
        post_error(ctx, str(err))  # the other ranks, losing this one, say why
        raise
    except Exception as err:
        if ctx.distributed and is_comm_failure(err):
            # The launcher, seeing a worker die, sends the others SIGTERM at once: it must not cut
            # short the few seconds it takes to find out which rank went and to say so.
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, lambda *_: None)
            raise peer_failure(ctx, err, trainer.state.step if trainer else 0, _resume_hint(trainer)) from None
        raise
    finally:
        if ctx.distributed:
            if trainer is not None:
                trainer.release()
            shutdown(ctx)


def _resume_hint(trainer: "Trainer | None") -> str:
    command = "hetforge " + " ".join(sys.argv[1:]) if len(sys.argv) > 1 else "hetforge train CONFIG"
    last = trainer.state.last_checkpoint if trainer is not None else None
    start = f"from {last}" if last is not None else "from the start (no checkpoint yet)"
    return f"relaunch the same job (torchrun ... {command}) to resume {start}"


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, device: torch.device):
        self.cfg, self.ctx, self.device = cfg, ctx, device
        self.cfg_as_given = cfg
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.state = TrainState()
        self._checkpoints_written = 0
        self.balance_plan: BalancePlan | None = None  # `plan` solves it
        self.say = console.print if ctx.is_main else (lambda *a, **k: None)

    # ------------------------------------------------------------------ setup
    def setup(self, resume: str) -> None:
        cfg, ctx = self.cfg, self.ctx
        # One precision for the whole run, set by its weakest device, stated once.
        caps = all_gather_object(ctx, detect(self.device))
        chosen, why = run_precision(caps) if cfg.train.precision == "auto" else (cfg.train.precision, "as configured")
        self.precision = Precision(chosen, self.device)
        self.say(f"precision {chosen}: {why}")
        if cfg.train.precision == "auto":  # what plans, probes and checkpoints below read is the decision
            self.cfg = cfg = cfg.model_copy(deep=True)
            cfg.train.precision = chosen
        tc = cfg.train
        if tc.num_threads:
            torch.set_num_threads(tc.num_threads)
        torch.manual_seed(tc.seed)

        # continued pre-training: the starting weights fix the model's shape and tokenizer
        init = init_state = None
        if cfg.model.init_from:
            init = ckpt_resolve(cfg.model.init_from)
            init_state = read_state(init)

        # data: rank 0 prepares (a no-op when cached), the others then open the same shards; they
        # wait through the store, for as long as rank 0 is alive (preparing may take hours)
        if ctx.is_main:
            data = prepare(cfg.data, progress=tc.progress)
            if ctx.distributed:
                post(ctx, "prepared", "ok")
        else:
            wait_for_main(ctx, "prepared", "preparing the data")
        if not ctx.is_main:
            data = prepare(cfg.data, progress=False, verbose=False)
        self.data: PrepareResult = data
        mix = weighted_regions(data.meta)
        self.train_samples = PackedSamples(TokenShard(data.out_dir, "train"), tc.seq_len, "train",
                                           regions=mix[0] if mix else None)
        self.val_samples = PackedSamples(TokenShard(data.out_dir, "val"), tc.seq_len, "val")
        # weighted sources: each draws its share of positions (data.sources[*].weight), exactly
        self.order = (MixedOrder(self.train_samples.region_counts, mix[1], tc.seed) if mix
                      else SampleOrder(len(self.train_samples), tc.seed))
        self.loader = Prefetcher(self.train_samples, self.order, self.device)
        self.tokenizer_path = data.out_dir / "tokenizer.json"
        self.byte_lengths = token_byte_lengths(load_tokenizer(self.tokenizer_path))

        # the model
        vocab = data.meta["vocab_size"]
        if cfg.model.vocab_size is not None and cfg.model.vocab_size < vocab:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab}")
        self.vocab = vocab
        self.model_cfg = GPTNeoXConfig.from_model_config(cfg.model, vocab)
        if init is not None:
            self.model_cfg = GPTNeoXConfig(**init_state["model_config"])
            if _sha256_file(init / TOKENIZER) != _sha256_file(self.tokenizer_path):
                raise ConfigError(f"model.init_from {init} was trained with another tokenizer than the data in "
                                  f"{data.out_dir}: prepare the data with the model's own (data.tokenizer.path: "
                                  f"{init / TOKENIZER}, and a new data.out_dir)")
        self.state_weights = self._state_weights()
        # each rank's fraction of the optimizer state under zero1 by memory (None: 1/W each)
        self.zero1_shares = None if self.state_weights is None else \
            state_shares(parameter_sizes(self.model_cfg), self.state_weights)
        self._needs: list[RankNeed] | None = None
        self.strategy, self.mesh = self.choose_strategy(), None
        self.sharded = self.strategy in ("zero2", "fsdp")
        self.unit_params = self._unit_params()
        if self.sharded:
            # built on the meta device, sharded, then each rank initialises its own shards only
            with torch.device("meta"):
                self.model = GPTNeoX(self.model_cfg)
        else:
            self.model = GPTNeoX.build(self.model_cfg, self.device, tc.seed)
        head = self.model_cfg.head_dim
        try:
            padded = padded_head_dim(detect(self.device), self.precision.name, head, cfg.model.pad_head_dim)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if padded != head:
            set_head_padding(self.model, padded)
            self.say(f"attention: head size {head} run at {padded} (zero channels, exact) so that a fused "
                     f"kernel takes it (model.pad_head_dim={cfg.model.pad_head_dim})")
        if self.sharded:
            pc = cfg.parallel
            self.mesh = device_mesh(ctx, self.device, pc.mesh.replicate, pc.mesh.shard)
            shard_model(self.model, self.mesh, self.strategy, pc.reshard_after_forward, pc.offload,
                        self._param_dtype(), self.unit_params)
            init_sharded(self.model, torch.device("cpu") if pc.offload == "params" else self.device, tc.seed)
        self.scaler = self.precision.grad_scaler()

        # resume (every rank reads the same checkpoint; it holds the global sample position). The
        # weights and position now; optimizer, scaler and RNG once the optimizer exists (`plan`),
        # as the memory plan may put it on the host.
        if ctx.is_main:
            for stale in remove_stale_temps(self.ckpt_root):
                warn(f"removed {stale}, a checkpoint whose writer died mid-write")
        if resume != "never":
            found = latest_valid(self.ckpt_root, warn) if ctx.is_main else None
            found = broadcast_object(ctx, found)
            if found is None and resume == "always":
                raise CheckpointError(f"--resume given but {self.ckpt_root} holds no valid checkpoint")
            if found is not None:
                ck = read_state(found)
                if ck["model_config"] != self.model_cfg.to_dict():
                    raise CheckpointError(f"{found} was written for a different model config; use a new run_dir")
                load_model_state(found, self.model, self.sharded)
                self.state.step, self.state.consumed = int(ck["step"]), ck["consumed_samples"]
                self.state.last_checkpoint = found
                self.say(f"resumed from {found} (step {self.state.step}, {self.state.consumed} samples consumed)")
        if init is not None and self.state.last_checkpoint is None:
            load_model_state(init, self.model, self.sharded)
            self.say(f"starting from the weights of {init}")

    # ------------------------------------------------------------------- plan
    def choose_strategy(self) -> str:
        """ddp, zero1, zero2 or fsdp ("single" for one process): as configured, or the least
        sharding under which every rank fits (`memory.sharding.choose_strategy`, on each rank's
        memory and its activations measured on local proxies), said with the reason."""
        cfg, ctx = self.cfg, self.ctx
        pc = cfg.parallel
        if not ctx.distributed:
            if pc.strategy in ("zero1", "zero2", "fsdp"):
                warn(f"parallel.strategy={pc.strategy} with one process: nothing to shard, it trains as one replica")
            return "single"
        if pc.strategy != "auto":
            self.say(f"data parallelism: {pc.strategy} (parallel.strategy={pc.strategy})")
            return pc.strategy
        memory = device_memory_bytes(rank_device(cfg.cluster, ctx), self.device)
        shard, gather = self._planned_shard_size(), self._gather_bytes()
        if cfg.memory.active and memory is not None:
            # with an activation plan the planner itself says what fits: each strategy's static
            # bytes under this rank's budget, at micro-batch 1
            fits = {}
            no_host = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"optimizer_offload": "off"})})
            for s in STRATEGIES:
                if (pc.offload == "params" and s in ("ddp", "zero1")) or (pc.offload == "optimizer" and s != "ddp"):
                    continue
                share = self.zero1_shares[ctx.rank] if s == "zero1" and self.zero1_shares else None
                fits[s] = self._plan_fits(no_host, ShardLayout(s, shard if s != "ddp" else 1, gather, pc.offload,
                                                               pc.unit_params, share), memory)
            if pc.offload == "none" and cfg.memory.optimizer_offload == "auto":
                fits[HOST_OPTIMIZER] = self._plan_fits(cfg, ShardLayout(), memory)
            rows = all_gather_object(ctx, {"fits": fits, "device": device_name(rank_device(cfg.cluster, ctx), self.device)})
            try:
                strategy, why = pick_strategy([r["fits"] for r in rows], [r["device"] for r in rows])
            except NoStrategyFits as err:
                raise ConfigError(str(err)) from None
            self.say(f"data parallelism: {why}")
            return strategy
        try:
            strategy, why = choose_strategy(self.model_cfg, cfg.train.optimizer, self._rank_needs(), shard, gather,
                                            pc.offload, pc.unit_params, self.zero1_shares)
        except NoStrategyFits as err:
            raise ConfigError(str(err)) from None
        self.say(f"data parallelism: {why}")
        return strategy

    def _state_weights(self) -> list[float] | None:
        """Every rank's memory, when ZeRO-1 is to split the optimizer state in proportion to it
        (`parallel.state_shares: memory`) and the ranks differ; None: equal parts."""
        cfg, ctx = self.cfg, self.ctx
        if not ctx.distributed or cfg.parallel.state_shares != "memory":
            return None
        memory = device_memory_bytes(rank_device(cfg.cluster, ctx), self.device)
        every = all_gather_object(ctx, memory)
        if any(m is None for m in every) or len(set(every)) == 1:
            return None
        return [float(m) for m in every]

    def _rank_needs(self) -> list[RankNeed]:
        """Every rank's memory and activations at micro-batch 1 (measured on local proxies where its
        memory is known), gathered once: what the strategy and the FSDP unit size are decided on."""
        if self._needs is None:
            cfg, ctx = self.cfg, self.ctx
            memory = device_memory_bytes(rank_device(cfg.cluster, ctx), self.device)
            act = 0.0
            if memory is not None:
                act_bytes = 4 if self.precision.name == "fp32" else 2
                act = activation_need(self.model_cfg, cfg.train.seq_len, self.vocab, self.device,
                                      self.precision.autocast, act_bytes, floor=cfg.memory.active)
            self._needs = [RankNeed(**n) for n in all_gather_object(ctx, {
                "rank": ctx.rank, "device": device_name(rank_device(cfg.cluster, ctx), self.device),
                "budget": None if memory is None else float(memory), "activation_bytes": act})]
        return self._needs

    def _planned_shard_size(self) -> int:
        """The shard group's size as configured, before the mesh exists (`layout` reads the mesh)."""
        pc, world = self.cfg.parallel, self.ctx.world_size
        return pc.mesh.shard or (world // pc.mesh.replicate if pc.mesh.replicate else world)

    def _gather_bytes(self) -> int:
        return 4 if self.precision.name == "fp32" else 2

    def _unit_params(self) -> int:
        """FSDP's unit floor: `parallel.unit_params` as set, or by default its value unless a rank
        fits only with one block a unit (`memory.sharding.unit_size_that_fits`, on every rank's
        memory and measured activations: the ranks must wrap the model alike)."""
        cfg, pc = self.cfg, self.cfg.parallel
        if not self.sharded or "unit_params" in pc.model_fields_set:
            return pc.unit_params
        units, why = unit_size_that_fits(self.model_cfg, cfg.train.optimizer, self._rank_needs(), self.strategy,
                                         self._planned_shard_size(), self._gather_bytes(), pc.offload, pc.unit_params)
        if why:
            self.say(why)
        return units

    def _plan_fits(self, cfg: RunConfig, layout: ShardLayout, memory: float | None) -> bool:
        try:
            plan_for_config(cfg, self.model_cfg, self.device, 1, memory, self.run_dir / "memory",
                            self.ctx.backend, layout)
            return True
        except PlanError:
            return False

    def _param_dtype(self) -> torch.dtype | None:
        """FSDP2's compute dtype for the weights (None: as stored, fp32)."""
        return self.precision.dtype if self.precision.name != "fp32" else None

    def layout(self) -> ShardLayout:
        shard = shard_group_size(self.mesh) if self.mesh is not None else self.ctx.world_size
        shares = self.zero1_shares if self.strategy == "zero1" else None
        # FSDP2's accumulation: the balance decides it (auto); before it, what is configured
        plan = self.balance_plan
        accumulation = plan.accumulation if plan is not None else \
            ("unsharded" if self.cfg.parallel.accumulation == "unsharded" else "sharded")
        return ShardLayout(self.strategy if self.strategy != "single" else "ddp",
                           shard if self.strategy != "ddp" else 1, self._gather_bytes(), self.cfg.parallel.offload,
                           self.unit_params, shares[self.ctx.rank] if shares else None,
                           accumulation if self.sharded else "sharded")

    def balance(self) -> BalancePlan:
        """The share of the global batch each rank computes."""
        # a sharded run's probe times its proxy under FSDP2's hooks, as the model runs
        hooks = local_sharding(self.device, self.strategy, self._param_dtype(), self.unit_params) if self.sharded \
            else contextlib.nullcontext()
        with hooks as wrap:
            return plan_for_run(self.cfg, self.ctx, self.model, self.device, self.precision.autocast, self.vocab,
                                self.run_dir, console if self.ctx.is_main else None, self.layout(), wrap)

    def plan(self) -> None:
        cfg, ctx, tc = self.cfg, self.ctx, self.cfg.train
        self.balance_plan = self.balance()
        # Drift needs each rank's own compute time: the DDP hook marks the end of this rank's
        # backward (BucketClock), with CUDA events on a GPU (ComputeTimer). Under FSDP every
        # micro-batch gathers from all ranks, so a rank's time includes its wait for the slowest:
        # the probe's balance stands.
        watch = ctx.distributed and cfg.cluster.rebalance and cfg.cluster.balance == "auto" and not self.sharded
        self.monitor = DriftMonitor(self.balance_plan, cfg.cluster.rebalance_threshold,
                                    cfg.cluster.rebalance_window) if watch else None
        self.slowdown = Slowdown(rank_device(cfg.cluster, ctx))  # no slowdown when the cluster is not described
        self.loss_fn = TokenLoss()  # its own instance: a slow rank's hooks go on it (below)
        self.check = self._memory_plan()
        offload = (self.check is not None and self.check.dp.optimizer_offload) or cfg.parallel.offload == "optimizer"
        self.optimizer = build_optimizer(self.model, tc, self.device, offload=offload, zero1=self.strategy == "zero1",
                                         state_weights=self.state_weights)
        if self.strategy == "zero1" and self.state_weights is not None:
            self.say(f"zero1: optimizer state in proportion to memory, rank shares "
                     f"{', '.join(f'{x:.0%}' for x in self.zero1_shares)}")
        if offload:
            self.say(f"rank {ctx.rank}: optimizer state in host memory (it does not fit beside the weights and gradients)")
        self.components = {"scaler": self.scaler}  # the optimizer's state is read and written by name
        self.param_order = param_order(self.model)
        if self.state.last_checkpoint is not None:
            load_optimizer_state(self.state.last_checkpoint, self.model, self.optimizer, self.param_order, self.sharded)
            load_components(self.state.last_checkpoint, self.components, ctx.rank)
        self.compiled, why = compile_decision(tc.compile, self.device, self.check is not None)
        if self.compiled:
            compile_blocks(self.model, whole_chain=not ctx.distributed)
        self.say(f"compile: {'on' if self.compiled else 'off'} ({why})")
        self.par: Parallel = parallelize(self.model, ctx, self.device, self.strategy,
                                         accumulation=self.balance_plan.accumulation)
        if self.sharded:  # the ranks meet at every unit: a slow device is slowed where each module runs
            m = self.model
            self.slowdown.install_per_module([m.embed_in, *m.layers, m.final_layer_norm, m.embed_out, self.loss_fn],
                                             lambda: self.state.step)
        self.timer = ComputeTimer(self.device, self.par.clock)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._accounting()

    def _memory_plan(self) -> PlanCheck | None:
        """Plan this rank's activations for the micro-batch it was given (and install the plan); the
        main rank prints every rank's plan side by side and saves them to RUN/memory/plans.json."""
        cfg, ctx = self.cfg, self.ctx
        if not cfg.memory.active:
            return None
        share = self.balance_plan.shares[ctx.rank]
        micro = share.micro_batch_size or 1
        dp = plan_for_config(cfg, self.model_cfg, self.device, micro,
                             device_memory_bytes(rank_device(cfg.cluster, ctx), self.device),
                             self.run_dir / "memory", ctx.backend if ctx.distributed else None, self.layout())
        runner = apply_plan(self.model, dp.plan, measure=False)  # the check measures one step
        p = dp.prediction
        mine = {"rank": ctx.rank, "device": share.device, "micro_batch": micro, "budget": dp.budget,
                "strategy": dp.plan.strategy, "plan": dp.summary(), "options": dp.plan.options,
                "predicted_peak_bytes": p.peak_bytes, "predicted_held_bytes": p.held_bytes,
                "predicted_step_s": p.time_s, "keep_all_step_s": dp.keep_all.time_s,
                "optimizer_offload": dp.optimizer_offload, "offload_s_per_step": dp.offload_s}
        rows = all_gather_object(ctx, mine)
        if ctx.is_main:
            t = Table(title="memory plan per rank (predicted for one micro-batch)")
            for col in ("rank", "device", "budget", "micro-batch", "plan", "peak", "held", "step ms", "vs keep-all"):
                t.add_column(col, justify="left" if col in ("device", "plan") else "right")
            for r in rows:
                t.add_row(str(r["rank"]), r["device"], format_bytes(r["budget"]) if r["budget"] else "none",
                          str(r["micro_batch"]), escape(r["plan"]), format_bytes(r["predicted_peak_bytes"]),
                          format_bytes(r["predicted_held_bytes"]), f"{r['predicted_step_s'] * 1e3:.1f}",
                          f"{r['predicted_step_s'] / r['keep_all_step_s']:.3f}x")
            self.say(t)
            (self.run_dir / "memory").mkdir(parents=True, exist_ok=True)
            (self.run_dir / "memory" / "plans.json").write_text(json.dumps(rows, indent=1))
        return PlanCheck(dp, runner, self.device, cfg.memory.verify_tolerance)

    def _accounting(self) -> None:
        """FLOPs per token (model, and hardware with this rank's recomputation), the job's peak as
        the sum of every rank's, and the run_start record the report derives cost and energy from."""
        cfg, ctx, tc, shape = self.cfg, self.ctx, self.cfg.train, self.model_cfg
        self.n_params = self.model.num_parameters()
        self.fpt = flops_per_token(shape, tc.seq_len)
        # Hardware FLOPs add the recomputation of this rank's memory plan: the share of the blocks'
        # forward it repeats (by the planner's profiled times) times the blocks' forward FLOPs.
        self.hw_fpt = self.fpt
        if self.check is not None:
            pred = self.check.dp.prediction
            blocks_fwd = sum(b.fwd_s for b in self.check.dp.profile.blocks)
            if blocks_fwd > 0:
                self.hw_fpt += pred.breakdown_time["recompute"] / blocks_fwd * shape.n_layers * block_forward_flops(
                    shape, 1, tc.seq_len)
        mine = tc.peak_tflops * 1e12 if tc.peak_tflops else measure_matmul_peak(self.device, self.precision.dtype)
        self.rank_peaks = all_gather_object(ctx, mine)
        self.peak = sum(self.rank_peaks)  # MFU of the whole job against the sum of its ranks' peaks
        self.global_batch = self.balance_plan.global_batch
        self.tokens_per_step = self.global_batch * tc.seq_len
        self.say(
            f"model: {self.n_params / 1e6:.2f}M parameters, {shape.n_layers} layers, d={shape.d_model}, "
            f"vocab {self.vocab} | batch {self.global_batch}x{tc.seq_len} = {self.tokens_per_step:,} tokens/step | "
            f"{ctx.world_size} rank(s), {self.device.type} {self.precision.name} | "
            f"matmul peak {self.peak / 1e12:.2f} TFLOP/s"
        )
        self.logger = MetricsLogger(self.run_dir, tensorboard=tc.tensorboard, wandb=tc.wandb, project=tc.wandb_project,
                                    name=cfg.name, config=cfg.model_dump(mode="json")) if ctx.is_main else None
        spec = rank_device(cfg.cluster, ctx)
        dev_name = device_name(spec, self.device)
        power, power_source = rank_power(spec.power_w if spec else None, dev_name, self.device.type == "cuda")
        self.power_meter = PowerMeter(self.device)
        ranks = all_gather_object(ctx, {"rank": ctx.rank, "device": dev_name, "power_w": power,
                                        "power_source": power_source})
        if ctx.is_main:
            self.logger.log("event", self.state.step, {
                "event": "run_start", "params": self.n_params, "flops_per_token": self.fpt,
                "hw_flops_per_token": self.hw_fpt, "matmul_params": matmul_params(shape),
                "seq_len": tc.seq_len, "tokens_per_step": self.tokens_per_step, "ranks": ranks,
                "rank_peak_tflops": [p / 1e12 for p in self.rank_peaks], "sources": self.source_epochs()})

    def source_epochs(self) -> list[dict]:
        """Per source: its share of the samples and how many times this run will see it."""
        sources = self.data.meta.get("sources") or []
        total = self.cfg.train.steps * self.global_batch
        if isinstance(self.order, MixedOrder):
            draws = self.order.draws(total)
            return [{"path": s.get("path") or s["type"], "weight": s["weight"], "windows": int(n),
                     "share": float(self.order.shares[i]), "epochs": float(draws[i] / n) if n else 0.0}
                    for i, (s, n) in enumerate(zip(sources, self.order.counts))]
        n = len(self.train_samples)
        return [{"path": s.get("path") or s["type"], "weight": s.get("weight", 1.0),
                 "share": s["tokens"]["train"] / max(self.train_samples.shard.num_tokens, 1), "epochs": total / n}
                for s in sources if "tokens" in s]

    # ------------------------------------------------------------------- step
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step on this rank's share: (loss on the device, grad norm, compute s)."""
        st, tc = self.state, self.cfg.train
        lr = lr_at(st.step, tc)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        mine = self.balance_plan.micro_positions(self.ctx.rank, st.consumed)
        # this step's micro-batches, then the next step's: built while this one computes
        self.loader.request(mine)
        self.loader.request(self.balance_plan.micro_positions(self.ctx.rank, st.consumed + self.global_batch))
        checking = self.check is not None and self.check.before(st.steps_this_call, self.params, not self.ctx.distributed)
        slow = self.slowdown.active and not self.sharded  # sharded: slowed per module (`setup`)
        step_loss, _ = backward_share(
            self.par, self.train_samples, self.order, mine, st.consumed, self.tokens_per_step,
            self.precision, self.scaler, self.device,
            after_forward=(lambda seconds: self.slowdown.after_forward(seconds, st.step)) if slow else None,
            after_backward=self.slowdown.after_backward if slow else None,
            loader=self.loader, timer=self.timer, loss_fn=self.loss_fn,
        )
        # on a GPU the previous step's time (read without a sync), unless the plan's check needs this one
        compute_s = self.timer.step_seconds(wait=checking)
        if checking:
            record, warnings = self.check.after(compute_s, sum(n for _, n in mine))
            for w in warnings:
                warn(f"rank {self.ctx.rank}: {w}")
            if record is not None:  # the same step on every rank: each rank's figures, side by side
                ranks = all_gather_object(self.ctx, {**record, "rank": self.ctx.rank})
                if self.ctx.is_main:
                    self.logger.log("event", st.step + 1, {**record, "ranks": ranks})
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, tc.grad_clip if tc.grad_clip > 0 else float("inf"))
        if isinstance(grad_norm, DTensor):  # sharded gradients: the norm is reduced over the shards
            grad_norm = grad_norm.full_tensor()
        self.scaler.step(self.optimizer)  # skipped (and the scale halved) if fp16 gradients overflowed
        self.scaler.update()
        if st.steps_this_call == 0:  # before the gradients go: what this rank holds, for the record
            self.held = local_state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        st.step += 1
        st.steps_this_call += 1
        st.consumed += self.global_batch
        return step_loss, grad_norm, compute_s

    def record_state_bytes(self) -> None:
        """Every rank's measured bytes of weights, gradients and optimizer state beside what the
        layout predicts (`model.accounting.sharded_static_bytes`), in metrics.jsonl."""
        layout = self.layout()
        predicted = layout.static_bytes(self.model_cfg, self.cfg.train.optimizer,
                                        self.check is not None and self.check.dp.optimizer_offload)
        ranks = all_gather_object(self.ctx, {"rank": self.ctx.rank, **self.held, "predicted": predicted})
        if self.ctx.is_main:
            self.logger.log("event", self.state.step, {"event": "state_bytes", "strategy": self.strategy,
                                                       "accumulation": layout.accumulation,
                                                       "predicted": predicted, "ranks": ranks})

    # ---------------------------------------------------------------- observe
    def observe_step(self, step_loss: torch.Tensor, grad_norm: torch.Tensor, compute_s: float,
                     stop_requested: bool, bar) -> bool:
        """The global view of the step: each rank's compute time and any stop request (host values,
        gathered), drift. The loss stays on the device, this rank's part, until the next log sums
        the interval's losses over the ranks in one collective. Returns whether any rank asked to
        stop."""
        st, ctx = self.state, self.ctx
        st.pending.append((st.step, step_loss, grad_norm))
        if not ctx.distributed:
            return stop_requested
        rows = all_gather_rows(ctx, torch.tensor([compute_s, float(stop_requested)], dtype=torch.float64))
        st.rank_times = rows[:, 0].tolist()
        new_plan = self.monitor.observe(st.rank_times) if self.monitor else None
        if new_plan is not None:
            old = [s.samples for s in self.balance_plan.shares]
            self.balance_plan = new_plan
            if ctx.is_main:
                new_plan.save(self.run_dir / PLAN_FILE)
                self.logger.log("event", st.step, {"event": "rebalance", "old_samples": old,
                                                   "new_samples": [s.samples for s in new_plan.shares],
                                                   "rank_compute_s": st.rank_times})
                bar.console.print(f"step {st.step}: step times drifted, re-balanced {old} -> "
                                  f"{[s.samples for s in new_plan.shares]} samples per rank")
        return bool(rows[:, 1].max() > 0)

    def _drain(self) -> list[tuple[int, float, float]]:
        """The pending steps' global losses and grad-norms as numbers: the interval's one host sync,
        and on many ranks its one all-reduce of the losses (not one per step: an asynchronous
        reduction in flight beside FSDP's gathers was measured to halve a step's speed on gloo in
        some runs, its worker threads contending with the gathers)."""
        pending = self.state.pending
        if not pending:
            return []
        losses = torch.stack([loss for _, loss, _ in pending])
        if self.ctx.distributed:
            dist.all_reduce(losses)
        values = losses.tolist()
        out = []
        for (s, _, gnorm), lv in zip(pending, values):
            out.append((s, lv, float(gnorm)))
            self.state.losses[s] = lv
        pending.clear()
        return out

    def log_interval(self, elapsed: float, steps: int, bar, task) -> None:
        st, tc, device = self.state, self.cfg.train, self.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        synced = self._drain()
        tok_s = steps * self.tokens_per_step / elapsed
        self.power_meter.sample()
        st.rate = {"tokens_per_s": tok_s, "tflops": self.fpt * tok_s / 1e12, "mfu": self.fpt * tok_s / self.peak}
        mean_loss = sum(lv for _, lv, _ in synced) / len(synced)
        lr = lr_at(st.step - 1, tc)
        if self.ctx.is_main:
            record = {
                "loss": mean_loss, "lr": lr, "grad_norm": synced[-1][2], **st.rate,
                "hfu": self.hw_fpt * tok_s / self.peak, "peak_mem_mb": peak_memory_mb(device),
                "step_time_s": elapsed / steps, "tokens": st.consumed * tc.seq_len,
                "loss_scale": float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0,
            }
            if self.ctx.distributed:
                record["rank_compute_s"] = st.rank_times
                record["rank_samples"] = [s.samples for s in self.balance_plan.shares]
                # each rank's model FLOPs over the step's wall time, against its own peak
                step_s = elapsed / steps
                record["rank_mfu"] = [self.fpt * s.samples * tc.seq_len / step_s / peak
                                      for s, peak in zip(self.balance_plan.shares, self.rank_peaks)]
            self.logger.log("train", st.step, record)
        info = f"loss {mean_loss:.4f} | {tok_s:,.0f} tok/s | MFU {st.rate['mfu']:.1%}"
        bar.update(task, info=info)
        self.say(f"step {st.step:>6}/{tc.steps} | {info} | lr {lr:.2e} | gnorm {synced[-1][2]:.3f}")

    def validate(self, max_batches: int) -> EvalResult:
        ctx = self.ctx

        def reduce_sum(t: torch.Tensor) -> torch.Tensor:
            return all_gather_rows(ctx, t).sum(0)

        return evaluate(self.model, self.val_samples, self.cfg.train.micro_batch_size, self.device, max_batches,
                        self.byte_lengths, self.precision.autocast, ctx.rank, ctx.world_size,
                        reduce_sum if ctx.distributed else None, lockstep=self.sharded)

    # ---------------------------------------------------------------- persist
    def checkpoint_state(self) -> dict:
        st, tc = self.state, self.cfg.train
        return {
            "consumed_samples": st.consumed,
            "model_config": self.model_cfg.to_dict(),
            "data_dir": str(self.data.out_dir.resolve()),
            "data_fingerprint": self.data.meta.get("fingerprint"),
            "seq_len": tc.seq_len,
            "precision": self.precision.name,
            "world_size": self.ctx.world_size,
            "strategy": self.strategy,
            "balance": self.balance_plan.to_dict(),
            "schedule": {"lr": lr_at(max(st.step - 1, 0), tc), "warmup_steps": tc.warmup_steps, "steps": tc.steps},
        }

    def write_checkpoint(self, final: bool) -> Path | None:
        """Rank 0 writes (with every rank's shards, in a sharded run); all ranks learn whether it
        worked, so none waits on a failed one."""
        ctx, tc = self.ctx, self.cfg.train
        if not tc.save_checkpoints:  # a benchmark: nothing to resume, no GBs to write
            return None
        rngs = all_gather_object(ctx, rng_state())
        self._checkpoints_written += 1
        key = f"checkpoint/{self._checkpoints_written}"  # the others wait through the store: a long write is no hang
        if self.sharded:
            path, error = self._write_sharded(key, rngs)
        else:
            path, error = self._write_replicated(key, rngs)
        if error is not None:
            if final:
                raise CheckpointError(error)
            if ctx.is_main:
                warn(f"{error}; the previous checkpoint is intact, training continues")
        return path

    def _write_replicated(self, key: str, rngs: list) -> tuple[Path | None, str | None]:
        ctx, tc = self.ctx, self.cfg.train
        if self.strategy == "zero1":
            self.optimizer.consolidate_state_dict(to=0)  # every rank sends its part of the state to rank 0
        path, error = None, None
        if ctx.is_main:
            try:
                path = save_checkpoint(self.ckpt_root, self.state.step, self.model,
                                       {"optimizer": self.optimizer, **self.components},
                                       self.checkpoint_state(), tc.keep_checkpoints, rngs, self.tokenizer_path)
            except CheckpointError as err:
                error = str(err)
            if ctx.distributed:
                post(ctx, key, json.dumps([str(path) if path else None, error]))
        elif ctx.distributed:
            written, error = json.loads(wait_for_main(ctx, key, "writing a checkpoint"))
            path = Path(written) if written else None
        return path, error

    def _write_sharded(self, key: str, rngs: list) -> tuple[Path | None, str | None]:
        """Rank 0 opens the temporary directory, every rank writes its shards into it (DCP), rank 0
        adds the rest, the manifest over all files, and publishes it atomically."""
        ctx, tc, step = self.ctx, self.cfg.train, self.state.step
        tmp = lock = None
        error = None
        if ctx.is_main:
            try:
                tmp, lock = begin_publish(self.ckpt_root, step)
            except CheckpointError as err:
                error = str(err)
            post(ctx, key + "/dir", json.dumps([str(tmp) if tmp else None, error]))
        else:
            opened, error = json.loads(wait_for_main(ctx, key + "/dir", "opening a checkpoint"))
            tmp = Path(opened) if opened else None
        if error is not None:
            return None, error
        failed: BaseException | None = None
        try:
            save_sharded(tmp, self.model, self.optimizer)
        except (OSError, RuntimeError) as err:  # DCP raises on every rank when any rank failed
            failed = err
        path = None
        if ctx.is_main:
            try:
                if failed is None:
                    write_extras(tmp, self.components, self.checkpoint_state(), step, rngs, self.tokenizer_path)
            except (OSError, RuntimeError) as err:
                failed = err
            try:
                path = finish_publish(self.ckpt_root, step, tmp, lock, tc.keep_checkpoints,
                                      {"hetforge_version": __version__, "sharded": True}, failed)
            except CheckpointError as err:
                error = str(err)
            post(ctx, key, json.dumps([str(path) if path else None, error]))
        else:
            written, error = json.loads(wait_for_main(ctx, key, "writing a checkpoint"))
            path = Path(written) if written else None
        return path, error

    # ------------------------------------------------------------------ train
    def write_run_config(self) -> None:
        """The config as run, written only once everything it says has been checked: a mistaken
        command must not overwrite the record of the run it was pointed at."""
        if self.ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_config(self.cfg_as_given))

    def train(self, stop_after: int | None = None) -> TrainResult:
        st, tc, ctx = self.state, self.cfg.train, self.ctx
        self.write_run_config()
        self.model.train()
        with StopSignals(announce=ctx.is_main) as stop, \
                make_progress(TextColumn("{task.fields[info]}"), enabled=tc.progress and ctx.is_main) as bar:
            task = bar.add_task("training", total=tc.steps, completed=st.step, info="")
            interval_t0, interval_steps = time.perf_counter(), 0
            while st.step < tc.steps:
                first = st.steps_this_call == 0
                t_step = time.perf_counter()
                step_loss, grad_norm, compute_s = self.train_step()
                if first and self.compiled:  # the first step compiles: its time is the cold start
                    cold = time.perf_counter() - t_step
                    self.say(f"compile: first step {cold:.1f}s (compiling the blocks included)")
                    if ctx.is_main:
                        self.logger.log("event", st.step, {"event": "compile", "first_step_s": cold})
                if first:
                    self.record_state_bytes()
                interval_steps += 1
                bar.advance(task)
                stop_requested = self.observe_step(step_loss, grad_norm, compute_s, stop.signum is not None, bar)
                if st.step % tc.log_interval == 0 or st.step == tc.steps:
                    self.log_interval(time.perf_counter() - interval_t0, interval_steps, bar, task)
                    interval_t0, interval_steps = time.perf_counter(), 0
                # validate and checkpoint (excluded from the throughput figures)
                paused = time.perf_counter()
                if st.step % tc.eval_interval == 0 and st.step < tc.steps:
                    v = self.validate(tc.eval_batches)
                    if ctx.is_main:
                        self.logger.log("val", st.step, v.to_dict())
                    self.say(f"step {st.step:>6} | val loss {v.loss:.4f} | ppl {v.perplexity:.1f}")
                stopping = stop_requested or (stop_after is not None and st.steps_this_call >= stop_after)
                if (st.step % tc.checkpoint_interval == 0 or stopping) and st.step < tc.steps:
                    st.last_checkpoint = self.write_checkpoint(final=False) or st.last_checkpoint
                interval_t0 += time.perf_counter() - paused
                if stopping:
                    break
        return self.finish(stop.signum)

    def release(self) -> None:
        """Drop the wrapped model and optimizer while the process group is still registered.

        Otherwise DDP's reducer can hold the last reference to the gloo group, and its destructor
        (run holding the GIL) joins gloo's worker threads while one of them waits for the GIL to
        free the tensors of the final barrier: the process never exits. Dropped here, the group's
        last reference goes with `destroy_process_group`, whose binding releases the GIL."""
        for name in ("par", "optimizer", "model", "params", "timer", "mesh", "check"):
            if hasattr(self, name):
                setattr(self, name, None)
        gc.collect()

    def finish(self, signum: int | None) -> TrainResult:
        st, tc, ctx = self.state, self.cfg.train, self.ctx
        interrupted = st.step < tc.steps
        self.loader.close()
        self._drain()
        val = None
        if not interrupted:
            val = self.validate(tc.final_eval_batches)
            if ctx.is_main:
                self.logger.log("val", st.step, val.to_dict())
            if st.steps_this_call or st.last_checkpoint is None:  # a finished run that was resumed needs no rewrite
                st.last_checkpoint = self.write_checkpoint(final=True)
        measured = all_gather_object(ctx, self.power_meter.mean_w)
        plot = self.run_dir / "loss_curve.png"
        report = None
        if ctx.is_main:
            if any(w is not None for w in measured):
                self.logger.log("event", st.step, {"event": "power_measured", "measured_w": measured})
            self.logger.close()
            plot_loss_curve(self.logger.path, plot, title=f"{self.cfg.name}: {self.n_params / 1e6:.1f}M params")
            if st.steps_this_call:
                report = write_report(self.run_dir)
        barrier(ctx)
        return TrainResult(
            run_dir=self.run_dir, step=st.step, losses=dict(st.losses), val=val, peak_tflops=self.peak / 1e12,
            checkpoint=st.last_checkpoint, interrupted=interrupted, **st.rate,
            extra={"plot": str(plot), "metrics": str(self.run_dir / "metrics.jsonl"), "params": self.n_params,
                   "flops_per_token": self.fpt, "signal": signum, "rank": ctx.rank, "world_size": ctx.world_size,
                   "plan": self.balance_plan.to_dict(), "report": str(report) if report else None,
                   "peak_source": "configured" if tc.peak_tflops else "measured"},
        )
