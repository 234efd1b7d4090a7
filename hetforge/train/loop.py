"""The training loop: read this file top to bottom to know what one run does.

    prepare data (cached) -> build model -> optimizer -> resume from the newest valid checkpoint
    -> for each step: grad-accumulated forward/backward, clip, step -> log / validate / checkpoint
    -> final validation, loss-curve PNG, summary.

Exact resume: the sample order is a function of the global sample position, the learning rate a
function of the step, and optimizer, loss-scaler and RNG state are checkpointed, so an interrupted
and resumed run produces bitwise the same losses as an uninterrupted one (fp32, CPU).

The loss of a step is the sum of token losses over the global batch divided by the number of tokens
in it, computed per micro-batch: the gradient is that of the mean over the global batch whatever the
micro-batch split, which is the property heterogeneous data parallelism builds on.
"""

from __future__ import annotations

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

from hetforge.config import RunConfig, dump_config
from hetforge.console import console, make_progress, warn
from hetforge.data.prepare import prepare
from hetforge.data.shards import PackedSamples, SampleOrder, TokenShard
from hetforge.data.tokenizer import load_tokenizer, token_byte_lengths
from hetforge.evaluate.perplexity import EvalResult, batch_from_numpy, evaluate
from hetforge.model.gpt_neox import GPTNeoX, GPTNeoXConfig
from hetforge.scaling.flops import flops_per_token, measure_matmul_peak
from hetforge.train.checkpoint import (
    CheckpointError,
    latest_valid,
    load_checkpoint,
    save_checkpoint,
)
from hetforge.train.metrics import MetricsLogger, plot_loss_curve
from hetforge.train.optim import build_optimizer, lr_at
from hetforge.train.precision import Precision, resolve_device, resolve_precision

@dataclass
class TrainResult:
    run_dir: Path
    step: int
    losses: dict[int, float]  # step -> train loss, for the steps run by this call
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

    def __init__(self):
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
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


