"""A memory profile for a card that is not here (the legacy-GPU table, `hetforge plan --card`).

The block is the real one, measured on this machine at micro-batch 1 and two short sequences in a
16-bit autocast (the dtypes a GPU's autocast gives) or fp32. Each figure is a constant (the 16-bit
weight copies autocast keeps, parameter-sized gradient buffers) plus a part that grows with micro-
batch x sequence; the two measurements give both, and the figure is taken at the target. Where the
card's attention kernel is PyTorch's math fallback (`core.hardware.sdpa_backend`: no flash or
memory-efficient kernel for that card, dtype or head size, after the padding a run would apply,
`core.hardware.padded_head_dim`), the attention probabilities, micro-batch
x heads x sequence^2, are added to what the attention keeps, and the scores to the block's peaks.
Times come from FLOPs at an assumed fraction of the card's datasheet peak, shared out over the units
as measured; the host link is the card's PCIe generation. An estimate, to be checked against a real
profile when the card is at hand (`bench/gpu_check.sh` does so on a lent GPU).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hetforge.core.hardware import run_precision
from hetforge.core.hardware import DeviceInfo, padded_head_dim, sdpa_backend
from hetforge.memory.plan import BlockProfile, ModelProfile
from hetforge.memory.profile import profile_model
from hetforge.model.accounting import block_forward_flops, block_matmul_params, head_forward_flops
from hetforge.model.gpt_neox import GPTNeoXConfig

PROXY_SEQ = 128
PROXY_LINK = 16e9  # bytes/s; the profile records it, the analytic profile replaces it
EFFICIENCY = 0.45  # the share of the datasheet peak a training step's matmuls reach
CONTEXT_BYTES = 0.75 * 2**30  # CUDA context, cuBLAS workspace and allocator slack


def usable_bytes(card: DeviceInfo) -> float:
    """What a plan may use of the card: its memory less the context and 5% for fragmentation."""
    return card.memory_gb * 2**30 * 0.95 - CONTEXT_BYTES


def card_precision(card: DeviceInfo) -> str:
    return run_precision([card.caps()])[0]


def proxy_precision(card: DeviceInfo) -> str:
    """The dtype the proxies run in: 2-byte types for a 16-bit card, fp32 otherwise."""
    return "bf16" if card_precision(card) in ("bf16", "fp16") else "fp32"


def measure_proxies(cfg: GPTNeoXConfig, precision: str, optimizer: str = "adamw", cache_dir: Path | None = None,
                    proxy_seq: int = PROXY_SEQ) -> tuple[ModelProfile, ModelProfile]:
    """The measuring half: the real block profiled at micro-batch 1 and sequences proxy_seq and
    twice that. Every figure is a constant (16-bit weight copies that autocast keeps, parameter-sized
    gradient buffers) plus a part that grows with the tokens; two points give both. The proxies'
    link is a placeholder (each card's own is set later): one pair serves every card. 16-bit
    matmuls run in fp32 tiles (`Fp32Matmul`): a CPU's own bf16 matmul may be ~300x slower and only
    the dtypes matter here, as the times are taken from FLOPs (so one block is timed, not a chain)."""
    return tuple(profile_model(cfg, 1, s_, precision, "cpu", PROXY_LINK, optimizer, cache_dir, repeats=1,
                               fp32_matmul=True, chain=1) for s_ in (proxy_seq, 2 * proxy_seq))


def analytic_profile(cfg: GPTNeoXConfig, micro_batch: int, seq: int, card: DeviceInfo, optimizer: str = "adamw",
                     cache_dir: Path | None = None, proxy_seq: int = PROXY_SEQ,
                     efficiency: float = EFFICIENCY, pad_head_dim: str | int = "auto") -> ModelProfile:
    lo, hi = measure_proxies(cfg, proxy_precision(card), optimizer, cache_dir, proxy_seq)
    return profile_from_proxies(cfg, micro_batch, seq, card, lo, hi, efficiency, pad_head_dim=pad_head_dim)


def profile_from_proxies(cfg: GPTNeoXConfig, micro_batch: int, seq: int, card: DeviceInfo, lo: ModelProfile,
                         hi: ModelProfile, efficiency: float = EFFICIENCY, precision: str | None = None,
                         pad_head_dim: str | int = "auto") -> ModelProfile:
    """The deciding half, a pure function of the two recorded proxies and the card's datasheet, in
    the card's own precision or the run's (`precision`: a mixed cluster trains in one). The head
    size is padded as a run on that card would (`model.pad_head_dim`), which decides the kernel."""
    precision = precision or card_precision(card)
    proxy_seq = lo.meta["seq_len"]
    tokens = micro_batch * seq

    def at(a: float, b: float) -> float:  # the figure at `tokens`, from its values at proxy_seq and twice that
        per_token = (b - a) / proxy_seq
        return max(a + per_token * (tokens - proxy_seq), 0.0)

    head = padded_head_dim(card, precision, cfg.head_dim, pad_head_dim)
    backend = sdpa_backend(card, precision, head)
    elt = 4 if precision == "fp32" else 2
    probs = micro_batch * cfg.n_heads * seq * seq * elt if backend == "math" else 0.0

    # FLOPs of one block's forward and of the head's, for the tokens of one micro-batch
    rate = card.peak_tflops(precision) * 1e12 * efficiency
    attn_flops = block_forward_flops(cfg, tokens, seq) - 2.0 * block_matmul_params(cfg) * tokens
    block_fwd = block_forward_flops(cfg, tokens, seq) / rate
    head_fwd = head_forward_flops(cfg, tokens) / rate
    pa, pb = lo.blocks[0], hi.blocks[0]
    t_scale = block_fwd / pb.fwd_s

    units = []
    for ua, ub in zip(pa.units, pb.units):
        u = replace(ub, bytes=at(ua.bytes, ub.bytes), host_bytes=at(ua.host_bytes, ub.host_bytes),
                    rebuild_bytes=at(ua.rebuild_bytes, ub.rebuild_bytes), time_s=ub.time_s * t_scale)
        if u.name == "attn.core" and probs:
            u = replace(u, bytes=u.bytes + probs, host_bytes=u.host_bytes + probs)
        if u.name == "attn.sdpa":
            u = replace(u, bytes=u.bytes + probs, time_s=attn_flops / rate)
        units.append(u)
    peaks = {k: [at(pa.peaks[k][i], pb.peaks[k][i]) + 2 * probs for i in (0, 1)] for k in pb.peaks}
    block = BlockProfile(block_fwd, 2 * block_fwd, at(pa.input_bytes, pb.input_bytes), units, peaks, [],
                         {br: {k: v * t_scale for k, v in d.items()} for br, d in pb.recompute.items()})
    return ModelProfile(
        blocks=[block] * cfg.n_layers, static=hi.static, head_fwd_s=head_fwd, head_bwd_s=2 * head_fwd,
        head_held=at(lo.head_held, hi.head_held), head_peak=at(lo.head_peak, hi.head_peak),
        link_bytes_per_s=card.link_gbps * 1e9, shared_bytes=float(2 * seq * cfg.rotary_dims * 4), overlap=True,
        meta={"analytic": True, "card": card.name, "precision": precision, "attention": backend, "head_dim": head,
              "micro_batch": micro_batch, "seq_len": seq, "n_layers": cfg.n_layers, "d_model": cfg.d_model,
              "efficiency": efficiency, "proxy_seq": proxy_seq,
              "host_step_s_per_param": hi.meta["host_step_s_per_param"]},  # the host is the one measured here
    )


def block_summary(profile: ModelProfile, options: list[str]) -> str:
    """How many blocks keep, recompute, offload, or mix the two."""
    counts: dict[str, int] = {}
    for blk, o in zip(profile.blocks, options):
        d = blk.decision(o)
        modes = {d.attn.mode, d.mlp.mode}
        offloads = bool(d.offload_inputs) or any(d.branch(b).mode == "keep" and d.branch(b).units
                                                 for b in ("attn", "mlp"))
        recomputes = "recompute" in modes or any(d.branch(b).rebuilt for b in ("attn", "mlp"))
        kind = ("mixed" if offloads and recomputes else "offload" if offloads
                else "recompute" if recomputes else "keep")
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items())

