"""The one place that counts what a model shape costs: parameters, FLOPs and static bytes.

Training FLOPs per token = 6·N + 12·L·d·s (PaLM, appendix B): 6 FLOPs per weight per token for the
forward and backward matmuls, plus the attention score/value products that no weight accounts for.
N here is the non-embedding parameter count *plus the output projection* (V·d): the input
embedding is a table lookup and costs nothing, but the logits are a real V×d matmul on every token,
and for the small models this project trains on CPUs it is a third of all the work. MFU excludes
recomputation (model FLOPs); HFU includes it (hardware FLOPs).

Static bytes are what a rank holds whatever its activation plan: fp32 master weights and gradients
(autocast computes in bf16/fp16 from them) and the optimizer's state (AdamW's and LAMB's two
moments) unless it lives on the host. The probe, the planner, sizing and the report all read them
here, so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetforge.model.gpt_neox import GPTNeoXConfig

WEIGHT_BYTES = 4  # fp32 master copy
GRAD_BYTES = 4
OPTIMIZER_BYTES = {"adamw": 8, "lamb": 8}  # two fp32 moments per parameter


def count_parameters(shape: GPTNeoXConfig) -> dict[str, int]:
    """Exact parameter count of hetforge's GPT-NeoX (all linears and LayerNorms carry biases):
    total, embedding and non-embedding."""
    d, f = shape.d_model, shape.d_ff
    per_layer = (
        2 * 2 * d  # input + post-attention LayerNorm (weight, bias)
        + 3 * d * d + 3 * d  # fused QKV
        + d * d + d  # attention output projection
        + d * f + f  # MLP up
        + f * d + d  # MLP down
    )
    non_embedding = shape.n_layers * per_layer + 2 * d  # + final LayerNorm
    embedding = shape.vocab_size * d * (1 if shape.tie_embeddings else 2)
    return {"total": non_embedding + embedding, "embedding": embedding, "non_embedding": non_embedding}


def block_matmul_params(shape: GPTNeoXConfig) -> int:
    """Weights of one block that multiply every token (QKV, output, the MLP's two)."""
    return 4 * shape.d_model * shape.d_model + 2 * shape.d_model * shape.d_ff


def matmul_params(shape: GPTNeoXConfig) -> int:
    """Weights that take part in a matmul for every token (biases and norms are negligible): the
    N of 6N."""
    return shape.n_layers * block_matmul_params(shape) + shape.vocab_size * shape.d_model


def block_forward_flops(shape: GPTNeoXConfig, tokens: int, seq_len: int) -> float:
    """One block's forward for `tokens` tokens in sequences of `seq_len`: its matmuls and the
    attention products (QK^T and AV, 2·s·d each per token). What recomputing a block repeats."""
    return (2.0 * block_matmul_params(shape) + 4.0 * seq_len * shape.d_model) * tokens


def head_forward_flops(shape: GPTNeoXConfig, tokens: int) -> float:
    return 2.0 * shape.vocab_size * shape.d_model * tokens


def flops_per_token(shape: GPTNeoXConfig, seq_len: int) -> float:
    """Model FLOPs for one trained token (forward + backward), attention included."""
    return 6.0 * matmul_params(shape) + 12.0 * shape.n_layers * shape.d_model * seq_len


def static_bytes(shape: GPTNeoXConfig, optimizer: str = "adamw", offload: bool = False) -> dict[str, float]:
    """Device bytes that do not depend on the activation plan, by kind."""
    n = count_parameters(shape)["total"]
    out = {"weights": float(WEIGHT_BYTES * n), "gradients": float(GRAD_BYTES * n)}
    if not offload:
        out["optimizer state"] = float(OPTIMIZER_BYTES[optimizer] * n)
    return out


# --- sharded data parallelism -------------------------------------------------------------------
# The strategies, least sharding first: what `parallel.strategy: auto` tries in this order.
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")


# FSDP gathers, and reduce-scatters, a unit at a time: consecutive blocks are grouped into units of
# at least this many parameters. Every collective has a fixed cost (a launch, a rendezvous of the
# ranks, copies in and out), so a small model's blocks cost far more as separate units; a block of
# 4M parameters or more (every preset from 125m up) is a unit of its own, as in torchtitan.
MIN_UNIT_PARAMS = 1 << 22


def block_groups(shape: GPTNeoXConfig, min_unit_params: int = MIN_UNIT_PARAMS) -> list[range]:
    """The blocks FSDP shards as one unit each: consecutive, at least `min_unit_params` parameters
    (the last group takes what is left)."""
    per_block = max(block_params(shape), 1)
    k = max(1, -(-min_unit_params // per_block))
    return [range(i, min(i + k, shape.n_layers)) for i in range(0, shape.n_layers, k)]


def block_params(shape: GPTNeoXConfig) -> int:
    return (count_parameters(shape)["non_embedding"] - 2 * shape.d_model) // shape.n_layers


def shard_units(shape: GPTNeoXConfig, min_unit_params: int = MIN_UNIT_PARAMS) -> list[int]:
    """Parameters of each unit FSDP gathers as one (hetforge shards the input embedding, each group
    of blocks (`block_groups`), and final norm + output projection each on its own; tied embeddings
    share the root unit)."""
    d = shape.d_model
    block = block_params(shape)
    groups = [block * len(g) for g in block_groups(shape, min_unit_params)]
    if shape.tie_embeddings:
        return [shape.vocab_size * d + 2 * d] + groups
    return [shape.vocab_size * d] + groups + [shape.vocab_size * d + 2 * d]


def parameter_sizes(shape: GPTNeoXConfig) -> list[list[int]]:
    """Elements of every parameter tensor, in the optimizer's two groups: the matrices (weight-
    decayed) and the vectors (biases, LayerNorm gains), each in the model's order. What ZeRO-1
    partitions, so that the planner prices the partition the run makes."""
    d, f, v = shape.d_model, shape.d_ff, shape.vocab_size
    block_matrices = [3 * d * d, d * d, f * d, d * f]
    block_vectors = [d, d, d, d, 3 * d, d, f, d]  # two LayerNorms; QKV, output, up and down biases
    matrices = [v * d] + block_matrices * shape.n_layers + ([] if shape.tie_embeddings else [v * d])
    vectors = block_vectors * shape.n_layers + [d, d]  # + final LayerNorm
    return [matrices, vectors]


def proportional_partition(group_sizes: list[list[int]], weights: list[float]) -> list[list[int]]:
    """The rank of every parameter (per group) when rank r is to hold a share of the optimizer
    state proportional to weights[r] (its memory): largest parameters first, each to the rank whose
    load after taking it is least relative to its weight. With equal weights this is exactly
    `ZeroRedundancyOptimizer`'s own greedy (least loaded rank, lowest rank on a tie); whole tensors
    are the unit, so a share is exact to within the largest parameter."""
    if not weights or any(w <= 0 for w in weights):
        raise ValueError(f"state share weights must be positive, got {weights}")
    load = [0] * len(weights)
    out = []
    for sizes in group_sizes:
        ranks = [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: the model's order on ties
            r = min(range(len(weights)), key=lambda r: ((load[r] + sizes[i]) / weights[r], load[r], r))
            ranks[i] = r
            load[r] += sizes[i]
        out.append(ranks)
    return out


def state_shares(group_sizes: list[list[int]], weights: list[float]) -> list[float]:
    """Each rank's fraction of the optimizer state under `proportional_partition`."""
    load = [0] * len(weights)
    for sizes, ranks in zip(group_sizes, proportional_partition(group_sizes, weights)):
        for n, r in zip(sizes, ranks):
            load[r] += n
    total = sum(load) or 1
    return [x / total for x in load]


def sharded_static_bytes(shape: GPTNeoXConfig, optimizer: str = "adamw", strategy: str = "ddp",
                         shard_size: int = 1, offload: str = "none", gather_bytes: int = WEIGHT_BYTES,
                         min_unit_params: int = MIN_UNIT_PARAMS, state_share: float | None = None,
                         accumulation: str = "sharded") -> dict[str, float]:
    """Device bytes per rank that do not depend on the activation plan, by kind, under a data-parallel
    strategy over a shard group of `shard_size` ranks (ZeRO, Rajbhandari et al. 2020):

    - ddp: everything replicated; zero1: the optimizer's state sharded;
    - zero2 (FSDP2 without resharding after forward): weights, gradients and state sharded, but
      every unit's gathered weights stay from its forward to its backward;
    - fsdp (ZeRO-3): all sharded; gathered are the unit computing and the one prefetched, and in the
      backward one unit's full gradients before their reduce-scatter.

    `accumulation`: "unsharded" (zero2 and fsdp) holds every unit's gathered weights and its full
    gradients from the step's first micro-batch to its last, which reduce-scatters them once: in
    the step, ZeRO-1's bytes plus the shards (see `ACCUMULATIONS`).

    `gather_bytes`: bytes per gathered weight (2 under a 16-bit FSDP mixed-precision policy).
    `offload`: "optimizer" keeps the state on the host; "params" (FSDP2's CPU offload) keeps
    weight, gradient and state shards there, and only the gathered units on the device.
    `state_share`: under zero1, this rank's fraction of the optimizer state when the ranks hold
    shares in proportion to their memory (`state_shares`); None: 1 / shard_size."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown data-parallel strategy {strategy!r} (one of {', '.join(STRATEGIES)})")
    n = count_parameters(shape)["total"]
    s = max(int(shard_size), 1) if strategy != "ddp" else 1
    opt = OPTIMIZER_BYTES[optimizer] * n
    if strategy in ("ddp", "zero1"):
        share = state_share if strategy == "zero1" and state_share is not None else 1 / s
        out = {"weights": float(WEIGHT_BYTES * n), "gradients": float(GRAD_BYTES * n),
               "optimizer state": float(opt * share)}
    else:
        units = shard_units(shape, min_unit_params)
        biggest_two = sum(sorted(units)[-2:])
        unsharded = accumulation == "unsharded"
        gathered = n if strategy == "zero2" or unsharded else biggest_two
        out = {"weights": float(WEIGHT_BYTES * n / s), "gradients": float(GRAD_BYTES * n / s),
               "optimizer state": float(opt / s), "gathered weights": float(gather_bytes * gathered),
               "gathered gradients": float(GRAD_BYTES * (n if unsharded else max(units)))}
        if offload == "params":
            for kind in ("weights", "gradients", "optimizer state"):
                out[kind] = 0.0
    if offload in ("optimizer", "params"):
        out["optimizer state"] = 0.0
    return {k: v for k, v in out.items() if v or k in ("weights", "gradients")}


def collective_bytes_per_step(shape: GPTNeoXConfig, strategy: str, shard_size: int, micro_batches: int,
                              gather_bytes: int = WEIGHT_BYTES) -> float:
    """Bytes each rank sends per optimizer step (ring collectives: (S-1)/S of the buffer per pass).
    ddp: one gradient all-reduce (two passes); zero1: that plus the all-gather of updated weights;
    zero2: per micro-batch one all-gather of weights and one reduce-scatter of gradients; fsdp: the
    same plus the backward's second all-gather (the weights were freed after the forward)."""
    n = count_parameters(shape)["total"]
    s = max(int(shard_size), 1)
    if s == 1:
        return 0.0
    ring = (s - 1) / s
    if strategy == "ddp":
        return 2 * GRAD_BYTES * n * ring
    if strategy == "zero1":
        return 2 * GRAD_BYTES * n * ring + WEIGHT_BYTES * n * ring
    gathers = 1 if strategy == "zero2" else 2
    return micro_batches * (gathers * gather_bytes * n + GRAD_BYTES * n) * ring


def unsharded_accumulation_collectives(shape: GPTNeoXConfig, shard_size: int, gather_bytes: int = WEIGHT_BYTES,
                                       min_unit_params: int = MIN_UNIT_PARAMS) -> tuple[int, float]:
    """(collectives, bytes each rank sends) per optimizer step of FSDP2 accumulating unsharded,
    whatever the number of micro-batches: each unit's weights gathered once (the first micro-batch's
    forward) and its gradients reduce-scattered once (the last one's backward)."""
    n = count_parameters(shape)["total"]
    s = max(int(shard_size), 1)
    if s == 1:
        return 0, 0.0
    return 2 * len(shard_units(shape, min_unit_params)), (gather_bytes + GRAD_BYTES) * n * (s - 1) / s


def collectives_per_micro_batch(shape: GPTNeoXConfig, strategy: str, min_unit_params: int = MIN_UNIT_PARAMS) -> int:
    """Collectives each micro-batch launches under FSDP2: per unit (`shard_units`) one all-gather of
    its weights for the forward, another for the backward where they were freed after the forward
    (fsdp), and one reduce-scatter of its gradients. ddp and zero1 communicate once a step, not per
    micro-batch: 0."""
    if strategy not in ("zero2", "fsdp"):
        return 0
    return len(shard_units(shape, min_unit_params)) * (2 if strategy == "zero2" else 3)


# How FSDP2 (zero2, fsdp) accumulates gradients over a step's micro-batches:
# - sharded: every micro-batch gathers each unit's weights and reduce-scatters its gradients (least
#   memory; each micro-batch is a collective, so every rank must run the same number of them);
# - unsharded: weights gathered once a step and kept, gradients accumulated whole and reduce-scattered
#   once, by the last micro-batch (`set_requires_gradient_sync`, `set_reshard_after_backward`): for the
#   step, full weights and gradients on every rank, as ZeRO-1, but collectives once a step, so ranks
#   may run different numbers of micro-batches, each at the size it computes fastest.
ACCUMULATIONS = ("sharded", "unsharded")


@dataclass(frozen=True)
class ShardLayout:
    """How a run spreads its training state: what the planner, the probe and the report price."""

    strategy: str = "ddp"
    shard_size: int = 1
    gather_bytes: int = WEIGHT_BYTES
    offload: str = "none"  # none | optimizer | params
    unit_params: int = MIN_UNIT_PARAMS
    state_share: float | None = None  # zero1 by memory: this rank's fraction of the optimizer state
    accumulation: str = "sharded"  # zero2 / fsdp: see ACCUMULATIONS

    @property
    def sharded(self) -> bool:
        return self.strategy in ("zero2", "fsdp")

    def static_bytes(self, shape: GPTNeoXConfig, optimizer: str = "adamw",
                     optimizer_offload: bool = False) -> dict[str, float]:
        offload = "optimizer" if optimizer_offload and self.offload == "none" else self.offload
        return sharded_static_bytes(shape, optimizer, self.strategy, self.shard_size, offload, self.gather_bytes,
                                    self.unit_params, self.state_share, self.accumulation)


# --- pipeline stages -----------------------------------------------------------------------------
# A stage holds consecutive blocks; the first also the input embedding, the last the final norm and
# the output projection (untied: the two embeddings sit on different stages).
def stage_parameters(shape: GPTNeoXConfig, blocks: int, first: bool, last: bool) -> int:
    n = blocks * block_params(shape)
    if first:
        n += shape.vocab_size * shape.d_model
    if last:
        n += 2 * shape.d_model + shape.vocab_size * shape.d_model
    return n


def stage_flops_per_sample(shape: GPTNeoXConfig, seq_len: int, blocks: int, last: bool) -> float:
    """Forward and backward FLOPs of one sample through a stage (the head's on the last one)."""
    flops = 3.0 * blocks * block_forward_flops(shape, seq_len, seq_len)
    return flops + (3.0 * head_forward_flops(shape, seq_len) if last else 0.0)


def stage_state_bytes(shape: GPTNeoXConfig, blocks: int, first: bool, last: bool, optimizer: str = "adamw",
                      shards: int = 1, gather_bytes: int = 4) -> dict[str, float]:
    """fp32 weights, gradients and optimizer state of a stage's parameters on one of its ranks.
    Sharded over the stage's `shards` replicas (FSDP2 under a pipeline schedule), each rank keeps
    its part of all three, and through the step the whole stage's weights gathered (at
    `gather_bytes`) and its gradients accumulated unsharded: the schedule reduce-scatters them once,
    after the last micro-batch."""
    n = stage_parameters(shape, blocks, first, last)
    out = {"weights": float(WEIGHT_BYTES * n / shards), "gradients": float(GRAD_BYTES * n / shards),
           "optimizer state": float(OPTIMIZER_BYTES[optimizer] * n / shards)}
    if shards > 1:
        out["weights"] += float(gather_bytes * n)
        out["gradients"] += float(GRAD_BYTES * n)
    return out


def stage_static_bytes(shape: GPTNeoXConfig, blocks: int, first: bool, last: bool, optimizer: str = "adamw",
                       shards: int = 1, gather_bytes: int = 4) -> float:
    """The sum of `stage_state_bytes`."""
    return sum(stage_state_bytes(shape, blocks, first, last, optimizer, shards, gather_bytes).values())


def boundary_bytes(shape: GPTNeoXConfig, micro_batch: int, seq_len: int, dtype_bytes: int) -> int:
    """What crosses a stage boundary per micro-batch, each way: the hidden states (forward) and
    their gradient (backward)."""
    return micro_batch * seq_len * shape.d_model * dtype_bytes
