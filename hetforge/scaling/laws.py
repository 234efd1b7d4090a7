"""Scaling laws: the Chinchilla loss surface and the compute-optimal split of a budget.

    L(N, D) = E + A / N^alpha + B / D^beta

N is the model's parameters, D the training tokens. Minimising L on the curve C = 6 N D gives, in
closed form (Hoffmann et al. 2022, appendix D),

    N* = G (C/6)^(beta/(alpha+beta)),   D* = (C/6)^(alpha/(alpha+beta)) / G,
    G  = (alpha A / (beta B))^(1/(alpha+beta)).

The default constants are Epoch AI's refit of Chinchilla's data (Besiroglu et al. 2024); a user's
own sweep (`hetforge scale fit`) replaces them. With the Epoch constants a compute-optimal run
trains on about 20-26 tokens per parameter between 1e18 and 1e21 FLOPs.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from hetforge.core.errors import HetforgeError
from hetforge.model.accounting import matmul_params
from hetforge.model.gpt_neox import GPTNeoXConfig


class ScalingError(HetforgeError, ValueError):
    """A sizing or fitting request that cannot be met (bad budget, unreadable constants, too few
    runs), phrased for the user."""


@dataclass(frozen=True)
class LossLaw:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str = ""

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    @property
    def _g(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))

    def optimal_params(self, compute: float) -> float:
        """N* for a budget of `compute` FLOPs (C = 6 N D)."""
        return self._g * (compute / 6.0) ** (self.beta / (self.alpha + self.beta))

    def optimal_tokens(self, compute: float) -> float:
        return (compute / 6.0) ** (self.alpha / (self.alpha + self.beta)) / self._g

    def params_for_tokens(self, tokens: float) -> float:
        """The N for which `tokens` is the compute-optimal D: where alpha A / N^alpha equals
        beta B / D^beta (the first-order condition on C = 6 N D)."""
        return (self.alpha * self.A / (self.beta * self.B) * tokens**self.beta) ** (1.0 / self.alpha)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "LossLaw":
        """Constants from a JSON file (what `hetforge scale fit` writes, or a hand-written one)."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ScalingError(f"cannot read scaling-law constants from {path}: {err}") from None
        raw = raw.get("law", raw)
        missing = [k for k in ("E", "A", "B", "alpha", "beta") if k not in raw]
        if missing:
            raise ScalingError(f"{path}: missing scaling-law constant(s) {', '.join(missing)}")
        return cls(*(float(raw[k]) for k in ("E", "A", "B", "alpha", "beta")), source=str(path))


EPOCH = LossLaw(E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658, source="Epoch AI refit of Chinchilla")


def shape_for(params: float, vocab: int) -> GPTNeoXConfig:
    """The GPT-NeoX shape nearest `params`: width a multiple of 64 (128 from 1024 up), heads of 64
    (128 from width 4096), d_ff = 4 d, and depth such that width / depth stays near 80, the ratio
    of the GPT-3 / NeoX family (48 to 128 from 350M up)."""
    best = None
    for d in range(64, 32768 + 1, 64):
        if d >= 1024 and d % 128:
            continue
        per_layer = 12 * d * d
        layers = max(1, round((params - vocab * d) / per_layer))
        for n in {max(1, layers - 1), layers, layers + 1}:
            shape = GPTNeoXConfig(n_layers=n, d_model=d, n_heads=d // (128 if d >= 4096 else 64), d_ff=4 * d,
                                  vocab_size=vocab)
            err = abs(math.log(matmul_params(shape) / params)) + 0.15 * abs(math.log((d / n) / 80.0))
            if best is None or err < best[0]:
                best = (err, shape)
    return best[1]
