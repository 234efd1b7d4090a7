"""Validated run configuration.

One YAML file describes a whole run (data -> model -> train -> eval). Pydantic does the checking so
that every mistake is reported with the dotted name of the field and what is allowed, before any
expensive work starts. Unknown keys are errors: a typo must never silently fall back to a default.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hetforge.core.errors import ConfigError
from hetforge.core.hardware import DEVICES, lookup
from hetforge.core.sizes import parse_size
from hetforge.model.presets import PRESETS

__all__ = ["ConfigError", "RunConfig", "load_config", "build_config", "dump_config"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _size_field(name: str):
    """A byte size written as 64MiB, 1GB or a number: checked here, kept as written."""

    def check(v):
        try:
            if parse_size(v) <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"{name} must be a positive size like 64MiB, 1GB or a byte count") from None
        return v

    return field_validator(name)(check)


class SourceConfig(_Strict):
    """One corpus source: the embedded aclsum papers, or a file / directory of files.

    weight scales the source's natural share of the training samples (FORGE-style: 2.0 visits a
    small high-quality source twice per pass over the rest, 0.5 half of a large noisy one)."""

    type: Literal["aclsum", "path"] = "path"
    path: str | None = None
    # hf: a Hugging Face dataset written by `Dataset.save_to_disk` (local only)
    format: Literal["auto", "jsonl", "txt", "parquet", "hf"] = "auto"
    text_field: str = "text"
    weight: float = Field(1.0, gt=0.0, le=1000.0)
    # aclsum only: splits of the aclsum summarisation benchmark whose papers are kept out of the
    # pre-training corpus so that downstream evaluation is never on trained-on text.
    exclude_splits: list[Literal["train", "val", "test"]] = Field(default_factory=lambda: ["test"])

    @model_validator(mode="after")
    def _path_needed(self) -> "SourceConfig":
        if self.type == "path" and not self.path:
            raise ValueError("a source of type 'path' needs `path` (a file or directory)")
        return self


class TokenizerConfig(_Strict):
    vocab_size: int = Field(8192, ge=259, le=1 << 20)
    path: str | None = None  # an existing tokenizer.json; skips training
    min_frequency: int = Field(2, ge=1)
    # The BPE is trained on a seeded sample of about this many bytes, drawn from every source in
    # proportion to its bytes x weight: memory and time stay bounded whatever the corpus size.
    sample_bytes: str | int = "128MiB"

    _sample = _size_field("sample_bytes")


class NearDedupConfig(_Strict):
    """MinHash-LSH near-duplicate removal (datatrove's buckets and clusters) over word n-grams.

    Two documents whose n-gram Jaccard similarity is s share one of `bands` bands of `rows` hashes
    with probability 1 - (1 - s^rows)^bands. None picks bands x rows (at most `num_hashes`) so that
    pairs at `threshold` are found with probability >= 0.95, with the fewest pairs below it."""

    enabled: bool = True
    threshold: float = Field(0.8, gt=0.0, lt=1.0)
    bands: int | None = Field(None, ge=1, le=256)
    rows: int | None = Field(None, ge=1, le=64)
    num_hashes: int = Field(112, ge=2, le=1024)
    ngram: int = Field(5, ge=1, le=32)
    seed: int = 1

    @model_validator(mode="after")
    def _both_or_neither(self) -> "NearDedupConfig":
        if (self.bands is None) != (self.rows is None):
            raise ValueError("give both data.dedup.near.bands and rows, or neither (then they follow the threshold)")
        return self


class DedupConfig(_Strict):
    exact: bool = True  # by a 128-bit hash of the cleaned text; no text is kept
    near: NearDedupConfig = Field(default_factory=NearDedupConfig)


class DataConfig(_Strict):
    sources: list[SourceConfig] = Field(default_factory=lambda: [SourceConfig(type="aclsum")])
    out_dir: str = "data_cache/aclsum"
    normalize: Literal["NFC", "NFKC", "none"] = "NFKC"
    min_chars: int = Field(200, ge=0)
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    seed: int = 1234
    # Parallel, bounded preparation: the corpus is cut into chunks of about chunk_bytes (files,
    # byte ranges of large JSONL files, parquet row groups, dataset rows); `workers` processes
    # encode chunks side by side. Peak memory is set by these, not by the corpus size.
    workers: int = Field(1, ge=1, le=256)
    chunk_bytes: str | int = "64MiB"
    # A document longer than this is encoded in pieces cut at paragraph, sentence or word
    # boundaries (the tokens are those of the whole document) or, with long_docs=truncate, cut here.
    max_doc_chars: int = Field(1_000_000, ge=1000)
    long_docs: Literal["split", "truncate"] = "split"

    _chunk = _size_field("chunk_bytes")

    @model_validator(mode="after")
    def _hashes_bounded(self) -> "DataConfig":
        if self.dedup.near.bands is not None and self.dedup.near.bands * self.dedup.near.rows > 1024:
            raise ValueError("data.dedup.near.bands x rows must be at most 1024 hashes")
        return self


class ModelConfig(_Strict):
    """GPT-NeoX hyper-parameters. `preset` fills every field not given explicitly."""

    preset: str | None = "tiny"
    n_layers: int | None = Field(None, ge=1)
    d_model: int | None = Field(None, ge=8)
    n_heads: int | None = Field(None, ge=1)
    d_ff: int | None = Field(None, ge=1)
    vocab_size: int | None = Field(None, ge=2)  # None: taken from the tokenizer
    rotary_pct: float = Field(0.25, ge=0.0, le=1.0)
    rotary_base: float = Field(10000.0, gt=0)
    parallel_residual: bool = True
    tie_embeddings: bool = False
    norm_eps: float = Field(1e-5, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    init_std: float = Field(0.02, gt=0)
    # The head size attention runs at: auto pads q, k, v with zero channels to the next multiple of
    # 8 where that lets a fused kernel run (exact; FORGE-s: 86 -> 88 on a GPU), off never, or a size.
    pad_head_dim: Literal["auto", "off"] | int = "auto"
    # Start from these weights (a hetforge checkpoint or run directory, e.g. one `hetforge export
    # --from hf` wrote): continued pre-training. Its model shape and tokenizer are used.
    init_from: str | None = None

    @model_validator(mode="after")
    def _apply_preset(self) -> "ModelConfig":
        if self.preset is not None:
            if self.preset not in PRESETS:
                raise ValueError(
                    f"unknown preset {self.preset!r}; allowed: {', '.join(sorted(PRESETS))}"
                )
            p = PRESETS[self.preset]
            for key in ("n_layers", "d_model", "n_heads", "d_ff"):
                if getattr(self, key) is None:
                    object.__setattr__(self, key, getattr(p, key))
        for key in ("n_layers", "d_model", "n_heads"):
            if getattr(self, key) is None:
                raise ValueError(f"`{key}` is required when no preset is given")
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if isinstance(self.pad_head_dim, int) and self.pad_head_dim < self.d_model // max(self.n_heads, 1):
            raise ValueError(f"model.pad_head_dim={self.pad_head_dim} is smaller than the head size "
                             f"{self.d_model // self.n_heads} (d_model / n_heads)")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"model.n_heads must divide model.d_model "
                f"(got n_heads={self.n_heads} and d_model={self.d_model})"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class TrainConfig(_Strict):
    steps: int = Field(300, ge=1)
    seq_len: int = Field(128, ge=2)
    micro_batch_size: int = Field(16, ge=1)
    grad_accum: int = Field(1, ge=1)
    # The global batch in tokens; default micro_batch_size * grad_accum * seq_len. On a cluster the
    # balancer splits it over ranks, and micro_batch_size becomes the largest micro-batch it tries.
    global_batch_tokens: int | None = Field(None, ge=1)
    optimizer: Literal["adamw", "lamb"] = "adamw"
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0.0)  # 0 disables clipping
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    # torch.compile per block branch (regional: a small cold start, blocks stay the unit that
    # plans and parallelisms wrap). auto: on a GPU without an activation plan; on; off.
    compile: Literal["auto", "on", "off"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int | None = Field(None, ge=1)
    seed: int = 1234
    log_interval: int = Field(10, ge=1)
    eval_interval: int = Field(100, ge=1)
    eval_batches: int = Field(8, ge=1)
    final_eval_batches: int = Field(64, ge=1)  # the end-of-run validation is larger
    # multiple-choice tasks (names as `hetforge eval --tasks` takes them) scored at every validation
    # and at the end, on the first eval_task_limit questions of each (null: all): downstream
    # accuracy as it grows
    eval_tasks: list[str] = []
    eval_task_limit: int | None = Field(100, ge=1)
    eval_task_shots: int = Field(0, ge=0)
    checkpoint_interval: int = Field(100, ge=1)
    keep_checkpoints: int = Field(2, ge=2)
    save_checkpoints: bool = True  # false for benchmarks: no checkpoint is written, so none resumes
    peak_tflops: float | None = Field(None, gt=0)  # None: measured with a matmul benchmark
    tensorboard: bool = True
    wandb: Literal["off", "offline", "online"] = "off"  # Weights & Biases beside TensorBoard (extra `wandb`)
    wandb_project: str = "hetforge"
    progress: bool = True

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.global_batch_tokens is not None and self.global_batch_tokens % self.seq_len != 0:
            raise ValueError(
                f"train.global_batch_tokens must be a multiple of train.seq_len, since a sample is "
                f"seq_len tokens (got global_batch_tokens={self.global_batch_tokens}, "
                f"seq_len={self.seq_len}; nearest: {self.global_batch_tokens // self.seq_len * self.seq_len or self.seq_len})"
            )
        if self.warmup_steps >= self.steps and self.steps > 1:
            raise ValueError(
                f"train.warmup_steps must be smaller than train.steps "
                f"(got warmup_steps={self.warmup_steps}, steps={self.steps})"
            )
        return self

    @property
    def global_batch_size(self) -> int:
        """Samples (sequences) per optimizer step, summed over all ranks."""
        if self.global_batch_tokens is not None:
            return self.global_batch_tokens // self.seq_len
        return self.micro_batch_size * self.grad_accum


class DeviceSpec(_Strict):
    """One kind of device on a node. `memory_gb` and `speed` are optional: what is not declared is
    measured. `slowdown` / `slowdown_from_step` are a simulation knob for tests and benchmarks on
    one machine: after each forward the rank sleeps (slowdown - 1) x 3 x the forward's time (a
    forward and its backward take about 3 forwards), i.e. it behaves like a device `slowdown` times
    slower (from that step on); see `cluster.spec.Slowdown`."""

    type: str = "cpu"
    count: int = Field(1, ge=1)
    # GiB (2^30 bytes), as datasheets print "GB"; a figure a few percent above what the driver
    # reports (16 for a V100 the driver shows as 15.8 GiB) is accepted and the smaller one used.
    memory_gb: float | None = Field(None, gt=0)
    speed: float | None = Field(None, gt=0)  # relative samples/s; used instead of measuring
    power_w: float | None = Field(None, gt=0)  # for the energy estimate; default the GPU model's board power
    slowdown: float = Field(1.0, ge=1.0)
    slowdown_from_step: int = Field(0, ge=0)

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        # A misspelt card would otherwise get no datasheet figures (power, peak, precision) and
        # train as if it were some other device.
        if v.strip().lower() == "cpu" or lookup(v) is not None:
            return v
        raise ValueError(f"unknown device type {v!r}; allowed: cpu, {', '.join(d.name for d in DEVICES)} "
                         f"(or a name containing one, e.g. 'Tesla V100-SXM2-32GB')")


class NodeSpec(_Strict):
    host: str = "localhost"
    devices: list[DeviceSpec] = Field(default_factory=lambda: [DeviceSpec()], min_length=1)
    # The host's memory (GiB): what the node's ranks together may keep there under parameter or
    # optimizer offload. None: the planner does not bound it (a launched run plans as `plan --cluster`).
    memory_gb: float | None = Field(None, gt=0)


class AssignmentSpec(_Strict):
    """A hand-set share of the global batch for one rank (cluster.balance = fixed)."""

    samples: int = Field(ge=0)
    micro_batch_size: int = Field(ge=1)


class ClusterConfig(_Strict):
    nodes: list[NodeSpec] = Field(default_factory=list)  # empty: one process, or measure all
    file: str | None = None  # a YAML file holding `nodes:` (shared by several run configs)
    balance: Literal["auto", "equal", "fixed"] = "auto"  # equal = HetSeq's manual default
    assignments: list[AssignmentSpec] = Field(default_factory=list)
    probe_steps: int = Field(2, ge=1)
    rebalance: bool = True
    rebalance_threshold: float = Field(0.25, gt=0)
    rebalance_window: int = Field(5, ge=1)
    rendezvous_timeout_s: float = Field(120.0, gt=0)
    # A peer that stops answering (hung, stopped, its node gone) is reported after this long; a
    # checkpoint or a prepare on rank 0 happens outside collectives and does not count against it.
    collective_timeout_s: float = Field(300.0, gt=0)
    # Between nodes, in Gbit/s as Ethernet is sold (1, 10, 25): what a collective or a pipeline's
    # activations pay where they cross nodes. None: the link within a node (parallel.link_gbps).
    inter_node_gbit: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "ClusterConfig":
        if self.balance == "fixed" and not self.assignments:
            raise ValueError("cluster.balance=fixed needs cluster.assignments (one per rank)")
        if self.file and self.nodes:
            raise ValueError("give cluster.nodes or cluster.file, not both")
        return self


class MemoryConfig(_Strict):
    """Activation memory plan (keep / recompute / offload per block branch), made per device.

    budget: None = no limit (keep everything); "auto" = the device's memory (declared
    `memory_gb`, else what a GPU has); or a size such as "10GiB" / "512MiB" / a byte count."""

    budget: str | float | None = None
    strategy: Literal["milp", "none", "full", "sqrt", "recompute-only"] = "milp"
    granularity: Literal["block", "sublayer", "tensor"] = "tensor"
    link_gbps: float | None = Field(None, gt=0)  # host copy GB/s; None: measured (pinned PCIe copy, or the CPU memcpy)
    time_limit_s: float = Field(60.0, gt=0)
    verify_tolerance: float = Field(0.15, gt=0)  # warn when measured and predicted differ more
    # optimizer state (and its step) in host memory: auto = only where nothing fits otherwise
    optimizer_offload: Literal["auto", "on", "off"] = "auto"
    # a kept branch may rebuild cheap units in the backward (`memory.units`): auto = where the run
    # does not compile its blocks (a branch that rebuilds runs eager; a compiled run has the
    # partitioner's recomputation per branch instead, `memory.compiled`)
    rebuild: Literal["auto", "on", "off"] = "auto"

    @field_validator("optimizer_offload", "rebuild", mode="before")
    @classmethod
    def _on_off(cls, v):
        # YAML reads a bare on / off as a boolean
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("budget")
    @classmethod
    def _budget(cls, v):
        if v is None or v == "auto":
            return v
        try:
            if parse_size(v) <= 0:
                raise ValueError
        except ValueError:
            raise ValueError("memory.budget must be auto, a size like 10GiB or 512MiB, or a byte count") from None
        return v

    @property
    def active(self) -> bool:
        return self.budget is not None or self.strategy not in ("milp", "none") or self.optimizer_offload == "on"


class MeshConfig(_Strict):
    """Hybrid sharding: state sharded within groups of `shard` ranks (a node, typically, where the
    links are fast), groups replicated `replicate` times (across nodes). None: all ranks shard."""

    replicate: int | None = Field(None, ge=1)
    shard: int | None = Field(None, ge=1)


class PipelineConfig(_Strict):
    """Pipeline parallelism on `torch.distributed.pipelining`: the blocks cut into `stages`
    consecutive stages (auto: the planner compares pipelines of every stage count with data
    parallelism and trains the fastest layout that fits), one per rank of a pipeline, and world / stages pipelines (replicas) side by
    side with data parallelism between them. Ranks are stage-major (rank = stage x replicas +
    replica), so a stage's replicas are neighbouring ranks, on one node where they fit: gradients
    are reduced within a node and only activations cross a stage boundary.

    layers: blocks per stage, first to last (null: sized to each stage's speed and memory);
    schedule: 1f1b (one forward, one backward: a stage holds at most `stages` micro-batches'
    activations), gpipe (all forwards, then all backwards) or interleaved (each rank holds
    `virtual_stages` chunks of its blocks, looped: the fill and drain shrink by that factor, for as
    many times the boundary traffic and more activations in flight); auto = 1f1b where a pipeline
    has at least as many micro-batches as stages, else gpipe (under stages: auto the planner prices
    interleaved too); recompute: blocks (each block's activations
    recomputed in its backward: a stage holds only its blocks' inputs per in-flight micro-batch,
    for 4/3 of the blocks' FLOPs), none, or auto = per stage, the fewest blocks recomputed that
    make its kept activations fit its memory."""

    stages: int | Literal["auto"] = Field(...)
    layers: list[int] | None = None
    schedule: Literal["auto", "1f1b", "gpipe", "interleaved"] = "auto"
    virtual_stages: int = Field(2, ge=2)  # chunks per rank under the interleaved schedule
    recompute: Literal["auto", "none", "blocks"] = "auto"

    @model_validator(mode="after")
    def _check(self) -> "PipelineConfig":
        if self.stages == "auto":
            if self.layers is not None:
                raise ValueError("parallel.pipeline.layers needs a stage count, not stages: auto")
            return self
        if self.stages < 2:
            raise ValueError(f"parallel.pipeline.stages must be at least 2 (got {self.stages}); leave the pipeline "
                             f"out for none")
        if self.layers is not None:
            if len(self.layers) != self.stages:
                raise ValueError(f"parallel.pipeline.layers has {len(self.layers)} entries for {self.stages} stages; "
                                 f"give one block count per stage")
            least = self.virtual_stages if self.schedule == "interleaved" else 1
            if any(n < least for n in self.layers):
                raise ValueError(f"parallel.pipeline.layers {self.layers}: every stage needs at least {least} "
                                 f"block(s)" + (" (one per chunk of the interleaved schedule)" if least > 1 else ""))
        return self


class ParallelConfig(_Strict):
    """How training state is spread over the ranks (ZeRO stages on PyTorch's FSDP2).

    strategy: ddp = every rank holds everything; zero1 = the optimizer's state sharded
    (`ZeroRedundancyOptimizer`); zero2 = FSDP2 keeping gathered weights from forward to backward;
    fsdp = FSDP2 sharding weights, gradients and state (ZeRO-3); auto = the least sharding under
    which every rank fits, said at the start of the run."""

    strategy: Literal["auto", "ddp", "zero1", "zero2", "fsdp"] = "auto"
    reshard_after_forward: bool | None = None  # None: by strategy (fsdp yes, zero2 no)
    offload: Literal["none", "optimizer", "params"] = "none"
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    link_gbps: float | None = Field(None, gt=0)  # GB/s between ranks for the planner; None: measured
    link_latency_us: float = Field(50.0, ge=0)  # per collective, where link_gbps declares the link
    # FSDP shards consecutive blocks as one unit until it holds this many parameters (fewer,
    # larger collectives for a small model; a block of 4M parameters or more is a unit of its own).
    # Left unset, a run whose ranks fit only with one block a unit takes that.
    unit_params: int = Field(1 << 22, ge=1)
    # zero1: each rank's part of the optimizer state in proportion to its memory (known for every
    # rank: declared memory_gb or the device's own), or equal parts. FSDP2 (zero2, fsdp) shards every
    # tensor evenly: DTensor has no uneven placements, so there it is always equal.
    state_shares: Literal["memory", "equal"] = "memory"
    # zero2 / fsdp: how gradients accumulate over a step's micro-batches (`model.accounting.
    # ACCUMULATIONS`): sharded = collectives every micro-batch, equal micro-batch counts; unsharded =
    # full weights and gradients held for the step, collectives once, any counts; auto = unsharded
    # where every rank's memory holds them and the balance prices the step faster (not under an
    # activation plan, which is solved for the sharded bytes), else sharded.
    accumulation: Literal["auto", "sharded", "unsharded"] = "auto"
    pipeline: PipelineConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> "ParallelConfig":
        if self.pipeline is not None and (self.strategy not in ("auto", "ddp", "fsdp") or self.offload != "none"):
            raise ValueError(f"parallel.pipeline replicates each stage over its replicas (strategy ddp) or shards it "
                             f"over them (fsdp); strategy={self.strategy}, offload={self.offload} within a stage is not "
                             f"supported")
        if self.pipeline is not None and self.strategy == "fsdp" and self.pipeline.schedule == "interleaved":
            raise ValueError("parallel.strategy=fsdp shards a pipeline's stages under the 1f1b or gpipe schedule, not "
                             "interleaved (a rank's chunks share one model)")
        if self.offload == "params" and self.strategy in ("ddp", "zero1"):
            raise ValueError(f"parallel.offload=params needs a sharded strategy (zero2 or fsdp; FSDP2's CPU "
                             f"offload), not {self.strategy}")
        if self.offload == "optimizer" and self.strategy in ("zero1", "zero2", "fsdp"):
            raise ValueError(f"parallel.offload=optimizer is for ddp; with {self.strategy} use offload=params "
                             f"(FSDP2 keeps weight, gradient and optimizer shards on the host and steps there)")
        if self.reshard_after_forward is not None and self.strategy in ("ddp", "zero1"):
            raise ValueError(f"parallel.reshard_after_forward applies to zero2 and fsdp, not {self.strategy}")
        if self.accumulation != "auto" and self.strategy in ("ddp", "zero1"):
            raise ValueError(f"parallel.accumulation applies to zero2 and fsdp, not {self.strategy} (whose "
                             f"gradients are whole on every rank)")
        if self.accumulation == "unsharded" and self.offload == "params":
            raise ValueError("parallel.accumulation=unsharded holds full weights and gradients on the device for "
                             "the step, which parallel.offload=params exists to avoid: use one or the other")
        if self.accumulation == "unsharded" and self.reshard_after_forward:
            raise ValueError("parallel.accumulation=unsharded keeps the gathered weights for the whole step; "
                             "reshard_after_forward=true would gather them again in every backward")
        return self

    def may_accumulate_unsharded(self) -> bool:
        return self.accumulation != "sharded" and self.offload != "params" and not self.reshard_after_forward


class RunConfig(_Strict):
    name: str = "run"
    run_dir: str = "runs/run"
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)

    @model_validator(mode="after")
    def _pipeline_fits_the_model(self) -> "RunConfig":
        pipe = self.parallel.pipeline
        if pipe is None:
            return self
        if self.model.tie_embeddings:
            raise ValueError("parallel.pipeline needs untied embeddings (model.tie_embeddings: false): the input "
                             "embedding and the output projection sit on different stages")
        if pipe.layers is not None and self.model.n_layers is not None and sum(pipe.layers) != self.model.n_layers:
            raise ValueError(f"parallel.pipeline.layers {pipe.layers} cover {sum(pipe.layers)} blocks but the model "
                             f"has {self.model.n_layers}; the counts must add up to model.n_layers")
        if self.memory.active and pipe.schedule == "interleaved":
            raise ValueError("an activation plan (memory.*) is made per stage under the 1f1b or gpipe schedule, not "
                             "interleaved (a rank's chunks would share one plan)")
        if pipe.stages == "auto" and self.cluster.balance == "fixed":
            raise ValueError("parallel.pipeline.stages: auto with cluster.balance: fixed: the assignments are per "
                             "replica, and the replicas are not known until the layout is chosen; give the stages")
        return self

    @model_validator(mode="after")
    def _assignments_cover_the_batch(self) -> "RunConfig":
        # Checked here, before any process group or probe, on every rank alike.
        if self.cluster.balance == "fixed":
            total = sum(a.samples for a in self.cluster.assignments)
            if total != self.train.global_batch_size:
                raise ValueError(
                    f"cluster.assignments give {total} samples in all but the global batch is "
                    f"{self.train.global_batch_size} (train.global_batch_tokens / train.seq_len); they must be equal")
        return self


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """Pydantic's report as one line: each problem as `dotted.field: what is wrong (got ...)`."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see configs/ for the allowed keys)"
        elif "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        if e["type"] == "missing":
            msg = "required"
        loc = f"{prefix}{loc}" if loc else prefix.rstrip(".")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(" ".join(line.split()) for line in lines)


def _parse_scalar(text: str) -> Any:
    # YAML gives the same typing a user gets in the file: 50 -> int, 1e-3 -> float, true -> bool.
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            return value
    return value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `--set a.b.c=value` overrides to a raw config mapping (before validation)."""
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects KEY=VALUE (got {item!r})")
        key, value = item.split("=", 1)
        if not value.strip():
            raise ConfigError(f"--set {key}= has no value; write the value (null for none)")
        parts = key.strip().split(".")
        node: Any = out
        for i, p in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):  # list items by index: data.sources.0.path=...
                if not p.isdigit() or int(p) >= len(node):
                    raise ConfigError(f"--set {key}: {p!r} is not an index of a list of {len(node)}")
                p = int(p)
            elif not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {parts[i - 1]!r} is not a section")
            elif not last and node.get(p) is None:
                node[p] = {}
            if last:
                node[p] = _parse_scalar(value)
            else:
                node = node[p]
    return out


def build_config(raw: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"invalid config: {format_validation_error(err)}") from None


def yaml_error(err: yaml.YAMLError) -> str:
    """A YAML parse error as one line with its position."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).split("\n")[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else " ".join(str(err).split())


def blank_values(text: str) -> list[tuple[str, int]]:
    """(dotted key, line) of every `key:` with nothing after it. YAML reads that as null, which
    for an optional field (memory.budget: no limit) would silently mean something the user did not
    write; an explicit `null` stays allowed."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return []
    found: list[tuple[str, int]] = []

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}{k.value}"
                if isinstance(v, yaml.ScalarNode) and v.tag.endswith(":null") and v.value == "":
                    found.append((key, k.start_mark.line + 1))
                walk(v, key + ".")
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, f"{prefix}{i}.")

    walk(root, "")
    return found


def yaml_line(text: str, loc: tuple) -> int | None:
    """The 1-based line of the deepest node of `loc` (keys and list indices) that the YAML text
    has, so an error can point at the line to fix; None when not even the first key is there."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if nxt is None:
                break
            line, node = nxt[0].start_mark.line + 1, nxt[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def validate_file(model: type[BaseModel], raw: Any, text: str, path: Path, prefix: str = "") -> Any:
    """`model.model_validate(raw)`, its first problem located in the file (`FILE:LINE: field: ...`)."""
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]["loc"]
        line = yaml_line(text, tuple(first))
        where = f"{path}:{line}" if line else str(path)
        raise ConfigError(f"{where}: {format_validation_error(err, prefix)}") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read, override and validate a YAML run config. Relative paths stay relative to the CWD."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
        raw = yaml.safe_load(text)
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {yaml_error(err)}") from None
    if raw is None:
        raise ConfigError(f"{path}: the config file is empty; start from one in configs/ (e.g. configs/tiny.yaml)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    blank = blank_values(text)
    if blank:
        key, line = blank[0]
        raise ConfigError(f"{path}:{line}: {key} has no value; write the value (null for none) or remove the key")
    if not overrides:
        return validate_file(RunConfig, raw, text, path)
    try:
        return build_config(apply_overrides(raw, overrides))
    except ConfigError as err:
        raise ConfigError(f"{path} with --set {' --set '.join(overrides)}: {err}") from None


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
