"""The training loop: read this file top to bottom to know what one run does.

`train()` joins the process group (torchrun / srun; nothing as one process) and runs a `Trainer`:

    setup    prepare the data (rank 0; cached) -> resolve the run's plan once (`cluster.run_plan`:
             precision, strategy, shares and micro-batches, activation plans...; saved as
             RUN/plan.json and reused on resume) -> build the model as planned -> its weights from
             the newest valid checkpoint
    build    activation plan, optimizer (on the host where planned), loss scaler, their checkpointed
             state, compile, data parallelism (DDP / ZeRO / FSDP2): all read from the plan
    step     `train_step`: each rank's micro-batches, then clip and step (the next step's micro-
             batches are built meanwhile on a worker thread, `data.loader`)
    observe  global loss (reduced on the device, read once per log interval), metrics, step
             observers (the activation plan's check), re-balancing when step times drift
    persist  validation and atomic checkpoints (`train.checkpoint`, DCP for every strategy)

Exact resume: the sample order is a function of the global sample position, the learning rate a
function of the step, and optimizer, loss-scaler and every rank's RNG state are checkpointed, so an
interrupted and resumed run produces bitwise the same losses as an uninterrupted one (fp32, CPU).
Checkpoints store the global position only, so a run can resume on another number or mix of ranks.
"""

from __future__ import annotations

import gc
import hashlib
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from rich.progress import TextColumn

from hetforge.cluster.balance import BALANCE_FILE, DriftMonitor
from hetforge.cluster.dist import (DistContext, all_gather_object, all_gather_rows, barrier, broadcast_object,
                                   init_distributed, is_comm_failure, launch_world_size, peer_failure, post_error,
                                   shutdown, watch_peers)
from hetforge.cluster.facts import LaunchedFacts, LocalView, local_rank_facts
from hetforge.cluster.run_plan import RunPlan, fingerprint, resolve_plan
from hetforge.cluster.spec import (Slowdown, assign_nodes, check_launch, cluster_nodes, declared_devices, device_name,
                                   rank_device)
from hetforge.config import ConfigError, RunConfig, dump_config
from hetforge.core.console import console, make_progress, warn
from hetforge.core.errors import HetforgeError
from hetforge.core.metrics import MetricsLogger
from hetforge.core.precision import Precision, resolve_device
from hetforge.core.process import env_int, process_peak_rss_bytes
from hetforge.evaluate.perplexity import EvalResult, evaluate
from hetforge.memory.executor import apply_plan
from hetforge.memory.verify import PlanCheck
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig, set_head_padding
from hetforge.model.load import TOKENIZER
from hetforge.scaling.accounting import PowerMeter, rank_power, write_report
from hetforge.train.checkpoint import (CheckpointError, CheckpointManager, find_checkpoint, load_model_state,
                                       read_state)
from hetforge.train.checkpoint import resolve as ckpt_resolve
from hetforge.train.metrics import account, log_run_start, plot_loss_curve
from hetforge.train.observers import FirstStepRecord, PlanCheckObserver, StepObserver, StopSignals
from hetforge.train.optim import build_optimizer, lr_at, param_order
from hetforge.train.parallel import (ComputeTimer, Parallel, compile_blocks, device_mesh, init_sharded, local_sharding,
                                     local_state_bytes, parallelize, shard_model)
from hetforge.train.run_data import RunData, open_data
from hetforge.train.pipeline import build_pipeline, evaluate_pipeline, prune_to_stage, stage_parts
from hetforge.train.task_eval import TaskEval
from hetforge.train.step import StepResult, TokenLoss, backward_share, optimizer_step, pipeline_share  # noqa: F401 (the step's API)


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
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # on the device
    rank_times: list[float] = field(default_factory=list)
    final_loss: tuple[int, int, float] | None = None  # the last logging interval's steps and mean loss
    rate: dict[str, float] = field(default_factory=lambda: {"tokens_per_s": 0.0, "tflops": 0.0, "mfu": 0.0})


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return process_peak_rss_bytes() / 2**20


