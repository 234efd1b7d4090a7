"""The training loop: read this file top to bottom to know what one run does.

    join the process group (torchrun / srun; nothing when run as one process) -> one precision for
    all ranks -> prepare data (rank 0; cached) -> build model -> resume its weights from the newest
    valid checkpoint -> split the global batch over the ranks by measured speed and memory -> plan
    each rank's activation memory -> optimizer (on the host where the device is too small for it),
    with its checkpointed state
    -> for each step: each rank runs its micro-batches (gradient sync only on the last), clip, step
    -> global metrics / validate / checkpoint (rank 0) / re-balance if step times drift
    -> final validation, loss-curve PNG, summary.

Exact update on unequal ranks: every micro-batch's loss is its *sum* of token losses divided by the
number of tokens in the whole global batch, so after the all-reduce the gradient is that of the mean
loss over the global batch, whatever share and micro-batch split each rank has (DDP averages over
ranks, so each rank multiplies by the world size). A rank with no samples in a step runs one dummy
micro-batch with weight zero, so it still takes part in every collective (HetSeq's dummy batch).

Exact resume: the sample order is a function of the global sample position, the learning rate a
function of the step, and optimizer, loss-scaler and RNG state are checkpointed, so an interrupted
and resumed run produces bitwise the same losses as an uninterrupted one (fp32, CPU). Checkpoints
store the global position only, so a run can resume on a different number or mix of ranks.
"""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from rich.progress import TextColumn
from torch.nn.parallel import DistributedDataParallel

from hetforge.cluster.assign import PLAN_FILE, DriftMonitor, plan_for_run
from hetforge.cluster.capability import detect, run_precision
from hetforge.cluster.dist import (
    DistContext,
    all_gather_object,
    all_gather_rows,
    barrier,
    broadcast_object,
    init_distributed,
    shutdown,
)
from hetforge.cluster.spec import Slowdown, device_name, rank_device
from hetforge.config import ConfigError, RunConfig, dump_config
from hetforge.console import console, make_progress, warn
from hetforge.data.prepare import prepare
from hetforge.data.shards import PackedSamples, SampleOrder, TokenShard
from hetforge.data.tokenizer import load_tokenizer, token_byte_lengths
from hetforge.evaluate.perplexity import EvalResult, batch_from_numpy, evaluate
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig
from hetforge.scaling.accounting import PowerMeter, rank_power, write_report
from hetforge.scaling.flops import block_forward_flops_per_token, flops_per_token, matmul_params, measure_matmul_peak
from hetforge.train.checkpoint import (
    CheckpointError,
    latest_valid,
    load_checkpoint,
    load_training_state,
    load_weights,
    save_checkpoint,
)
from hetforge.train.checkpoint import resolve as ckpt_resolve
from hetforge.train.metrics import MetricsLogger, plot_loss_curve
from hetforge.train.optim import build_optimizer, lr_at
from hetforge.train.precision import Precision, resolve_device


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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS


def backward_share(
    net: torch.nn.Module,
    samples: PackedSamples,
    order: SampleOrder,
    micro_batches: list[tuple[int, int]],
    consumed: int,
    tokens_per_step: int,
    world_size: int,
    precision: Precision,
    scaler: torch.amp.GradScaler,
    device: torch.device,
    after_forward=None,
    clock: "BucketClock | None" = None,
) -> tuple[torch.Tensor, float]:
    """Forward/backward of this rank's micro-batches (given as (global position, count)) with the
    gradient sync only on the last one. Returns this rank's part of the step loss and its compute
    seconds, waiting for other ranks excluded (the balancer needs this rank's own speed). With no
    micro-batches it runs one dummy micro-batch of weight 0, so that the rank still joins the
    step's all-reduce."""
    distributed = isinstance(net, DistributedDataParallel)
    work = micro_batches or [(consumed, 1)]
    weight = world_size if micro_batches else 0.0  # DDP averages over ranks: undo it
    step_loss = torch.zeros((), device=device)
    compute_s = 0.0
    for j, (start, count) in enumerate(work):
        synced = j == len(work) - 1 and distributed
        with contextlib.nullcontext() if synced or not distributed else net.no_sync():
            t0 = time.perf_counter()
            x, y = batch_from_numpy(samples.batch(order.indices(start, count)), device)
            with precision.autocast():
                logits = net(x)
            if after_forward is not None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                after_forward(time.perf_counter() - t0)
            token_loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            # Nothing saved for the backward refers to the logits: let them go now, not after the
            # backward (or the next micro-batch's forward). At a 50k vocabulary that is GBs.
            del logits
            if clock is not None:
                clock.last = None
            scaler.scale(token_loss * weight / tokens_per_step).backward()
            end = time.perf_counter()
            if synced and clock is not None and clock.last is not None:
                end = clock.last  # when the last gradient bucket was ready: before the all-reduce wait
            compute_s += end - t0
        if micro_batches:
            step_loss += token_loss.detach() / tokens_per_step
    return step_loss, compute_s


