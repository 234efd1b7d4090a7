"""Measuring what the planner prices: per block and per option, forward/backward/recompute time and
the bytes kept on the device, copied to host, and at the block's own peak; the head (final norm,
logits, loss) likewise; and the host link.

Blocks of a GPT-NeoX are identical, so one standalone block is measured (under every option, through
the real executor) and repeated n times: profiling forge-l needs one block's memory, not 22B
parameters. Bytes come from the executor's ledger (saved-tensor hooks, per storage) and so are
exact; on a GPU the block's own peaks are `max_memory_allocated`, on CPU (no allocator statistics)
they are the held tensors plus the block's output and gradient buffers. Profiles are cached per
(model, micro-batch, seq, precision, device, link).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hetforge.memory.executor import ActivationLedger, PlanRunner, parameter_storages
from hetforge.memory.plan import OPTIONS, BlockProfile, ModelProfile, OptionCost, Plan
from hetforge.model.gpt_neox import Block, GPTNeoXConfig, RotaryEmbedding
from hetforge.model.presets import count_parameters
from hetforge.train.precision import DTYPES, Precision

DEFAULT_CPU_LINK = 12e9  # bytes/s: a PCIe 3.0 x16 link as GPUs of the legacy class see it
OPTIMIZER_BYTES = {"adamw": 8, "lamb": 8, "sgd": 0}
PROFILE_VERSION = 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):  # first is warm-up
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_link(device: torch.device, nbytes: int = 256 * 2**20) -> float:
    """Host<->device bandwidth (bytes/s, the slower direction) with pinned memory."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), device, 3)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), device, 3)
    return nbytes / max(d2h, h2d)


def static_bytes(cfg: GPTNeoXConfig, optimizer: str = "adamw") -> dict[str, float]:
    n = count_parameters(cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.tie_embeddings)["total"]
    # fp32 master weights and gradients (autocast computes in bf16/fp16 from them)
    return {"weights": 4.0 * n, "gradients": 4.0 * n, "optimizer state": float(OPTIMIZER_BYTES[optimizer] * n)}