def train(
    cfg: RunConfig,
    resume: Literal["auto", "always", "never"] = "auto",
    stop_after: int | None = None,
) -> TrainResult:
    tc = cfg.train
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    device = resolve_device(tc.device)
    precision = Precision(resolve_precision(tc.precision, device), device)
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    torch.manual_seed(tc.seed)

    # ---- data: prepared shards (a no-op when already prepared), packed windows, global order
    data = prepare(cfg.data, progress=tc.progress)
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
    model = GPTNeoX(model_cfg).to(device)
    optimizer = build_optimizer(model, tc, device)
    scaler = precision.grad_scaler()

    # ---- resume
    step, consumed, last_ckpt = 0, 0, None
    ckpt_root = run_dir / "checkpoints"
    if resume != "never":
        found = latest_valid(ckpt_root)
        if found is None and resume == "always":
            raise CheckpointError(f"--resume given but {ckpt_root} holds no valid checkpoint")
        if found is not None:
            ck = load_checkpoint(found, model, optimizer, scaler)
            if ck.state["model_config"] != model_cfg.to_dict():
                raise CheckpointError(f"{found} was written for a different model config; use a new run_dir")
            step, consumed, last_ckpt = ck.step, ck.state["consumed_samples"], found
            console.print(f"resumed from {found} (step {step}, {consumed} samples consumed)")

    # ---- accounting
    n_params = model.num_parameters()
    fpt = flops_per_token(model_cfg.n_layers, model_cfg.d_model, model_cfg.d_ff, model_cfg.vocab_size, tc.seq_len)
    peak = tc.peak_tflops * 1e12 if tc.peak_tflops else measure_matmul_peak(device, precision.dtype)
    global_batch = tc.global_batch_size
    tokens_per_step = global_batch * tc.seq_len
    console.print(
        f"model: {n_params / 1e6:.2f}M parameters, {model_cfg.n_layers} layers, d={model_cfg.d_model}, "
        f"vocab {vocab} | batch {global_batch}x{tc.seq_len} = {tokens_per_step:,} tokens/step | "
        f"{device.type} {precision.name} | matmul peak {peak / 1e12:.2f} TFLOP/s"
    )

    def checkpoint_state() -> dict:
        return {
            "consumed_samples": consumed,
            "model_config": model_cfg.to_dict(),
            "data_dir": str(data.out_dir),
            "tokenizer": str(tokenizer_path),
            "seq_len": tc.seq_len,
            "precision": precision.name,
            "schedule": {"lr": lr_at(max(step - 1, 0), tc), "warmup_steps": tc.warmup_steps, "steps": tc.steps},
        }

    def write_checkpoint(final: bool) -> Path | None:
        try:
            return save_checkpoint(ckpt_root, step, model, optimizer, scaler, checkpoint_state(), tc.keep_checkpoints)
        except CheckpointError as err:
            if final:
                raise
            warn(f"{err}; the previous checkpoint is intact, training continues")
            return None

    def validate(max_batches: int) -> EvalResult:
        return evaluate(model, val_samples, tc.micro_batch_size, device, max_batches, byte_lengths, precision.autocast)

    logger = MetricsLogger(run_dir, tensorboard=tc.tensorboard)
    params = [p for p in model.parameters() if p.requires_grad]
    losses: dict[int, float] = {}
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, grad-norm) not yet synced
    rate = {"tokens_per_s": 0.0, "tflops": 0.0, "mfu": 0.0}
    steps_this_call = 0
    model.train()

    with StopSignals() as stop, make_progress(TextColumn("{task.fields[info]}"), enabled=tc.progress) as bar:
        task = bar.add_task("training", total=tc.steps, completed=step, info="")
        interval_t0, interval_steps = time.perf_counter(), 0
        while step < tc.steps:
            # -- one optimizer step over the global batch, in grad_accum micro-batches
            lr = lr_at(step, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_loss = torch.zeros((), device=device)
            for micro in range(tc.grad_accum):
                idx = order.indices(consumed + micro * tc.micro_batch_size, tc.micro_batch_size)
                x, y = batch_from_numpy(train_samples.batch(idx), device)
                with precision.autocast():
                    logits = model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / (
                    global_batch * tc.seq_len
                )
                scaler.scale(loss).backward()
                step_loss += loss.detach()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip if tc.grad_clip > 0 else float("inf"))
            scaler.step(optimizer)  # skipped (and the scale halved) if fp16 gradients overflowed
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            steps_this_call += 1
            consumed += global_batch
            interval_steps += 1
            pending.append((step, step_loss, grad_norm))
            bar.advance(task)

            # -- log: one host sync per interval, not per step
            if step % tc.log_interval == 0 or step == tc.steps:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - interval_t0
                synced = [(s, float(lv), float(g)) for s, lv, g in pending]
                pending.clear()
                for s, lv, _ in synced:
                    losses[s] = lv
                tok_s = interval_steps * tokens_per_step / elapsed
                rate = {"tokens_per_s": tok_s, "tflops": fpt * tok_s / 1e12, "mfu": fpt * tok_s / peak}
                mean_loss = sum(lv for _, lv, _ in synced) / len(synced)
                record = {
                    "loss": mean_loss, "lr": lr, "grad_norm": synced[-1][2], **rate,
                    "hfu": rate["mfu"], "peak_mem_mb": peak_memory_mb(device),
                    "tokens": consumed * tc.seq_len, "loss_scale": float(scaler.get_scale()) if scaler.is_enabled() else 1.0,
                }
                logger.log("train", step, record)
                info = f"loss {mean_loss:.4f} | {tok_s:,.0f} tok/s | MFU {rate['mfu']:.1%}"
                bar.update(task, info=info)
                bar.console.print(f"step {step:>6}/{tc.steps} | {info} | lr {lr:.2e} | gnorm {synced[-1][2]:.3f}")
                interval_t0, interval_steps = time.perf_counter(), 0

            # -- validate and checkpoint (excluded from the throughput figures)
            paused = time.perf_counter()
            if step % tc.eval_interval == 0 and step < tc.steps:
                v = validate(tc.eval_batches)
                logger.log("val", step, v.to_dict())
                bar.console.print(f"step {step:>6} | val loss {v.loss:.4f} | ppl {v.perplexity:.1f}")
            stopping = stop.signum is not None or (stop_after is not None and steps_this_call >= stop_after)
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
        logger.log("val", step, val.to_dict())
        if steps_this_call or last_ckpt is None:  # a finished run that was resumed needs no rewrite
            last_ckpt = write_checkpoint(final=True)
    logger.close()
    plot = plot_loss_curve(logger.path, run_dir / "loss_curve.png", title=f"{cfg.name}: {n_params / 1e6:.1f}M params")
    result = TrainResult(
        run_dir=run_dir, step=step, losses=losses, val=val, peak_tflops=peak / 1e12,
        checkpoint=last_ckpt, interrupted=interrupted, **rate,
        extra={"plot": str(plot), "metrics": str(logger.path), "params": n_params,
               "flops_per_token": fpt, "signal": stop.signum,
               "peak_source": "configured" if tc.peak_tflops else "measured"},
    )
    return result
