"""Fitting the loss surface L(N, D) = E + A/N^alpha + B/D^beta to a sweep's runs.

As Hoffmann et al. (2022, section 3.3) did: minimise the Huber loss (delta = 1e-3) between the log of
the predicted loss, written LSE(a - alpha log N, b - beta log D, e) with A = e^a, B = e^b, E = e^e,
and the log of the measured loss, with L-BFGS from several starting points, keeping the best. The
starts come from a grid over the exponents: for fixed alpha and beta the loss is linear in E, A and
B, so non-negative least squares prices each grid point at once, and the best few are refined.
Huber on logs makes the fit robust to a run that went wrong. Bootstrap over the runs (refitting on
resamples) gives confidence intervals for the constants and for any prediction.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import minimize, nnls
from scipy.special import logsumexp

from hetforge.core.checkpoint_io import write_text_atomic
from hetforge.scaling.laws import LossLaw, ScalingError

HUBER_DELTA = 1e-3
EXPONENTS = np.linspace(0.05, 1.5, 30)
STARTS = 6


def _objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
               delta: float) -> tuple[float, np.ndarray]:
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    pred = logsumexp(terms, axis=0)
    r = pred - log_l
    small = np.abs(r) <= delta
    value = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum()
    dr = np.where(small, r, delta * np.sign(r))  # d huber / d pred
    w = np.exp(terms - pred)  # softmax weights: d pred / d term
    grad = np.array([
        (dr * w[0]).sum(), (dr * w[1]).sum(), (dr * w[2]).sum(),
        (dr * w[0] * -log_n).sum(), (dr * w[1] * -log_d).sum(),
    ])
    return float(value), grad


def _starts(log_n, log_d, log_l, k: int = STARTS) -> list[np.ndarray]:
    """The k grid points (alpha, beta) whose least-squares E, A, B fit the losses best, as thetas."""
    loss = np.exp(log_l)
    scored = []
    for alpha in EXPONENTS:
        for beta in EXPONENTS:
            x = np.stack([np.ones_like(log_n), np.exp(-alpha * log_n), np.exp(-beta * log_d)], axis=1)
            coef, _ = nnls(x, loss)
            coef = np.maximum(coef, 1e-6)
            err = float(((np.log(x @ coef) - log_l) ** 2).sum())
            scored.append((err, np.array([math.log(coef[1]), math.log(coef[2]), math.log(coef[0]), alpha, beta])))
    scored.sort(key=lambda t: t[0])
    return [th for _, th in scored[:k]]


def _fit_once(log_n, log_d, log_l, starts, delta) -> tuple[float, np.ndarray]:
    best = None
    bounds = [(None, None), (None, None), (None, None), (0.0, 3.0), (0.0, 3.0)]
    for theta in starts:
        # the objective is tiny (Huber of residuals ~1e-3): scipy's default tolerances stop far short
        res = minimize(_objective, theta, args=(log_n, log_d, log_l, delta), jac=True, method="L-BFGS-B",
                       bounds=bounds, options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 5000})
        if best is None or res.fun < best[0]:
            best = (float(res.fun), res.x)
    return best


def _law(theta: np.ndarray, source: str) -> LossLaw:
    a, b, e, alpha, beta = (float(v) for v in theta)
    return LossLaw(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta, source=source)


@dataclass
class Fit:
    law: LossLaw
    objective: float
    n_runs: int
    bootstrap: list[dict] = field(default_factory=list)  # the constants of each resample's fit

    def interval(self, key: str, level: float = 0.90) -> tuple[float, float] | None:
        vals = [b[key] for b in self.bootstrap]
        if not vals:
            return None
        lo, hi = np.percentile(vals, [50 * (1 - level), 50 * (1 + level)])
        return float(lo), float(hi)

    def predict_interval(self, n: float, d: float, level: float = 0.90) -> tuple[float, float] | None:
        vals = [LossLaw(b["E"], b["A"], b["B"], b["alpha"], b["beta"]).loss(n, d) for b in self.bootstrap]
        if not vals:
            return None
        lo, hi = np.percentile(vals, [50 * (1 - level), 50 * (1 + level)])
        return float(lo), float(hi)

    def to_dict(self) -> dict:
        keys = ("E", "A", "B", "alpha", "beta")
        return {"law": self.law.to_dict(), "objective": self.objective, "runs": self.n_runs,
                "interval_90": {k: self.interval(k) for k in keys} if self.bootstrap else None,
                "bootstrap_fits": len(self.bootstrap)}


def fit_law(n: list[float], d: list[float], loss: list[float], bootstrap: int = 0, seed: int = 0,
            delta: float = HUBER_DELTA, source: str = "fitted") -> Fit:
    """The constants that best explain the runs (N, D, final loss)."""
    n_, d_, l_ = (np.asarray(v, dtype=np.float64) for v in (n, d, loss))
    if len(n_) < 5:
        raise ScalingError(f"fitting five constants needs at least 5 runs (got {len(n_)})")
    if (n_ <= 0).any() or (d_ <= 0).any() or (l_ <= 0).any():
        raise ScalingError("parameters, tokens and losses must all be positive")
    log_n, log_d, log_l = np.log(n_), np.log(d_), np.log(l_)
    obj, theta = _fit_once(log_n, log_d, log_l, _starts(log_n, log_d, log_l), delta)
    fit = Fit(_law(theta, source), obj, len(n_))
    rng = np.random.default_rng(seed)
    for _ in range(bootstrap):
        idx = rng.integers(0, len(n_), len(n_))
        starts = [theta] + _starts(log_n[idx], log_d[idx], log_l[idx], k=2)
        _, th = _fit_once(log_n[idx], log_d[idx], log_l[idx], starts, delta)
        fit.bootstrap.append(_law(th, "bootstrap").to_dict())
    return fit


def plot_fit(fit: Fit, runs: list[dict], path: Path, holdout: list[dict] = ()) -> Path:
    """Left: loss against compute (C = 6ND) with the compute-optimal frontier. Right: the (N, D)
    plane with iso-loss contours, the frontier and lines of equal compute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    law = fit.law
    pts = list(runs) + list(holdout)
    ns = np.array([r["params"] for r in pts])
    ds = np.array([r["tokens"] for r in pts])
    cs = 6 * ns * ds
    c_grid = np.logspace(math.log10(cs.min() / 10), math.log10(cs.max() * 100), 200)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    frontier = [law.loss(law.optimal_params(c), law.optimal_tokens(c)) for c in c_grid]
    ax1.plot(c_grid, frontier, color="black", label="compute-optimal frontier (fit)")
    for n_run in sorted(set(r["params"] for r in pts)):
        cc = c_grid[c_grid > 6 * n_run * 1e3]
        ax1.plot(cc, [law.loss(n_run, c / (6 * n_run)) for c in cc], linewidth=0.6, alpha=0.5)
    sc = ax1.scatter([6 * r["params"] * r["tokens"] for r in runs], [r["loss"] for r in runs],
                     c=np.log10([r["params"] for r in runs]), cmap="viridis", zorder=3, label="runs")
    for r in holdout:
        ax1.scatter([6 * r["params"] * r["tokens"]], [r["loss"]], marker="*", s=160, color="red", zorder=4,
                    label=f"held out ({r['name']})")
    fig.colorbar(sc, ax=ax1, label="log10 N")
    ax1.set_xscale("log")
    losses = [r["loss"] for r in pts]
    ax1.set_ylim(min(losses + frontier) * 0.95, max(losses) * 1.25)
    ax1.set_xlabel("training compute C = 6ND (FLOPs)")
    ax1.set_ylabel("final validation loss (nats/token)")
    ax1.set_title(f"L = {law.E:.3g} + {law.A:.3g}/N^{law.alpha:.3f} + {law.B:.3g}/D^{law.beta:.3f}")
    ax1.legend(fontsize=8)

    n_grid = np.logspace(math.log10(ns.min() / 4), math.log10(ns.max() * 8), 120)
    d_grid = np.logspace(math.log10(ds.min() / 4), math.log10(ds.max() * 8), 120)
    nn, dd = np.meshgrid(n_grid, d_grid)
    ll = law.E + law.A / nn**law.alpha + law.B / dd**law.beta
    cont = ax2.contour(nn, dd, ll, levels=12, cmap="magma")
    ax2.clabel(cont, fontsize=7, fmt="%.2f")
    fr = c_grid[(c_grid > 6 * n_grid[0] * d_grid[0]) & (c_grid < 6 * n_grid[-1] * d_grid[-1])]
    ax2.plot([law.optimal_params(c) for c in fr], [law.optimal_tokens(c) for c in fr], color="black",
             label="compute-optimal N*, D*")
    for c in np.logspace(math.log10(cs.min()), math.log10(cs.max()), 3):
        ax2.plot(n_grid, c / (6 * n_grid), linestyle=":", color="grey", linewidth=0.8)
    ax2.scatter([r["params"] for r in runs], [r["tokens"] for r in runs], color="tab:blue", zorder=3, label="runs")
    for r in holdout:
        ax2.scatter([r["params"]], [r["tokens"]], marker="*", s=160, color="red", zorder=4)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlim(n_grid[0], n_grid[-1])
    ax2.set_ylim(d_grid[0], d_grid[-1])
    ax2.set_xlabel("parameters N")
    ax2.set_ylabel("tokens D")
    ax2.set_title("iso-loss contours; dotted: equal compute")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_fit(fit: Fit, path: Path, runs: list[dict], holdout: list[dict]) -> Path:
    out = {**fit.to_dict(), "data": runs, "holdout": holdout}
    return write_text_atomic(path, json.dumps(out, indent=1))