def _cache_key(cfg: GPTNeoXConfig, micro_batch: int, seq: int, precision: str, device: torch.device,
               link: float | None, optimizer: str) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    blob = json.dumps([PROFILE_VERSION, cfg.to_dict(), micro_batch, seq, precision, name, link, optimizer,
                       torch.__version__], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _autocast(precision: str, device: torch.device):
    return Precision(precision, device).autocast()


def _label_modules(block: Block, ledger: ActivationLedger) -> list:
    """Name the module that saves each tensor, for the per-tensor table."""
    names = {
        "input_layernorm": "attn: norm (input x, mean, rstd)",
        "attention.query_key_value": "attn: QKV projection input",
        "attention.dense": "attn: output projection input",
        "post_attention_layernorm": "mlp: norm",
        "mlp.dense_h_to_4h": "mlp: up-projection input",
        "mlp.dense_4h_to_h": "mlp: down-projection input (GELU output)",
    }
    after = {
        "attention.query_key_value": "attn: rotary + SDPA (q, k, v, output, logsumexp)",
        "mlp.dense_h_to_4h": "mlp: GELU input (hidden)",
    }
    handles = []
    for path, label in names.items():
        mod = block.get_submodule(path)
        handles.append(mod.register_forward_pre_hook(lambda m, a, label=label: setattr(ledger, "label", label)))
        if path in after:
            handles.append(mod.register_forward_hook(lambda m, a, o, lb=after[path]: setattr(ledger, "label", lb)))
    return handles


def profile_block(cfg: GPTNeoXConfig, micro_batch: int, seq: int, precision: str, device: torch.device,
                  repeats: int = 3) -> BlockProfile:
    torch.manual_seed(0)
    block = Block(cfg).to(device)
    rot = RotaryEmbedding(cfg.rotary_dims, cfg.rotary_base).to(device)
    cos, sin = rot.cos_sin(seq, device)
    params = parameter_storages(block)
    x0 = torch.randn(micro_batch, seq, cfg.d_model, device=device, dtype=DTYPES[precision])
    grad = torch.randn_like(x0)
    a = x0.numel() * x0.element_size()
    ac = lambda: _autocast(precision, device)  # noqa: E731

    def run(option: str, record: bool = False):
        runner = PlanRunner(Plan([option]), params)
        runner.ledger.record = record
        handles = _label_modules(block, runner.ledger) if record else []
        x = x0.detach().requires_grad_(True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) - a if device.type == "cuda" else 0
        with ac():
            out = runner([block], x, cos, sin)
        fpk = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
        held, host = runner.ledger.device_bytes, runner.ledger.host_bytes
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        out.backward(grad)
        bpk = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
        for hd in handles:
            hd.remove()
        block.zero_grad(set_to_none=True)
        return held, host, fpk, bpk, runner.ledger.tensors

    full, _, _, _, tensors = run("keep", record=True)

    def fwd_only(fn):
        def go():
            x = x0.detach().requires_grad_(True)
            with ac():
                fn(x)
        return go

    t_attn = _timed(fwd_only(lambda x: block.attn_branch(x, cos, sin)), device, repeats)
    t_mlp = _timed(fwd_only(block.mlp_branch), device, repeats)

    def fwd_bwd():
        x = x0.detach().requires_grad_(True)
        _sync(device)
        t0 = time.perf_counter()
        with ac():
            out = block(x, cos, sin)
        _sync(device)
        t1 = time.perf_counter()
        out.backward(grad)
        _sync(device)
        t2 = time.perf_counter()
        block.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1

    runs = [fwd_bwd() for _ in range(repeats + 1)][1:]
    fwd_s = statistics.median(r[0] for r in runs)
    bwd_s = statistics.median(r[1] for r in runs)
    options = {}
    for name, (am, mm) in OPTIONS.items():
        held, host, fpk, bpk, _ = run(name)
        rec = (t_attn if am == "recompute" else 0.0) + (t_mlp if mm == "recompute" else 0.0)
        if fpk is None:  # CPU: held + everything the block produces, then the gradient buffers
            fpk, bpk = full + a, full + 2 * a
        options[name] = OptionCost(held=float(held), host=float(host), fwd_peak=float(fpk), bwd_peak=float(bpk),
                                   recompute_s=rec)
    return BlockProfile(fwd_s, bwd_s, float(a), options, tensors)


def profile_head(cfg: GPTNeoXConfig, micro_batch: int, seq: int, precision: str, device: torch.device,
                 repeats: int = 3) -> tuple[float, float, float, float]:
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps).to(device)
    out = torch.nn.Linear(cfg.d_model, cfg.vocab_size, bias=False).to(device)
    emb = torch.nn.Embedding(cfg.vocab_size, cfg.d_model).to(device)
    params = parameter_storages(norm) | parameter_storages(out) | parameter_storages(emb)
    idx = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), device=device)
    x0 = torch.randn(micro_batch, seq, cfg.d_model, device=device, dtype=DTYPES[precision])
    ledger = ActivationLedger(params=params)

    def pack(t):
        ledger._hold_device(t)
        return t

    def step(measure=False):
        x = x0.detach().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if measure else contextlib.nullcontext():
            with _autocast(precision, device):
                e = emb(idx[:, :-1])
                logits = out(norm(x + e.to(x.dtype)))
            loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
        return x, logits, loss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    x, logits, loss = step(measure=True)
    held = float(ledger.device_bytes)
    logits_bytes = logits.numel() * 4.0
    del logits
    loss.backward()
    peak = float(torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else held + 2 * logits_bytes

    def fwd():
        return step()[2]

    fwd_s = _timed(fwd, device, repeats)
    total = _timed(lambda: fwd().backward(), device, repeats)
    return fwd_s, max(total - fwd_s, 0.0), held, peak


def profile_model(
    cfg: GPTNeoXConfig,
    micro_batch: int,
    seq: int,
    precision: str = "fp32",
    device: torch.device | str = "cpu",
    link_bytes_per_s: float | None = None,
    optimizer: str = "adamw",
    cache_dir: str | Path | None = None,
    repeats: int = 3,
) -> ModelProfile:
    """The profile the planner needs; cached as JSON under `cache_dir` when given."""
    device = torch.device(device)
    path = None
    if cache_dir is not None:
        key = _cache_key(cfg, micro_batch, seq, precision, device, link_bytes_per_s, optimizer)
        path = Path(cache_dir) / f"profile-{key}.json"
        if path.exists():
            return ModelProfile.from_dict(json.loads(path.read_text()))
    if link_bytes_per_s is None:
        link_bytes_per_s = measure_link(device) if device.type == "cuda" else DEFAULT_CPU_LINK
    block = profile_block(cfg, micro_batch, seq, precision, device, repeats)
    hf, hb, hheld, hpeak = profile_head(cfg, micro_batch, seq, precision, device, repeats)
    prof = ModelProfile(
        blocks=[block] * cfg.n_layers,
        static=static_bytes(cfg, optimizer),
        head_fwd_s=hf, head_bwd_s=hb, head_held=hheld, head_peak=hpeak,
        link_bytes_per_s=float(link_bytes_per_s),
        meta={"micro_batch": micro_batch, "seq_len": seq, "precision": precision, "device": str(device),
              "n_layers": cfg.n_layers, "d_model": cfg.d_model, "optimizer": optimizer,
              "link_measured": device.type == "cuda"},
    )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(prof.to_dict()))
        tmp.replace(path)
    return prof