class BucketClock:
    """A DDP communication hook that notes when each gradient bucket is ready, then all-reduces it
    as DDP would: the last note is the end of this rank's backward compute, before any waiting for
    slower ranks, while keeping DDP's overlap of communication with the backward pass."""

    def __init__(self):
        self.last: float | None = None

    def hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.last = time.perf_counter()
        return allreduce_hook(state, bucket)


def train(
    cfg: RunConfig,
    resume: Literal["auto", "always", "never"] = "auto",
    stop_after: int | None = None,
    plan_only: bool = False,
) -> TrainResult:
    """Train (or, with plan_only, stop once the batch balance is made: `hetforge balance`)."""
    device = resolve_device(cfg.train.device)
    ctx = init_distributed(device.type, cfg.cluster.rendezvous_timeout_s, cfg.cluster.collective_timeout_s)
    if ctx.distributed and device.type == "cuda":
        device = torch.device("cuda", ctx.local_rank)
    try:
        return _train(cfg, ctx, device, resume, stop_after, plan_only)
    finally:
        if ctx.distributed:
            shutdown()


def _sha256_file(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def _apply_memory_plan(cfg, ctx, model, model_cfg, device, plan, run_dir, say):
    """Plan this rank's activations for the micro-batch it was given (and install the plan); the
    main rank prints every rank's plan side by side and saves them to RUN/memory/plans.json."""
    if not cfg.memory.active:
        return None
    import json

    from rich.markup import escape
    from rich.table import Table

    from hetforge.cluster.spec import device_memory_bytes
    from hetforge.memory.device_plan import plan_for_config
    from hetforge.memory.executor import apply_plan
    from hetforge.memory.plan import format_bytes
    from hetforge.memory.verify import PlanCheck

    micro = plan.shares[ctx.rank].micro_batch_size or 1
    dp = plan_for_config(cfg, model_cfg, device, micro, device_memory_bytes(rank_device(cfg.cluster, ctx), device),
                         run_dir / "memory", ctx.backend if ctx.distributed else None)
    runner = apply_plan(model, dp.plan, measure=False)  # the check measures one step
    p = dp.prediction
    mine = {"rank": ctx.rank, "device": plan.shares[ctx.rank].device, "micro_batch": micro, "budget": dp.budget,
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
        say(t)
        (run_dir / "memory").mkdir(parents=True, exist_ok=True)
        (run_dir / "memory" / "plans.json").write_text(json.dumps(rows, indent=1))
    return PlanCheck(dp, runner, device, cfg.memory.verify_tolerance)


def _train(cfg: RunConfig, ctx: DistContext, device: torch.device, resume: str, stop_after: int | None,
           plan_only: bool) -> TrainResult:
    tc = cfg.train
    say = console.print if ctx.is_main else (lambda *a, **k: None)
    run_dir = Path(cfg.run_dir)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    # One precision for the whole run, set by its weakest device, stated once.
    caps = all_gather_object(ctx, detect(device))
    chosen, why = run_precision(caps) if tc.precision == "auto" else (tc.precision, "as configured")
    precision = Precision(chosen, device)
    say(f"precision {chosen}: {why}")
    if tc.precision == "auto":  # what plans, probes and checkpoints below read is the decision
        cfg = cfg.model_copy(deep=True)
        cfg.train.precision = chosen
        tc = cfg.train
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    torch.manual_seed(tc.seed)

    # ---- continued pre-training: the starting weights fix the model's shape and tokenizer
    init = None
    if cfg.model.init_from:
        init = ckpt_resolve(cfg.model.init_from)
        init_state = json.loads((init / "state.json").read_text())

    # ---- data: rank 0 prepares (a no-op when cached), the others then open the same shards
    if ctx.is_main:
        data = prepare(cfg.data, progress=tc.progress)
    barrier(ctx)
    if not ctx.is_main:
        data = prepare(cfg.data, progress=False, verbose=False)
    train_samples = PackedSamples(TokenShard(data.out_dir, "train"), tc.seq_len, "train")
    val_samples = PackedSamples(TokenShard(data.out_dir, "val"), tc.seq_len, "val")
    order = SampleOrder(len(train_samples), tc.seed)
    tokenizer_path = data.out_dir / "tokenizer.json"
    byte_lengths = token_byte_lengths(load_tokenizer(tokenizer_path))

    # ---- model and optimizer
    vocab = data.meta["vocab_size"]
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < vocab:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab}")
    model_cfg = GPTNeoXConfig.from_model_config(cfg.model, vocab)
    if init is not None:
        model_cfg = GPTNeoXConfig(**init_state["model_config"])
        if _sha256_file(Path(init_state["tokenizer"])) != _sha256_file(tokenizer_path):
            raise ConfigError(f"model.init_from {init} was trained with another tokenizer than the data in "
                              f"{data.out_dir}: prepare the data with the model's own (data.tokenizer.path: "
                              f"{init_state['tokenizer']}, and a new data.out_dir)")
    model = GPTNeoX(model_cfg).to(device)
    scaler = precision.grad_scaler()

    # ---- resume (every rank reads the same checkpoint; it holds the global sample position). The
    # weights and position now; optimizer, scaler and RNG once the optimizer exists, as the memory
    # plan may put it on the host.
    step, consumed, last_ckpt = 0, 0, None
    ckpt_root = run_dir / "checkpoints"
    if resume != "never":
        found = latest_valid(ckpt_root) if ctx.is_main else None
        found = broadcast_object(ctx, found)
        if found is None and resume == "always":
            raise CheckpointError(f"--resume given but {ckpt_root} holds no valid checkpoint")
        if found is not None:
            ck = load_checkpoint(found, model, restore_rng=False)
            if ck.state["model_config"] != model_cfg.to_dict():
                raise CheckpointError(f"{found} was written for a different model config; use a new run_dir")
            step, consumed, last_ckpt = ck.step, ck.state["consumed_samples"], found
            say(f"resumed from {found} (step {step}, {consumed} samples consumed)")
    if init is not None and last_ckpt is None:
        load_weights(init, model)
        say(f"starting from the weights of {init}")

    # ---- the share of the global batch each rank computes
    plan = plan_for_run(cfg, ctx, model, device, precision.autocast, vocab, run_dir, console if ctx.is_main else None)
    if plan_only:
        return TrainResult(run_dir, step, {}, None, 0.0, 0.0, 0.0, 0.0, last_ckpt,
                           extra={"plan": plan.to_dict(), "rank": ctx.rank, "world_size": ctx.world_size})
    # Drift needs each rank's own compute time; on CPU the DDP hook gives it (BucketClock), on a GPU
    # host timestamps run ahead of the kernels, so re-balancing stays off there until CUDA-event
    # timing lands.
    watch = ctx.distributed and cfg.cluster.rebalance and cfg.cluster.balance == "auto"
    if watch and device.type == "cuda":
        say("re-balancing on drift is CPU-only for now; the initial balance holds for this run")
        watch = False
    monitor = DriftMonitor(plan, cfg.cluster.rebalance_threshold, cfg.cluster.rebalance_window) if watch else None
    slowdown = Slowdown(rank_device(cfg.cluster, ctx))  # None (no slowdown) when the cluster is not described
    check = _apply_memory_plan(cfg, ctx, model, model_cfg, device, plan, run_dir, say)
    offload = check is not None and check.dp.optimizer_offload
    optimizer = build_optimizer(model, tc, device, offload=offload)
    if offload:
        say(f"rank {ctx.rank}: optimizer state in host memory (it does not fit beside the weights and gradients)")
    if last_ckpt is not None:
        load_training_state(last_ckpt, optimizer, scaler)
    net, clock = model, None
    if ctx.distributed:
        # gradients as views of DDP's buckets: one copy of them, not two
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      gradient_as_bucket_view=True)
        if device.type == "cpu":  # on a GPU the host-side note would run ahead of the kernels
            clock = BucketClock()
            net.register_comm_hook(None, clock.hook)

    # ---- accounting
    n_params = model.num_parameters()
    fpt = flops_per_token(model_cfg.n_layers, model_cfg.d_model, model_cfg.d_ff, model_cfg.vocab_size, tc.seq_len)
    # Hardware FLOPs add the recomputation of this rank's memory plan: the share of the blocks'
    # forward it repeats (by the planner's profiled times) times the blocks' forward FLOPs.
    hw_fpt = fpt
    if check is not None:
        pred = check.dp.prediction
        blocks_fwd = sum(b.fwd_s for b in check.dp.profile.blocks)
        if blocks_fwd > 0:
            hw_fpt += pred.breakdown_time["recompute"] / blocks_fwd * block_forward_flops_per_token(
                model_cfg.n_layers, model_cfg.d_model, model_cfg.d_ff, tc.seq_len)
    peak = tc.peak_tflops * 1e12 if tc.peak_tflops else measure_matmul_peak(device, precision.dtype)
    peak *= ctx.world_size  # MFU of the whole job against the sum of the ranks' peaks (rank 0's, x world)
    global_batch = plan.global_batch
    tokens_per_step = global_batch * tc.seq_len
    say(
        f"model: {n_params / 1e6:.2f}M parameters, {model_cfg.n_layers} layers, d={model_cfg.d_model}, "
        f"vocab {vocab} | batch {global_batch}x{tc.seq_len} = {tokens_per_step:,} tokens/step | "
        f"{ctx.world_size} rank(s), {device.type} {precision.name} | matmul peak {peak / 1e12:.2f} TFLOP/s"
    )

    def checkpoint_state() -> dict:
        return {
            "consumed_samples": consumed,
            "model_config": model_cfg.to_dict(),
            "data_dir": str(data.out_dir),
            "tokenizer": str(tokenizer_path),
            "seq_len": tc.seq_len,
            "precision": precision.name,
            "world_size": ctx.world_size,
            "schedule": {"lr": lr_at(max(step - 1, 0), tc), "warmup_steps": tc.warmup_steps, "steps": tc.steps},
        }

    def write_checkpoint(final: bool) -> Path | None:
        """Rank 0 writes; all ranks learn whether it worked, so none waits on a failed one."""
        path, error = None, None
        if not tc.save_checkpoints:  # a benchmark: nothing to resume, no GBs to write
            return None
        if ctx.is_main:
            try:
                path = save_checkpoint(ckpt_root, step, model, optimizer, scaler, checkpoint_state(), tc.keep_checkpoints)
            except CheckpointError as err:
                error = str(err)
        path, error = broadcast_object(ctx, (path, error))
        if error is not None:
            if final:
                raise CheckpointError(error)
            if ctx.is_main:
                warn(f"{error}; the previous checkpoint is intact, training continues")
        return path

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        return all_gather_rows(ctx, t).sum(0)

    def validate(max_batches: int) -> EvalResult:
        return evaluate(model, val_samples, tc.micro_batch_size, device, max_batches, byte_lengths,
                        precision.autocast, ctx.rank, ctx.world_size, reduce_sum if ctx.distributed else None)

    logger = MetricsLogger(run_dir, tensorboard=tc.tensorboard) if ctx.is_main else None
    # What this invocation runs on, once: the report (hetforge report) derives FLOPs, utilisation,
    # wall time and energy from it and the train records.
    spec = rank_device(cfg.cluster, ctx)
    dev_name = device_name(spec, device)
    power, power_source = rank_power(spec.power_w if spec else None, dev_name, device.type == "cuda")
    power_meter = PowerMeter(device)
    ranks = all_gather_object(ctx, {"rank": ctx.rank, "device": dev_name, "power_w": power,
                                    "power_source": power_source})
    if ctx.is_main:
        logger.log("event", step, {
            "event": "run_start", "params": n_params, "flops_per_token": fpt, "hw_flops_per_token": hw_fpt,
            "matmul_params": matmul_params(model_cfg.n_layers, model_cfg.d_model, model_cfg.d_ff, model_cfg.vocab_size),
            "seq_len": tc.seq_len, "tokens_per_step": tokens_per_step, "ranks": ranks})
    params = [p for p in model.parameters() if p.requires_grad]
    losses: dict[int, float] = {}
    pending: list[tuple[int, torch.Tensor | float, torch.Tensor]] = []  # (step, loss, grad-norm) not yet synced
    rate = {"tokens_per_s": 0.0, "tflops": 0.0, "mfu": 0.0}
    steps_this_call = 0
    rank_times: list[float] = []
    model.train()

    with StopSignals(announce=ctx.is_main) as stop, \
            make_progress(TextColumn("{task.fields[info]}"), enabled=tc.progress and ctx.is_main) as bar:
        task = bar.add_task("training", total=tc.steps, completed=step, info="")
        interval_t0, interval_steps = time.perf_counter(), 0
        while step < tc.steps:
            # -- one optimizer step: this rank's micro-batches of the global batch
            lr = lr_at(step, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            mine = plan.micro_positions(ctx.rank, consumed)
            checking = check is not None and check.before(steps_this_call, params, not ctx.distributed)
            step_loss, compute_s = backward_share(
                net, train_samples, order, mine, consumed, tokens_per_step, ctx.world_size, precision, scaler,
                device, after_forward=lambda seconds: slowdown.after_forward(seconds, step), clock=clock,
            )
            if checking:
                record, warnings = check.after(compute_s, sum(n for _, n in mine))
                for w in warnings:
                    warn(f"rank {ctx.rank}: {w}")
                if record is not None and ctx.is_main:
                    logger.log("event", step + 1, record)
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip if tc.grad_clip > 0 else float("inf"))
            scaler.step(optimizer)  # skipped (and the scale halved) if fp16 gradients overflowed
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            steps_this_call += 1
            consumed += global_batch
            interval_steps += 1
            bar.advance(task)

            # -- global view of the step: loss summed over ranks, each rank's time, any stop request
            stop_requested = stop.signum is not None
            if ctx.distributed:
                rows = all_gather_rows(ctx, torch.stack([step_loss.double().cpu(), torch.tensor(compute_s, dtype=torch.float64),
                                                         torch.tensor(float(stop_requested), dtype=torch.float64)]))
                pending.append((step, float(rows[:, 0].sum()), grad_norm))
                rank_times = rows[:, 1].tolist()
                stop_requested = bool(rows[:, 2].max() > 0)
                new_plan = monitor.observe(rank_times) if monitor else None
                if new_plan is not None:
                    old = [s.samples for s in plan.shares]
                    plan = new_plan
                    if ctx.is_main:
                        plan.save(run_dir / PLAN_FILE)
                        logger.log("event", step, {"event": "rebalance", "old_samples": old,
                                                   "new_samples": [s.samples for s in plan.shares],
                                                   "rank_compute_s": rank_times})
                        bar.console.print(f"step {step}: step times drifted, re-balanced {old} -> "
                                          f"{[s.samples for s in plan.shares]} samples per rank")
            else:
                pending.append((step, step_loss, grad_norm))

            # -- log: one host sync per interval on a single process
            if step % tc.log_interval == 0 or step == tc.steps:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - interval_t0
                synced = [(s, float(lv), float(g)) for s, lv, g in pending]
                pending.clear()
                for s, lv, _ in synced:
                    losses[s] = lv
                tok_s = interval_steps * tokens_per_step / elapsed
                power_meter.sample()
                rate = {"tokens_per_s": tok_s, "tflops": fpt * tok_s / 1e12, "mfu": fpt * tok_s / peak}
                mean_loss = sum(lv for _, lv, _ in synced) / len(synced)
                if ctx.is_main:
                    record = {
                        "loss": mean_loss, "lr": lr, "grad_norm": synced[-1][2], **rate,
                        "hfu": hw_fpt * tok_s / peak, "peak_mem_mb": peak_memory_mb(device),
                        "step_time_s": elapsed / interval_steps, "tokens": consumed * tc.seq_len,
                        "loss_scale": float(scaler.get_scale()) if scaler.is_enabled() else 1.0,
                    }
                    if ctx.distributed:
                        record["rank_compute_s"] = rank_times
                        record["rank_samples"] = [s.samples for s in plan.shares]
                    logger.log("train", step, record)
                info = f"loss {mean_loss:.4f} | {tok_s:,.0f} tok/s | MFU {rate['mfu']:.1%}"
                bar.update(task, info=info)
                say(f"step {step:>6}/{tc.steps} | {info} | lr {lr:.2e} | gnorm {synced[-1][2]:.3f}")
                interval_t0, interval_steps = time.perf_counter(), 0

            # -- validate and checkpoint (excluded from the throughput figures)
            paused = time.perf_counter()
            if step % tc.eval_interval == 0 and step < tc.steps:
                v = validate(tc.eval_batches)
                if ctx.is_main:
                    logger.log("val", step, v.to_dict())
                say(f"step {step:>6} | val loss {v.loss:.4f} | ppl {v.perplexity:.1f}")
            stopping = stop_requested or (stop_after is not None and steps_this_call >= stop_after)
            if (step % tc.checkpoint_interval == 0 or stopping) and step < tc.steps:
                last_ckpt = write_checkpoint(final=False) or last_ckpt
            interval_t0 += time.perf_counter() - paused
            if stopping:
                break

    interrupted = step < tc.steps
    for s, lv, _ in pending:
        losses[s] = float(lv)
    val = None
    if not interrupted:
        val = validate(tc.final_eval_batches)
        if ctx.is_main:
            logger.log("val", step, val.to_dict())
        if steps_this_call or last_ckpt is None:  # a finished run that was resumed needs no rewrite
            last_ckpt = write_checkpoint(final=True)
    measured = all_gather_object(ctx, power_meter.mean_w)
    plot = run_dir / "loss_curve.png"
    report = None
    if ctx.is_main:
        if any(w is not None for w in measured):
            logger.log("event", step, {"event": "power_measured", "measured_w": measured})
        logger.close()
        plot_loss_curve(logger.path, plot, title=f"{cfg.name}: {n_params / 1e6:.1f}M params")
        if steps_this_call:
            report = write_report(run_dir)
    barrier(ctx)
    return TrainResult(
        run_dir=run_dir, step=step, losses=losses, val=val, peak_tflops=peak / 1e12,
        checkpoint=last_ckpt, interrupted=interrupted, **rate,
        extra={"plot": str(plot), "metrics": str(run_dir / "metrics.jsonl"), "params": n_params,
               "flops_per_token": fpt, "signal": stop.signum, "rank": ctx.rank, "world_size": ctx.world_size,
               "plan": plan.to_dict(), "report": str(report) if report else None,
               "peak_source": "configured" if tc.peak_tflops else "measured"},
    )