def train(cfg: RunConfig, resume: Literal["auto", "always", "never"] = "auto", stop_after: int | None = None,
          plan_only: bool = False, observers: tuple[StepObserver, ...] = ()) -> TrainResult:
    """Train (or, with plan_only, stop once the run's plan is resolved: `hetforge balance`).
    `observers` watch every step from outside it (benches and tests add their own)."""
    device = resolve_device(cfg.train.device)
    if resume == "never" and env_int("TORCHELASTIC_RESTART_COUNT", default=0) > 0:
        resume = "auto"  # --no-resume is the first launch's: a restart continues the job it restarts
    world = launch_world_size()
    pipe = cfg.parallel.pipeline
    stages = pipe.stages if pipe is not None and pipe.stages != "auto" else 1
    check_launch(cfg.cluster, world, stages=stages)  # before any connection: every rank fails alike
    declared = declared_devices(cluster_nodes(cfg.cluster))
    if world == 1 and declared > 1 and not plan_only:
        warn(f"the cluster declares {declared} devices but this is one process: it trains alone; launch one rank "
             f"per device (torchrun --nproc-per-node / srun) to use them")
    ctx = init_distributed(device.type, cfg.cluster.rendezvous_timeout_s, cfg.cluster.collective_timeout_s)
    if ctx.distributed and device.type == "cuda":
        device = torch.device("cuda", ctx.local_rank)
    trainer = None
    watch_peers(ctx, lambda: (trainer.state.step if trainer else 0, _resume_hint(trainer)))
    try:
        if ctx.distributed:
            assign_nodes(cfg.cluster, ctx, device)  # each rank's declared node, by host, not launch order
            check_launch(cfg.cluster, ctx.world_size, all_gather_object(ctx, (ctx.node_rank, ctx.local_rank)), stages)
        trainer = Trainer(cfg, ctx, device, observers)
        trainer.setup(resume)
        if plan_only:
            trainer.write_run_config()
            return TrainResult(trainer.run_dir, trainer.state.step, {}, None, 0.0, 0.0, 0.0, 0.0, None,
                               extra={"plan": trainer.plan.to_dict(), "rank": ctx.rank, "world_size": ctx.world_size})
        trainer.build()
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
    args = [a for a in sys.argv[1:] if a != "--no-resume"]  # resuming is what the relaunch is for
    command = "hetforge " + " ".join(args) if args else "hetforge train CONFIG"
    last = trainer.state.last_checkpoint if trainer is not None else None
    start = f"from {last}" if last is not None else "from the start (no checkpoint yet)"
    return f"relaunch the same job (torchrun ... {command}) to resume {start}"


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def plan_run(cfg: RunConfig, ctx: DistContext, device: torch.device, shape: GPTNeoXConfig, say) -> RunPlan:
    """The run's plan: the saved one where nothing it depends on changed (a resume on the same
    cluster), else resolved on what every rank measures, saved and printed."""
    run_dir = Path(cfg.run_dir)
    mine = local_rank_facts(cfg, ctx, device)
    ranks = all_gather_object(ctx, mine)
    saved = broadcast_object(ctx, RunPlan.load(run_dir) if ctx.is_main else None)
    if saved is not None and saved.fingerprint == fingerprint(cfg, shape, ranks):
        say(f"reusing the plan in {run_dir / 'plan.json'}")
        return saved

    def sharding(layout, precision: str):  # a proxy sharded as the model will be, on this rank alone
        return local_sharding(device, layout.strategy, Precision(precision, device).compute_dtype, layout.unit_params)

    view = LocalView(mine, cfg, shape, device, Slowdown(rank_device(cfg.cluster, ctx)), sharding)
    plan = broadcast_object(ctx, resolve_plan(cfg, shape, LaunchedFacts(ctx, ranks, view, cfg)))
    if ctx.is_main:
        plan.save(run_dir)
        if ctx.distributed or plan.ranks[0].plan is not None:
            for table in plan.tables():
                say(table)
            say(f"data parallelism: {plan.strategy} ({plan.why['strategy']})")
            if plan.strategy == "zero1" and plan.ranks[0].state_share is not None:
                say("zero1: optimizer state in proportion to memory, rank shares "
                    + ", ".join(f"{r.state_share:.0%}" for r in plan.ranks))
        else:
            say(f"plan: one process, {plan.precision} ({plan.why['precision']}), compile "
                f"{'on' if plan.compile else 'off'}, micro-batches of {plan.balance.shares[0].micro_batch_size}"
                f" ({run_dir / 'plan.txt'})")
    return plan


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, device: torch.device,
                 observers: tuple[StepObserver, ...] = ()):
        self.cfg, self.ctx, self.device = cfg, ctx, device
        self.run_dir = Path(cfg.run_dir)
        self.state = TrainState()
        self.observers: list[StepObserver] = [FirstStepRecord(), *observers]
        self.spec = rank_device(cfg.cluster, ctx)  # this rank's declared device (None: not described)
        self.say = console.print if ctx.is_main else (lambda *a, **k: None)

    # ------------------------------------------------------------------ setup
    def setup(self, resume: str) -> None:
        """Data, the run's plan, the model as planned, and its weights (newest checkpoint, or
        `model.init_from` for continued pre-training, whose shape and tokenizer then hold)."""
        cfg, ctx, tc = self.cfg, self.ctx, self.cfg.train
        if tc.num_threads:
            torch.set_num_threads(tc.num_threads)
        init = ckpt_resolve(cfg.model.init_from) if cfg.model.init_from else None
        self.data: RunData = open_data(cfg, ctx, self.device)
        vocab = self.data.vocab_size
        if cfg.model.vocab_size is not None and cfg.model.vocab_size < vocab:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab}")
        self.shape = GPTNeoXConfig.from_model_config(cfg.model, vocab)
        if init is not None:
            self.shape = GPTNeoXConfig(**read_state(init)["model_config"])
            if _sha256_file(init / TOKENIZER) != _sha256_file(self.data.tokenizer):
                raise ConfigError(f"model.init_from {init} was trained with another tokenizer than the data in "
                                  f"{self.data.out_dir}: prepare the data with the model's own (data.tokenizer.path: "
                                  f"{init / TOKENIZER}, and a new data.out_dir)")
        found = find_checkpoint(self.run_dir / "checkpoints", ctx, resume, warn)
        ck = read_state(found) if found is not None else None
        if ck is not None and ck["model_config"] != self.shape.to_dict():
            raise CheckpointError(f"{found} was written for a different model config; use a new run_dir")
        self.plan = plan_run(cfg, ctx, self.device, self.shape, self.say)
        self.precision = Precision(self.plan.precision, self.device)
        self.task_eval = TaskEval(tc, self.data.tokenizer, self.device, self.precision,
                                  enabled=self.plan.pipeline is None)
        torch.manual_seed(tc.seed)
        self.model = self.build_model()
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", ctx, tc.keep_checkpoints,
                                             self.plan.distributed_state)
        if found is not None:
            load_model_state(found, self.model, self.plan.distributed_state)
            self.state.step, self.state.consumed, self.state.last_checkpoint = int(ck["step"]), ck["consumed_samples"], found
            self.say(f"resumed from {found} (step {self.state.step}, {self.state.consumed} samples consumed)")
        elif init is not None:
            load_model_state(init, self.model, self.plan.distributed_state)
            self.say(f"starting from the weights of {init}")

    def build_model(self) -> torch.nn.Module:
        """The model as planned: on the meta device and sharded where the plan shards (each rank then
        initialises its own shards only), its attention at the planned head size."""
        plan, cfg, rank = self.plan, self.cfg, self.ctx.rank
        if plan.pipeline is not None:  # this rank's stage only, initialised as the whole model would be
            pipe = plan.pipeline
            s = pipe.stage_of(rank)
            with torch.device("meta"):
                model = prune_to_stage(GPTNeoX(self.shape), pipe.blocks(s), s == 0, s == pipe.stages - 1)
            model.to_empty(device=self.device)
            model.reset_parameters(cfg.train.seed)
            model.rotary.reset_buffers()
        elif not plan.sharded:
            model = GPTNeoX.build(self.shape, self.device, cfg.train.seed)
        else:
            with torch.device("meta"):
                model = GPTNeoX(self.shape)
        head = plan.ranks[rank].head_dim
        if head != self.shape.head_dim:
            set_head_padding(model, head)
            self.say(f"attention: head size {self.shape.head_dim} run at {head} (zero channels, exact) so that a "
                     f"fused kernel takes it (model.pad_head_dim={cfg.model.pad_head_dim})")
        if plan.pipeline is not None:  # groups and chunk modules (sharded over the replicas where planned)
            self.stage_parts = stage_parts(plan.pipeline, rank, model, self.device, self.precision.compute_dtype,
                                           plan.ranks[rank].plan)
        if plan.sharded:
            pc = cfg.parallel
            replicate, shard = plan.mesh
            self.mesh = device_mesh(self.ctx, self.device, replicate if replicate > 1 else None, shard)
            shard_model(model, self.mesh, plan.strategy, pc.reshard_after_forward, plan.offload,
                        self.precision.compute_dtype, plan.unit_params)
            init_sharded(model, torch.device("cpu") if plan.offload == "params" else self.device, cfg.train.seed)
        return model

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        """Activation plan, optimizer, loss scaler and their checkpointed state, compile, data
        parallelism, observers: all as the plan says."""
        cfg, ctx, tc, plan = self.cfg, self.ctx, self.cfg.train, self.plan
        mine = plan.ranks[ctx.rank]
        if mine.plan is not None and plan.pipeline is None:  # a pipeline stage's runs in its stage module
            runner = apply_plan(self.model, mine.plan, measure=False)
            self.observers.append(PlanCheckObserver(PlanCheck(
                mine.predicted_held_bytes, mine.predicted_micro_step_s, mine.activation_peak_bytes,
                plan.balance.shares[ctx.rank].micro_batch_size or 1, runner, self.device, cfg.memory.verify_tolerance)))
        offload = mine.optimizer_offload or plan.offload == "optimizer"
        weights = [r.memory_bytes for r in plan.ranks] if mine.state_share is not None else None
        self.optimizer = build_optimizer(self.model, tc, self.device, offload=offload,
                                         zero1=plan.strategy == "zero1", state_weights=weights)
        self.scaler = self.precision.grad_scaler(synced=ctx.distributed)
        self.param_order = param_order(self.model)
        if self.state.last_checkpoint is not None:
            self.checkpoints.load_training(self.state.last_checkpoint, self.model, self.optimizer,
                                           self.param_order, self.scaler)
        if plan.compile:
            compile_blocks(self.model, whole_chain=not ctx.distributed)
        self.loss_fn = TokenLoss()  # its own instance: a slow rank's hooks go on it
        self.pipe = None
        if plan.pipeline is not None:
            self.pipe = build_pipeline(plan.pipeline, ctx.rank, self.stage_parts, self.device, self.loss_fn)
            self.par = Parallel(self.model, "pipeline")
        else:
            self.par = parallelize(self.model, ctx, self.device, plan.strategy, accumulation=plan.accumulation)
        slow = Slowdown(self.spec)  # the simulation knob: each unit slowed where it runs
        m = self.model
        slow.install_per_module([m.embed_in, *m.layers, m.final_layer_norm, m.embed_out, self.loss_fn],
                                lambda: self.state.step)
        # Drift needs each rank's own compute time (`ComputeTimer`); under FSDP a rank's time
        # includes its wait for the slowest at every unit: the plan's balance stands.
        watch = ctx.distributed and cfg.cluster.rebalance and cfg.cluster.balance == "auto" and not plan.distributed_state
        self.balance = plan.balance
        if ctx.is_main:
            self.balance.save(self.run_dir / BALANCE_FILE)
        self.monitor = DriftMonitor(self.balance, cfg.cluster.rebalance_threshold,
                                    cfg.cluster.rebalance_window) if watch else None
        self.timer = ComputeTimer(self.device, self.par.clock)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.acc = account(cfg, ctx, self.model, self.shape, mine.recompute_share, self.balance.global_batch,
                           self.device, self.precision.dtype)
        self.logger = MetricsLogger(self.run_dir, tensorboard=tc.tensorboard, wandb=tc.wandb, project=tc.wandb_project,
                                    name=cfg.name, config=cfg.model_dump(mode="json")) if ctx.is_main else None
        dev = device_name(self.spec, self.device)
        self.power_meter = PowerMeter(self.device)
        log_run_start(cfg, ctx, self.logger, self.state.step, self.acc, self.shape, dev,
                      rank_power(self.spec.power_w if self.spec else None, dev, self.device.type == "cuda"),
                      self.data.source_epochs(tc.steps * self.balance.global_batch))
        self.say(f"model: {self.acc.params / 1e6:.2f}M parameters, {self.shape.n_layers} layers, "
                 f"d={self.shape.d_model}, vocab {self.shape.vocab_size} | batch {self.balance.global_batch}x"
                 f"{tc.seq_len} = {self.acc.tokens_per_step:,} tokens/step | {ctx.world_size} rank(s), "
                 f"{self.device.type} {self.precision.name} | matmul peak {self.acc.peak / 1e12:.2f} TFLOP/s")

    # ------------------------------------------------------------------- step
    def train_step(self) -> StepResult:
        """One optimizer step on this rank's share of the global batch."""
        st, tc = self.state, self.cfg.train
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(st.step, tc)
        mine, following = (self.positions(st.consumed + k * self.balance.global_batch) for k in (0, 1))
        self.loader_request(mine, following)  # this step's micro-batches, then the next step's: built meanwhile
        if self.pipe is None:
            loss, _ = backward_share(self.par, self.data.train, self.data.order, mine, st.consumed,
                                     self.acc.tokens_per_step, self.precision, self.scaler, self.device,
                                     self.data.loader, self.timer, self.loss_fn)
        else:
            loss = pipeline_share(self.pipe, mine, st.consumed, self.acc.tokens_per_step, self.params, self.precision,
                                  self.scaler, self.data.loader, self.timer)
        compute_s = self.timer.step_seconds()  # on a GPU the previous step's, read without a sync
        grad_norm = optimizer_step(self.optimizer, self.scaler, self.params, tc.grad_clip,
                                   self.pipe.norm_group if self.pipe else None)
        if st.steps_this_call == 0:  # before the gradients go: what this rank holds, for the record
            self.held = local_state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        st.step, st.steps_this_call, st.consumed = st.step + 1, st.steps_this_call + 1, st.consumed + self.balance.global_batch
        return StepResult(loss, grad_norm, compute_s, sum(n for _, n in mine))

    def positions(self, consumed: int) -> list[tuple[int, int]]:
        """This rank's micro-batches of the step at `consumed`; a pipeline's ranks take their
        replica's, as one batch (its schedule cuts it)."""
        if self.pipe is None:
            return self.balance.micro_positions(self.ctx.rank, consumed)
        parts = self.balance.micro_positions(self.pipe.replica, consumed)
        return [(parts[0][0], sum(n for _, n in parts))] if parts else []

    def loader_request(self, *steps: list[tuple[int, int]]) -> None:
        for positions in steps:
            self.data.loader.request(positions)

    # ------------------------------------------------------------------ train
    def train(self, stop_after: int | None = None) -> TrainResult:
        st, tc, ctx = self.state, self.cfg.train, self.ctx
        self.write_run_config()
        self.model.train()
        with StopSignals(announce=ctx.is_main) as stop, \
                make_progress(TextColumn("{task.fields[info]}"), enabled=tc.progress and ctx.is_main) as bar:
            task = bar.add_task("training", total=tc.steps, completed=st.step, info="")
            interval_t0, interval_steps = time.perf_counter(), 0
            while st.step < tc.steps:
                for o in self.observers:
                    o.before_step(self)
                result = self.train_step()
                for o in self.observers:
                    o.after_step(self, result)
                interval_steps += 1
                bar.advance(task)
                stop_requested = self.observe_step(result, stop.signum is not None, bar)
                if st.step % tc.log_interval == 0 or st.step == tc.steps:
                    self.log_interval(time.perf_counter() - interval_t0, interval_steps, bar, task)
                    interval_t0, interval_steps = time.perf_counter(), 0
                paused = time.perf_counter()  # validation and checkpoints are not in the throughput
                if st.step % tc.eval_interval == 0 and st.step < tc.steps:
                    self.log_validation(self.validate(tc.eval_batches))
                    self.task_eval(self.model, st.step, st.consumed * tc.seq_len, self.logger, self.say)
                stopping = stop_requested or (stop_after is not None and st.steps_this_call >= stop_after)
                if (st.step % tc.checkpoint_interval == 0 or stopping) and st.step < tc.steps:
                    st.last_checkpoint = self.write_checkpoint(final=False) or st.last_checkpoint
                interval_t0 += time.perf_counter() - paused
                if stopping:
                    break
        return self.finish(stop.signum)

    # ---------------------------------------------------------------- observe
    def observe_step(self, result: StepResult, stop_requested: bool, bar) -> bool:
        """The global view of the step: each rank's compute time and any stop request (host values,
        gathered), drift. The loss stays on the device, this rank's part, until the next log sums
        the interval's losses over the ranks in one collective. Returns whether any rank asked to
        stop."""
        st, ctx = self.state, self.ctx
        st.pending.append((st.step, result.loss, result.grad_norm))
        if not ctx.distributed:
            return stop_requested
        rows = all_gather_rows(ctx, torch.tensor([result.compute_s, float(stop_requested)], dtype=torch.float64))
        st.rank_times = rows[:, 0].tolist()
        new = self.monitor.observe(st.rank_times) if self.monitor else None
        if new is not None:
            old = [s.samples for s in self.balance.shares]
            self.balance = new
            if ctx.is_main:
                new.save(self.run_dir / BALANCE_FILE)
                self.logger.log("event", st.step, {"event": "rebalance", "old_samples": old,
                                                   "new_samples": [s.samples for s in new.shares],
                                                   "rank_compute_s": st.rank_times})
                bar.console.print(f"step {st.step}: step times drifted, re-balanced {old} -> "
                                  f"{[s.samples for s in new.shares]} samples per rank")
        return bool(rows[:, 1].max() > 0)

    def _drain(self) -> list[tuple[int, float, float]]:
        """The pending steps' global losses and grad-norms as numbers: the interval's one host sync,
        and on many ranks its one all-reduce of the losses (not one per step: an asynchronous
        reduction beside FSDP's gathers contends with them on gloo)."""
        pending = self.state.pending
        if not pending:
            return []
        losses = torch.stack([loss for _, loss, _ in pending])
        if self.ctx.distributed:
            dist.all_reduce(losses)
        out = [(s, lv, float(gnorm)) for (s, _, gnorm), lv in zip(pending, losses.tolist())]
        self.state.losses.update({s: lv for s, lv, _ in out})
        pending.clear()
        return out

    def log_interval(self, elapsed: float, steps: int, bar, task) -> None:
        st, tc, device, acc = self.state, self.cfg.train, self.device, self.acc
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        synced = self._drain()
        tok_s = steps * acc.tokens_per_step / elapsed
        self.power_meter.sample()
        st.rate = {"tokens_per_s": tok_s, "tflops": acc.flops_per_token * tok_s / 1e12,
                   "mfu": acc.flops_per_token * tok_s / acc.peak}
        mean_loss = sum(lv for _, lv, _ in synced) / len(synced)
        st.final_loss = (synced[0][0], synced[-1][0], mean_loss)
        lr = lr_at(st.step - 1, tc)
        if self.ctx.is_main:
            record = {"loss": mean_loss, "lr": lr, "grad_norm": synced[-1][2], **st.rate,
                      "hfu": acc.hw_flops_per_token * tok_s / acc.peak, "peak_mem_mb": peak_memory_mb(device),
                      "step_time_s": elapsed / steps, "tokens": st.consumed * tc.seq_len,
                      "loss_scale": float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0}
            if self.ctx.distributed and self.pipe is None:  # each rank's model FLOPs over the step, against its peak
                shares = self.balance.shares
                record.update(rank_compute_s=st.rank_times, rank_samples=[s.samples for s in shares],
                              rank_mfu=[acc.flops_per_token * s.samples * tc.seq_len / (elapsed / steps) / p
                                        for s, p in zip(shares, acc.rank_peaks)])
            self.logger.log("train", st.step, record)
        info = f"loss {mean_loss:.4f} | {tok_s:,.0f} tok/s | MFU {st.rate['mfu']:.1%}"
        bar.update(task, info=info)
        self.say(f"step {st.step:>6}/{tc.steps} | {info} | lr {lr:.2e} | gnorm {synced[-1][2]:.3f}")

    def validate(self, max_batches: int) -> EvalResult:
        ctx = self.ctx

        def reduce_sum(t: torch.Tensor) -> torch.Tensor:
            return all_gather_rows(ctx, t).sum(0)

        if self.pipe is not None:
            self.model.eval()
            part = evaluate_pipeline(self.pipe, self.data.val, self.cfg.train.micro_batch_size, self.device,
                                     max_batches, self.data.byte_lengths, self.precision.autocast)
            self.model.train()
            return EvalResult.from_sums(*reduce_sum(torch.tensor(part, dtype=torch.float64)).tolist())

        return evaluate(self.model, self.data.val, self.cfg.train.micro_batch_size, self.device, max_batches,
                        self.data.byte_lengths, self.precision.autocast, ctx.rank, ctx.world_size,
                        reduce_sum if ctx.distributed else None, lockstep=self.plan.sharded)

    def log_validation(self, v: EvalResult) -> None:
        if self.ctx.is_main:
            self.logger.log("val", self.state.step, v.to_dict())
        self.say(f"step {self.state.step:>6} | val loss {v.loss:.4f} | ppl {v.perplexity:.1f}")

    # ---------------------------------------------------------------- persist
    def write_checkpoint(self, final: bool) -> Path | None:
        """Every rank takes part; all learn whether it worked, so none waits on a failed one."""
        st, tc = self.state, self.cfg.train
        if not tc.save_checkpoints:  # a benchmark: nothing to resume, no GBs to write
            return None
        state = {"consumed_samples": st.consumed, "model_config": self.shape.to_dict(),
                 "data_dir": str(self.data.out_dir.resolve()), "data_fingerprint": self.data.meta.get("fingerprint"),
                 "seq_len": tc.seq_len, "precision": self.precision.name, "world_size": self.ctx.world_size,
                 "strategy": self.plan.strategy, "balance": self.balance.to_dict(),
                 "schedule": {"lr": lr_at(max(st.step - 1, 0), tc), "warmup_steps": tc.warmup_steps, "steps": tc.steps}}
        path, error = self.checkpoints.save(st.step, self.model, self.optimizer, self.param_order, self.scaler,
                                            state, self.data.tokenizer)
        if error is not None:
            if final:
                raise CheckpointError(error)
            if self.ctx.is_main:
                warn(f"{error}; the previous checkpoint is intact, training continues")
        return path

    def write_run_config(self) -> None:
        """The config as run, written only once everything it says has been checked: a mistaken
        command must not overwrite the record of the run it was pointed at."""
        if self.ctx.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))

    def release(self) -> None:
        """Drop the wrapped model and optimizer while the process group is still registered.

        Otherwise DDP's reducer can hold the last reference to the gloo group, and its destructor
        (run holding the GIL) joins gloo's worker threads while one of them waits for the GIL to
        free the tensors of the final barrier: the process never exits. Dropped here, the group's
        last reference goes with `destroy_process_group`, whose binding releases the GIL."""
        for name in ("par", "optimizer", "model", "params", "timer", "mesh", "observers"):
            if hasattr(self, name):
                setattr(self, name, None)
        gc.collect()

    def finish(self, signum: int | None) -> TrainResult:
        st, tc, ctx = self.state, self.cfg.train, self.ctx
        interrupted = st.step < tc.steps
        self.data.loader.close()
        self._drain()
        val = None
        if not interrupted:
            val = self.validate(tc.final_eval_batches)
            if ctx.is_main:
                self.logger.log("val", st.step, val.to_dict())
            self.task_eval(self.model, st.step, st.consumed * tc.seq_len, self.logger, self.say)
            if st.steps_this_call or st.last_checkpoint is None:  # a finished run that was resumed needs no rewrite
                st.last_checkpoint = self.write_checkpoint(final=True)
        measured = all_gather_object(ctx, self.power_meter.mean_w)
        plot, report = self.run_dir / "loss_curve.png", None
        if ctx.is_main:
            if any(w is not None for w in measured):
                self.logger.log("event", st.step, {"event": "power_measured", "measured_w": measured})
            self.logger.close()
            plot_loss_curve(self.logger.path, plot, title=f"{self.cfg.name}: {self.acc.params / 1e6:.1f}M params")
            if st.steps_this_call:
                report = write_report(self.run_dir)
        barrier(ctx)
        return TrainResult(
            run_dir=self.run_dir, step=st.step, losses=dict(st.losses), val=val, peak_tflops=self.acc.peak / 1e12,
            checkpoint=st.last_checkpoint, interrupted=interrupted, **st.rate,
            extra={"plot": str(plot), "metrics": str(self.run_dir / "metrics.jsonl"), "params": self.acc.params,
                   "flops_per_token": self.acc.flops_per_token, "signal": signum, "rank": ctx.rank,
                   "world_size": ctx.world_size, "plan": self.plan.to_dict(), "report": str(report) if report else None,
                   "final_loss": st.final_loss,
                   "peak_source": self.acc.peak_source},
        )
