"""How big a model, on how many tokens: the compute-optimal recommendation for a budget, with the
shape to build, its FLOPs, and what it costs in wall time and energy on a described cluster."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetforge.core.hardware import DeviceInfo, choose_precision, lookup
from hetforge.model.presets import PRESETS
from hetforge.model.accounting import flops_per_token, matmul_params
from hetforge.model.gpt_neox import GPTNeoXConfig
from hetforge.scaling.laws import LossLaw, ScalingError, shape_for

NEIGHBOURS = (0.25, 0.5, 1.0, 2.0, 4.0)


@dataclass
class ClusterRate:
    """What a cluster sustains: devices by kind and count, one precision, a stated MFU."""

    devices: list[tuple[DeviceInfo, int]]
    precision: str
    mfu: float

    @property
    def count(self) -> int:
        return sum(c for _, c in self.devices)

    @property
    def flops_per_s(self) -> float:
        return sum(d.peak_tflops(self.precision) * 1e12 * c for d, c in self.devices) * self.mfu

    @property
    def power_w(self) -> float:
        return sum(d.power_w * c for d, c in self.devices)

    def describe(self) -> str:
        kinds = ", ".join(f"{c}x {d.name}" for d, c in self.devices)
        return f"{kinds}; {self.precision} at {self.mfu:.0%} MFU = {self.flops_per_s / 1e12:,.1f} TFLOP/s sustained"


def cluster_rate(kinds: list[tuple[str, float | None, int]], mfu: float, precision: str = "auto") -> ClusterRate:
    """From (device type, declared memory GB, count) as a cluster description lists them."""
    devices = []
    for name, mem, count in kinds:
        info = lookup(name, mem)
        if info is None:
            raise ScalingError(f"unknown device type {name!r}: use one of the table's names "
                             f"(hetforge.cluster.devices), e.g. V100, A100-80GB, RTX 3090")
        devices.append((info, count))
    if precision == "auto":
        precision = choose_precision([d for d, _ in devices])
    for d, _ in devices:
        try:
            d.peak_tflops(precision)
        except ValueError as err:
            raise ScalingError(str(err)) from None
    return ClusterRate(devices, precision, mfu)


@dataclass
class Option:
    """One candidate size at a given budget."""

    params: float  # the law's N for this shape
    tokens: float
    shape: GPTNeoXConfig
    loss: float
    flops: float  # D x (6N + attention), the run's real training FLOPs
    preset: str | None = None

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params


def _option(law: LossLaw, n_target: float, tokens: float, vocab: int, seq: int) -> Option:
    shape = shape_for(n_target, vocab)
    n = matmul_params(shape)
    fpt = flops_per_token(shape, seq)
    return Option(n, tokens, shape, law.loss(n, tokens), tokens * fpt)


def recommend(law: LossLaw, vocab: int, seq: int, compute: float | None = None,
              tokens: float | None = None) -> tuple[Option, list[Option]]:
    """The compute-optimal option and its neighbours (N x 1/4 .. 4 at the same 6ND budget)."""
    if (compute is None) == (tokens is None):
        raise ScalingError("give a compute budget or a token count, not both")
    if compute is not None:
        if compute <= 0:
            raise ScalingError(f"compute must be positive (got {compute:g})")
        n_star = law.optimal_params(compute)
    else:
        if tokens <= 0:
            raise ScalingError(f"tokens must be positive (got {tokens:g})")
        n_star = law.params_for_tokens(tokens)
        compute = 6.0 * n_star * tokens
    rows = []
    for f in NEIGHBOURS:
        n = n_star * f
        rows.append(_option(law, n, compute / (6.0 * n), vocab, seq))
    best = rows[NEIGHBOURS.index(1.0)]
    best.preset = nearest_preset(best.params, vocab)
    return best, rows


def nearest_preset(params: float, vocab: int) -> str:
    def n_of(p: GPTNeoXConfig) -> int:
        return matmul_params(replace(p, vocab_size=vocab))

    return min(PRESETS, key=lambda k: abs(n_of(PRESETS[k]) / params - 1.0))
