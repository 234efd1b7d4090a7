"""`hetforge` command line: one entry point for every command (`hetforge --help` lists them)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from hetforge.config import ConfigError
from hetforge.core.errors import HetforgeError

# Package data, so that `hetforge demo` works from a wheel too (configs/demo.yaml links here).
DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo.yaml"


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="run config (YAML); see configs/")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.steps=50 (repeatable)")


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line like every other hetforge error."""

    def error(self, message: str):
        print(f"error: {self.prog}: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _number(kind: type, low: float, inclusive: bool):
    """An argparse type: a number of `kind` at least (or above) `low`, else argparse's one-line error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if value != value or value in (float("inf"), float("-inf")) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{text} must be {'at least' if inclusive else 'above'} {low:g}")
        return value

    parse.__name__ = kind.__name__  # what argparse names in its messages
    return parse


COUNT = _number(int, 1, True)  # how many of something: 1 or more
NONNEG = _number(int, 0, True)
POSITIVE = _number(float, 0.0, False)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="hetforge", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    _run_commands(sub)
    _science_commands(sub)
    _model_commands(sub)
    return ap


def _run_commands(sub) -> None:
    """prepare, train, balance, plan: getting data and a run going."""
    p = sub.add_parser("prepare", help="clean corpus, train tokenizer, write token shards")
    _add_config(p)
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--workers", type=COUNT, default=None, metavar="N", help="encoding processes (default data.workers)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--task", default=None, metavar="I/N",
                   help="encode only chunks I, I+N, ... (one of N jobs, e.g. a Slurm array task); then --merge")
    g.add_argument("--merge", action="store_true", help="after every --task: deduplicate across them, write the shards")

    p = sub.add_parser("train", help="train (resumes from the newest valid checkpoint)")
    _add_config(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="require a checkpoint to resume from")
    g.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    p.add_argument("--stop-after", type=COUNT, default=None, metavar="N",
                   help="checkpoint and exit after N steps of this invocation (time-limited jobs)")

    p = sub.add_parser("balance", help="measure the ranks and split the global batch (run under torchrun)")
    _add_config(p)

    p = sub.add_parser("doctor", help="what a run will see on this node: torch, CUDA, NCCL, devices, network, "
                                      "its node of a cluster file")
    p.add_argument("config", nargs="?", default=None, help="a run config: its cluster file and head size")
    p.add_argument("--cluster", default=None, metavar="FILE", help="a cluster file (default: the config's)")

    p = sub.add_parser("launch", help="the commands that start a run on each node of its cluster file (torchrun, "
                                      "Slurm); --run starts this node's")
    _add_config(p)
    p.add_argument("--port", type=_number(int, 1, True), default=29500, help="the rendezvous port (default 29500)")
    p.add_argument("--max-restarts", type=NONNEG, default=3, help="torchrun restarts after a failure (default 3)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in every node's environment, e.g. NCCL_DEBUG=WARN (repeatable)")
    p.add_argument("--ifname", default=None, metavar="IF",
                   help="the network interface for gloo and NCCL (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)")
    p.add_argument("--sbatch", default=None, metavar="FILE", help="also write a Slurm batch script to FILE")
    p.add_argument("--json", action="store_true", help="print the per-node commands as JSON")
    p.add_argument("--run", action="store_true", help="start this node's part (the node named by --node, "
                                                     "HETFORGE_NODE, or this host)")
    p.add_argument("--node", default=None, help="with --run: the cluster file's node this is (index or host)")

    p = sub.add_parser("plan", help="what a run decides (strategy, shares, activation plans, step time), before it runs")
    _add_config(p)
    p.add_argument("--budget", default=None, help="device memory budget, e.g. 10GiB (default: memory.budget)")
    p.add_argument("--device", default="auto", help="profile on this torch device: cpu, cuda, cuda:1, auto")
    p.add_argument("--card", default=None, help="plan for a card that is not here (V100, T4, A100-80GB, ...): its "
                                               "figures estimated from shapes and its datasheet (memory.analytic)")
    p.add_argument("--micro-batch", type=COUNT, default=None, help="default: train.micro_batch_size")
    p.add_argument("--strategy", default=None, choices=["milp", "none", "full", "sqrt", "recompute-only"])
    p.add_argument("--granularity", default=None, choices=["block", "sublayer", "tensor"],
                   help="decide per block, per branch, or per saved tensor / op output (default: memory.granularity)")
    p.add_argument("--cluster", default=None, metavar="FILE",
                   help="a cluster YAML (nodes: ...): the plan `train` would make launched on it")
    p.add_argument("--out", default=None, help="directory for plan.json, plan.txt and the PNG (default RUN_DIR/plan)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON only")


def _science_commands(sub) -> None:
    """scale, report, size: how big, what it cost."""
    p = sub.add_parser("scale", help="scaling laws: run a sweep of small trainings, fit L(N, D) to it")
    ssub = p.add_subparsers(dest="scale_command", required=True)
    q = ssub.add_parser("sweep", help="train a grid of model sizes x token budgets (one after another)")
    _add_config(q)
    q.add_argument("--sizes", required=True, help="LAYERSxWIDTH or presets, comma-separated, e.g. 2x64,3x96,4x128")
    q.add_argument("--tokens", required=True, help="token budgets, comma-separated, e.g. 100k,300k,1M")
    q.add_argument("--out", default=None, help="directory for the runs (default RUN_DIR-sweep)")
    q.add_argument("--print-commands", action="store_true",
                   help="print one `hetforge train` command per run (for a scheduler) instead of running them")
    q.add_argument("--eval-tasks", default=None, metavar="T1,T2",
                   help="score every run on these tasks as it trains and at its end (train.eval_tasks); "
                        "`scale fit` then plots their accuracy against compute")
    q.add_argument("--eval-limit", type=COUNT, default=None,
                   help="with --eval-tasks: the first N questions of each task (default: all)")
    q = ssub.add_parser("fit", help="fit L(N, D) = E + A/N^a + B/D^b to the finished runs of a directory")
    q.add_argument("runs_dir")
    q.add_argument("--holdout", action="append", default=[], metavar="RUN",
                   help="leave this run out of the fit and predict it (repeatable)")
    q.add_argument("--bootstrap", type=NONNEG, default=200, help="resamples for the confidence intervals (default 200)")
    q.add_argument("--out", default=None, help="constants JSON (default RUNS_DIR/scaling_law.json; PNG beside it)")

    p = sub.add_parser("report", help="what a run cost: FLOPs, tokens, MFU/HFU, wall time, energy")
    p.add_argument("run_dir", help="a run directory (holding metrics.jsonl)")
    p.add_argument("--json", action="store_true", help="print the report as JSON only")

    p = sub.add_parser("size", help="compute-optimal model and data size for a budget (Chinchilla law)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--compute", type=POSITIVE, help="training FLOPs to spend, e.g. 1e20")
    g.add_argument("--gpu-hours", type=POSITIVE, help="device-hours to spend on --cluster (or --device)")
    g.add_argument("--tokens", type=POSITIVE, help="tokens available: the model size they are optimal for")
    p.add_argument("--cluster", default=None, metavar="FILE", help="cluster YAML (nodes: ...): wall time and energy")
    p.add_argument("--device", default=None, help="one device type instead of a cluster, e.g. A100-80GB")
    p.add_argument("--mfu", type=POSITIVE, default=0.40, help="model FLOPs utilisation to assume (default 0.40)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--law", default=None, metavar="JSON", help="fitted constants (hetforge scale fit); default Epoch AI")
    p.add_argument("--vocab", type=_number(int, 2, True), default=52000, help="vocabulary size (default 52000, FORGE's)")
    p.add_argument("--seq", type=COUNT, default=2048, help="sequence length (default 2048)")
    p.add_argument("--json", action="store_true", help="print the recommendation as JSON only")


def _model_commands(sub) -> None:
    """eval, heads, generate, export, demo: what a checkpoint is worth and where it goes."""
    p = sub.add_parser("eval", help="perplexity and bits-per-byte of a checkpoint on a split")
    p.add_argument("checkpoint", help="checkpoint directory, or a run directory (newest valid one)")
    p.add_argument("--split", default="val", choices=["val", "train"])
    p.add_argument("--data", default=None, metavar="DIR",
                   help="a prepared data directory to evaluate on (default: the checkpoint's own; an imported "
                        "model has none)")
    p.add_argument("--max-batches", type=COUNT, default=None)
    p.add_argument("--batch-size", type=COUNT, default=16)
    p.add_argument("--prompt", default=None, help="also sample a continuation of this prompt")
    p.add_argument("--tasks", action="append", default=[], metavar="T1,T2",
                   help="multiple-choice tasks instead of perplexity: sciq, arc_easy, arc_challenge, piqa, "
                        "openbookqa, hellaswag, mmlu_<subject>, groups forge and mmlu_sci, sci_mc (a smoke test) "
                        "or a JSONL file; comma-separated or repeated")
    p.add_argument("--task", action="append", dest="tasks", help=argparse.SUPPRESS)
    p.add_argument("--shots", type=NONNEG, default=0, help="few-shot examples per question (default 0)")
    p.add_argument("--limit", type=COUNT, default=None, help="score only the first N questions of each task")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where the task scores go (default RUN/eval/step_XXXXXXXX-Nshot.json)")
    p.add_argument("--via", choices=["hetforge", "lm-eval"], default="hetforge",
                   help="score the tasks with hetforge's scorer or through lm-evaluation-harness (extra 'eval')")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")

    p = sub.add_parser("heads", help="fine-tune heads on a checkpoint's pooled embeddings; score them on test")
    p.add_argument("checkpoint", help="checkpoint directory, or a run directory (newest valid one)")
    p.add_argument("--task", action="append", default=[], choices=["aclsum-aspects", "aclsum-year"],
                   help="default: both (sentence aspects, macro-F1; publication year, MAE)")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")

    p = sub.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("checkpoint")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=COUNT, default=64)
    p.add_argument("--temperature", type=_number(float, 0.0, True), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=COUNT, default=None)
    p.add_argument("--seed", type=NONNEG, default=0)

    p = sub.add_parser("export", help="Hugging Face format: export a checkpoint, or import a GPTNeoX directory")
    p.add_argument("source", help="a checkpoint / run directory (--to hf), or a Hugging Face directory (--from hf)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--to", choices=["hf"], help="write SOURCE as a GPTNeoXForCausalLM directory")
    g.add_argument("--from", dest="from_", choices=["hf"], help="read SOURCE (a HF GPTNeoX directory) into a checkpoint")
    p.add_argument("out", help="the directory to write")

    p = sub.add_parser("demo", help="prepare + train + eval the tiny CPU demo on the embedded corpus")
    p.add_argument("--config", default=str(DEMO_CONFIG))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def cmd_prepare(args) -> int:
    from hetforge.config import load_config
    from hetforge.data.prepare import prepare

    cfg = load_config(args.config, args.overrides)
    if args.task is not None:
        from hetforge.data.prepare import prepare_task

        try:
            task, tasks = (int(x) for x in args.task.split("/"))
            if tasks < 1:
                raise ValueError
        except ValueError:
            raise ConfigError(f"prepare --task takes I/N with 0 <= I < N, e.g. 3/16 (got {args.task!r})") from None
        prepare_task(cfg.data, task, tasks, workers=args.workers)
    elif args.merge:
        from hetforge.data.prepare import prepare_merge

        prepare_merge(cfg.data)
    else:
        prepare(cfg.data, force=args.force, workers=args.workers)
    return 0


def _print_train_summary(result, eval_result=None) -> None:
    from rich.table import Table

    from hetforge.core.console import console

    t = Table(title=f"run {result.run_dir}", show_header=False)
    t.add_row("steps", str(result.step))
    if result.extra.get("final_loss"):  # as `hetforge report` has it: the last logging interval's mean
        first, last, loss = result.extra["final_loss"]
        t.add_row("final train loss", f"{loss:.4f} (mean over steps {first}-{last})")
    val = eval_result or result.val
    if val is not None:
        t.add_row("val loss / perplexity", f"{val.loss:.4f} / {val.perplexity:.2f}")
        if val.bits_per_byte is not None:
            t.add_row("val bits per byte", f"{val.bits_per_byte:.4f}")
    if result.losses:
        t.add_row("throughput", f"{result.tokens_per_s:,.0f} tokens/s, {result.tflops:.3f} TFLOP/s")
        t.add_row("MFU", f"{result.mfu:.1%} of a {result.extra['peak_source']} {result.peak_tflops:.2f} TFLOP/s matmul peak")
    else:
        t.add_row("throughput", "no steps run (the run was already complete)")
    t.add_row("checkpoint", str(result.checkpoint))
    t.add_row("metrics / TensorBoard", f"{result.extra['metrics']} / {result.run_dir / 'tensorboard'}")
    t.add_row("loss curve", result.extra["plot"])
    console.print(t)


def cmd_train(args) -> int:
    from hetforge.config import load_config
    from hetforge.train.loop import train

    cfg = load_config(args.config, args.overrides)
    mode = "always" if args.resume else "never" if args.no_resume else "auto"
    result = train(cfg, resume=mode, stop_after=args.stop_after)
    if result.extra.get("rank", 0) == 0:
        _print_train_summary(result)
    if result.interrupted and result.extra.get("signal"):
        return 128 + int(result.extra["signal"])
    return 0


def cmd_balance(args) -> int:
    from hetforge.config import load_config
    from hetforge.train.loop import train

    cfg = load_config(args.config, args.overrides)
    result = train(cfg, resume="never", plan_only=True)
    if result.extra["world_size"] == 1 and result.extra["rank"] == 0:
        print("one process: the whole global batch runs here; launch with torchrun to balance ranks")
    return 0


def cmd_doctor(args) -> int:
    from rich.table import Table

    from hetforge.cluster.doctor import report
    from hetforge.cluster.spec import cluster_nodes, read_cluster_file
    from hetforge.config import load_config
    from hetforge.core.console import console

    nodes, where, head = None, "", 64
    if args.config:
        cfg = load_config(args.config)
        head = cfg.model.head_dim
        nodes, where = cluster_nodes(cfg.cluster), cfg.cluster.file or "cluster.nodes"
    if args.cluster:
        nodes, where = read_cluster_file(args.cluster), args.cluster
    t = Table(title="hetforge doctor", show_header=False)
    for item, found in report(nodes or None, where, head):
        t.add_row(item, found)
    console.print(t)
    return 0


def cmd_launch(args) -> int:
    """Per node of the run's cluster file, the torchrun that starts its ranks (and a Slurm script);
    with --run, this node's, executed here."""
    import os
    import socket
    import sys

    from hetforge.cluster.launch import LaunchOptions, node_commands, sbatch_script
    from hetforge.cluster.spec import NODE_ENV, named_node, same_host, cluster_nodes
    from hetforge.config import load_config
    from hetforge.core.console import console

    cfg = load_config(args.config, args.overrides)
    nodes = cluster_nodes(cfg.cluster)
    if not nodes:
        raise ConfigError(f"{args.config} describes no cluster: set cluster.file (or cluster.nodes) to launch it on "
                          f"several nodes; one process needs no launcher (hetforge train {args.config})")
    env = dict(_key_value(e, "--env") for e in args.env)
    if args.ifname:
        env.update(GLOO_SOCKET_IFNAME=args.ifname, NCCL_SOCKET_IFNAME=args.ifname)
    train_args = ["train", args.config, *(a for o in args.overrides for a in ("--set", o))]
    opts = LaunchOptions(args.port, args.max_restarts, env, cfg.cluster.rendezvous_timeout_s, f"hetforge-{cfg.name}")
    where = cfg.cluster.file or "cluster.nodes"
    if args.run:
        name = args.node or os.environ.get(NODE_ENV)
        if name is not None:
            mine = named_node(nodes, name, where)
        else:
            hosts = [i for i, n in enumerate(nodes) if same_host(n.host, socket.gethostname())]
            if len(hosts) != 1:
                raise ConfigError(f"launch --run: this host ({socket.gethostname()}) is {len(hosts)} node(s) of "
                                  f"{where}; say which with --node INDEX")
            mine = hosts[0]
        cmd = node_commands(nodes, train_args, LaunchOptions(**{**opts.__dict__, "torchrun": [
            sys.executable, "-m", "torch.distributed.run"]}))[mine]
        console.print(f"node {mine} ({nodes[mine].host}): {cmd.shell()}")
        os.execvpe(cmd.argv[0], cmd.argv, {**os.environ, **cmd.env})
    commands = node_commands(nodes, train_args, opts)
    if args.sbatch:
        Path(args.sbatch).write_text(sbatch_script(nodes, train_args, opts))
    if args.json:
        print(json.dumps([{"node": c.node, "host": c.host, "env": c.env, "argv": c.argv} for c in commands]))
        return 0
    for c in commands:
        print(f"# node {c.node} ({c.host}): {c.devices} rank(s)")
        print(c.shell())
    if args.sbatch:
        print(f"# Slurm: sbatch {args.sbatch}")
    return 0


def _key_value(text: str, flag: str) -> tuple[str, str]:
    if "=" not in text or not text.split("=", 1)[0]:
        raise ConfigError(f"{flag} expects KEY=VALUE (got {text!r})")
    k, v = text.split("=", 1)
    return k, v


def cmd_plan(args) -> int:
    """The run's plan (`cluster.run_plan`) for this device, a card of the table, or a cluster file:
    what `train` would decide there, printed and written to OUT/plan.json."""
    from hetforge.cluster.facts import card_facts, declared_facts, device_facts
    from hetforge.cluster.run_plan import resolve_plan
    from hetforge.cluster.spec import read_cluster_file
    from hetforge.config import load_config
    from hetforge.core.console import console, working
    from hetforge.core.precision import resolve_device

    overrides = list(args.overrides)
    for flag, key in ((args.budget, "memory.budget"), (args.strategy, "memory.strategy"),
                      (args.granularity, "memory.granularity"), (args.micro_batch, "train.micro_batch_size")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    cfg = load_config(args.config, overrides)
    shape = _planned_shape(cfg)
    out = Path(args.out or Path(cfg.run_dir) / "plan")
    _check_output_dir(out, "plan --out")
    with working("planning: cards from their shapes and datasheets; a device that is here profiled once (a CPU "
                 "takes minutes; cached in $HETFORGE_CACHE or ~/.cache/hetforge) ..."):
        if args.cluster:
            facts = declared_facts(cfg, shape, read_cluster_file(args.cluster), args.cluster)
        elif args.card:
            facts = card_facts(cfg, shape, args.card)
        else:
            facts = device_facts(cfg, shape, resolve_device(args.device))
        plan = resolve_plan(cfg, shape, facts)
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        for table in plan.tables():
            console.print(table)
    plan.save(out)
    if len(facts.ranks) == 1 and plan.ranks[0].plan is not None:
        _memory_detail(cfg, shape, facts, plan, out, quiet=args.json)
    if not args.json:
        console.print(f"plan: {out / 'plan.json'} ({out / 'plan.txt'})")
    return 0


def _planned_shape(cfg):
    """The model's shape as `train` will build it: the vocabulary of the prepared tokenizer where
    the data is prepared, else the configured one."""
    from hetforge.model.gpt_neox import GPTNeoXConfig

    meta = Path(cfg.data.out_dir) / "meta.json"
    vocab = json.loads(meta.read_text())["vocab_size"] if meta.is_file() else cfg.data.tokenizer.vocab_size
    return GPTNeoXConfig.from_model_config(cfg.model, vocab)


def _memory_detail(cfg, shape, facts, plan, out: Path, quiet: bool) -> None:
    """One device's activation plan in detail: its units, decisions, where memory and time go, the
    baselines beside it, and a picture of memory over the step."""
    from hetforge.cluster.run_plan import rank_device_plan
    from hetforge.core.console import console
    from hetforge.memory.device_plan import rebuild_units
    from hetforge.memory.milp import baselines
    from hetforge.memory.report import (baselines_table, breakdown_table, decisions_table, plot_timeline,
                                        tensors_table, units_table)

    dp = rank_device_plan(cfg, shape, facts, plan, 0)
    prof, mem = dp.profile, cfg.memory
    tables = ([] if prof.meta.get("analytic") else [tensors_table(prof)]) + [
        units_table(prof), decisions_table(dp.plan, prof), breakdown_table(dp.prediction, dp.budget)]
    if dp.budget is not None:
        tables.append(baselines_table(prof, dp.plan, baselines(prof, dp.budget, mem.granularity, mem.time_limit_s,
                                                               rebuild_units(mem, plan.compile))))
    png = plot_timeline(dp.prediction, dp.keep_all, dp.budget, out / "memory_timeline.png",
                        f"{cfg.name}: memory over one step (micro-batch {dp.micro_batch})")
    if quiet:
        return
    for t in tables:
        console.print(t)
    s = dp.plan.solve
    if "seconds" in s:
        console.print(f"HiGHS: {s['status']} in {s['seconds']:.3f}s, gap {s['gap']:.2%}, "
                      f"{s['variables']} variables, {s['constraints']} constraints")
    how = prof.meta.get("link_source", "the card's PCIe" if prof.meta.get("analytic") else "configured")
    console.print(f"host link {prof.link_bytes_per_s / 1e9:.1f} GB/s ({how})")
    if dp.optimizer_offload:
        console.print(f"optimizer state in host memory (it does not fit beside the weights and gradients): "
                      f"+{dp.offload_s * 1e3:.1f} ms per optimizer step (gradients down, weights up, the host's step)")
    console.print(f"timeline: {png}")


def _check_output_dir(path: Path, what: str) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {path} is a file; give a directory")


def cmd_scale(args) -> int:
    return _scale_sweep(args) if args.scale_command == "sweep" else _scale_fit(args)


def _scale_sweep(args) -> int:
    import shlex

    from hetforge.config import load_config
    from hetforge.core.console import console
    from hetforge.scaling.sweep import collect, plan_sweep, write_rows
    from hetforge.train.loop import train

    cfg = load_config(args.config, args.overrides)
    out = Path(args.out or f"{cfg.run_dir}-sweep")
    _check_output_dir(out, "scale sweep --out")
    runs = plan_sweep(args.sizes.split(","), args.tokens.split(","), cfg.train.global_batch_size * cfg.train.seq_len)
    if args.eval_tasks:
        from hetforge.evaluate.benchmarks import expand

        tasks = [t.strip() for t in args.eval_tasks.split(",") if t.strip()]
        expand(tasks)
        args.overrides = list(args.overrides) + [f"train.eval_tasks=[{','.join(tasks)}]",
                                                 f"train.eval_task_limit={args.eval_limit or 'null'}"]
    if args.print_commands:
        for r in runs:
            sets = " ".join(f"--set {shlex.quote(o)}" for o in list(args.overrides) + r.overrides(out, cfg.train.warmup_steps))
            print(f"hetforge train {shlex.quote(args.config)} {sets}")
        return 0
    t0 = time.perf_counter()
    for i, r in enumerate(runs, 1):
        run_cfg = load_config(args.config, list(args.overrides) + r.overrides(out, cfg.train.warmup_steps))
        console.print(f"[bold]sweep {i}/{len(runs)}: {r.name}[/bold] ({r.n_layers} layers, d={r.d_model}, "
                      f"{r.tokens:,} tokens in {r.steps} steps)")
        res = train(run_cfg)
        if res.interrupted:
            console.print("sweep interrupted; run it again to continue where it stopped")
            return 128 + int(res.extra.get("signal") or 0)
    rows = collect(out)
    write_rows(rows, out / "sweep.jsonl")
    console.print(f"sweep of {len(runs)} runs done in {time.perf_counter() - t0:.0f}s: {out / 'sweep.jsonl'}; "
                  f"fit with `hetforge scale fit {out}`")
    return 0


def _scale_fit(args) -> int:
    from rich.table import Table

    from hetforge.core.console import console
    from hetforge.scaling.fit import fit_law, plot_fit, save_fit
    from hetforge.scaling.laws import ScalingError
    from hetforge.scaling.sweep import collect

    if args.out and Path(args.out).is_dir():
        raise ConfigError(f"scale fit --out {args.out} is a directory; give the JSON file to write")
    rows = collect(Path(args.runs_dir))
    names = {r["name"] for r in rows}
    missing = [h for h in args.holdout if h not in names]
    if missing:
        raise ScalingError(f"--holdout {', '.join(missing)}: no finished run of that name in {args.runs_dir} "
                           f"(runs: {', '.join(sorted(names)) or 'none'})")
    held = [r for r in rows if r["name"] in args.holdout]
    used = [r for r in rows if r["name"] not in args.holdout]
    fit = fit_law([r["params"] for r in used], [r["tokens"] for r in used], [r["loss"] for r in used],
                  bootstrap=args.bootstrap, source=f"fit to {len(used)} runs in {args.runs_dir}")
    law = fit.law
    for r in used + held:
        r["fitted"] = law.loss(r["params"], r["tokens"])
        r["error"] = r["fitted"] / r["loss"] - 1
    for r in held:
        r["interval_90"] = fit.predict_interval(r["params"], r["tokens"])
    out = Path(args.out or Path(args.runs_dir) / "scaling_law.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    save_fit(fit, out, used, held)
    png = plot_fit(fit, used, out.with_suffix(".png"), held)
    t = Table(title=f"L(N, D) = {law.E:.4g} + {law.A:.4g}/N^{law.alpha:.4f} + {law.B:.4g}/D^{law.beta:.4f}")
    for col in ("run", "N", "D", "measured loss", "fitted loss", "error"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for r in used + held:
        t.add_row(r["name"] + ("  (held out)" if r in held else ""), f"{r['params']:,}", f"{r['tokens']:,}",
                  f"{r['loss']:.4f}", f"{r['fitted']:.4f}", f"{r['error']:+.2%}")
    console.print(t)
    if fit.bootstrap:
        console.print("90% intervals (" + str(len(fit.bootstrap)) + " bootstrap fits): " + ", ".join(
            f"{k} [{fit.interval(k)[0]:.4g}, {fit.interval(k)[1]:.4g}]" for k in ("E", "A", "B", "alpha", "beta")))
    for r in held:
        lo, hi = r["interval_90"]
        console.print(f"held out {r['name']}: predicted {r['fitted']:.4f} (90% [{lo:.4f}, {hi:.4f}]), measured "
                      f"{r['loss']:.4f}, error {r['error']:+.2%}")
    console.print(f"constants: {out}   plot: {png}   (use with `hetforge size --law {out}`)")
    if any(r.get("tasks") for r in rows):
        console.print(_downstream_of_sweep(rows, out.with_name("downstream.png")))
    return 0


def _downstream_of_sweep(rows: list[dict], png: Path):
    """Each run's final task accuracy against its training FLOPs: a table, and a plot beside the fit."""
    from rich.table import Table

    from hetforge.scaling.downstream import plot_downstream

    tasks = sorted({t for r in rows for t in r.get("tasks", {})})
    series = {t: [(r["flops"], r["tasks"][t]["acc"]) for r in rows if t in r.get("tasks", {})] for t in tasks}
    sizes = {t: [r["params"] for r in rows if t in r.get("tasks", {})] for t in tasks}
    chance = {t: next(r["tasks"][t]["chance"] for r in rows if t in r.get("tasks", {})) for t in tasks}
    plot_downstream(series, chance, png, "downstream accuracy against training compute", sizes)
    t = Table(title=f"downstream accuracy (chance in the header); plot: {png}")
    t.add_column("run")
    t.add_column("FLOPs", justify="right")
    for task in tasks:
        t.add_column(f"{task}\n({chance[task]:.3f})", justify="right")
    for r in sorted(rows, key=lambda r: r["flops"]):
        t.add_row(r["name"], f"{r['flops']:.2e}",
                  *[f"{r['tasks'][task]['acc']:.3f}" if task in r.get("tasks", {}) else "-" for task in tasks])
    return t


def cmd_report(args) -> int:
    from hetforge.core.console import console
    from hetforge.scaling.accounting import report_table, run_report, write_report
    from hetforge.scaling.downstream import plot_downstream, run_points
    from hetforge.train.metrics import plot_loss_curve

    run = Path(args.run_dir)
    if not (run / "metrics.jsonl").is_file():
        raise ConfigError(f"{run}: not a run directory (no metrics.jsonl)")
    try:
        rep = run_report(run)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    plot_loss_curve(run / "metrics.jsonl", rep["loss_curve"], title=run.name)
    series, chance = run_points(run)
    if series:
        rep["tasks_plot"] = str(plot_downstream(series, chance, run / "tasks.png",
                                                f"{run.name}: task accuracy against training compute"))
    write_report(run)
    if args.json:
        print(json.dumps(rep))
    else:
        console.print(report_table(rep))
        if series:
            console.print(f"task accuracy against compute: {rep['tasks_plot']}")
    return 0


def cmd_size(args) -> int:
    from rich.table import Table

    from hetforge.config import ClusterConfig
    from hetforge.core.console import console
    from hetforge.cluster.spec import cluster_nodes
    from hetforge.scaling.laws import EPOCH, LossLaw, ScalingError
    from hetforge.scaling.sizing import cluster_rate, recommend

    if not 0 < args.mfu <= 1:
        raise ScalingError(f"--mfu must be in (0, 1] (got {args.mfu})")
    law = LossLaw.load(args.law) if args.law else EPOCH
    rate = None
    if args.cluster or args.device:
        if args.cluster:
            kinds = [(d.type, d.memory_gb, d.count) for node in cluster_nodes(ClusterConfig(file=args.cluster))
                     for d in node.devices]
        else:
            kinds = [(args.device, None, 1)]
        rate = cluster_rate(kinds, args.mfu, args.precision)
    compute = args.compute
    if args.gpu_hours is not None:
        if rate is None:
            raise ScalingError("--gpu-hours needs --cluster FILE or --device NAME: what the hours run on")
        wall = args.gpu_hours / rate.count * 3600.0  # every device of the cluster, for this long
        compute = wall * rate.flops_per_s
    best, rows = recommend(law, args.vocab, args.seq, compute=compute, tokens=args.tokens)
    budget = compute if compute is not None else 6.0 * best.params * best.tokens

    def cost(o):
        if rate is None:
            return None, None
        wall = o.flops / rate.flops_per_s
        return wall, wall * rate.power_w

    fit = _fit_on(best.shape, args) if (args.cluster or args.device) else None
    if args.json:
        out = []
        for o in rows:
            wall, energy = cost(o)
            out.append({"params": o.params, "tokens": o.tokens, "tokens_per_param": o.tokens_per_param,
                        "loss": o.loss, "flops": o.flops, "shape": {k: getattr(o.shape, k) for k in ("n_layers", "d_model", "n_heads", "d_ff")}, "wall_s": wall,
                        "energy_j": energy, "optimal": o is best})
        print(json.dumps({"law": law.to_dict(), "compute": budget, "preset": best.preset,
                          "cluster": rate.describe() if rate else None, "fits": fit, "options": out}))
        return 0
    s_ = best.shape
    console.print(f"budget {budget:.3g} FLOPs (C = 6ND), law L = {law.E:.4g} + {law.A:.4g}/N^{law.alpha:.4g} + "
                  f"{law.B:.4g}/D^{law.beta:.4g} ({law.source})")
    if rate is not None:
        console.print(f"cluster: {rate.describe()}, {rate.power_w / 1e3:,.1f} kW at board power")
    console.print(f"compute-optimal: [bold]{best.params / 1e6:,.1f}M parameters on {best.tokens / 1e9:,.2f}B tokens[/bold] "
                  f"({best.tokens_per_param:.1f} tokens/param), predicted loss {best.loss:.3f}")
    console.print(f"build: n_layers={s_.n_layers} d_model={s_.d_model} n_heads={s_.n_heads} d_ff={s_.d_ff} "
                  f"(vocab {args.vocab}, seq {args.seq}); nearest preset: {best.preset}")
    if fit is not None:
        console.print(f"on {args.cluster or args.device}: " + (
            f"fits, {fit['strategy']} with micro-batches of {fit['micro_batch']} ({fit['how']})" if fit["fits"]
            else f"does not fit: {fit['why']}"))
    t = Table(title="the same budget at other sizes")
    for col in ("params", "tokens", "tokens/param", "shape (L x d)", "predicted loss", "FLOPs (6N + attn)",
                "wall time", "energy"):
        t.add_column(col, justify="right")
    for o in rows:
        wall, energy = cost(o)
        mark = " *" if o is best else ""
        t.add_row(f"{o.params / 1e6:,.1f}M{mark}", f"{o.tokens / 1e9:,.2f}B", f"{o.tokens_per_param:,.1f}",
                  f"{o.shape.n_layers} x {o.shape.d_model}", f"{o.loss:.3f}", f"{o.flops:.3g}",
                  f"{wall / 3600:,.1f} h" if wall is not None else "-",
                  f"{energy / 3.6e9:,.2f} MWh" if energy is not None else "-")
    console.print(t)
    return 0


def _fit_on(shape, args) -> dict:
    """Whether a model of `shape` trains on the cluster (or device) of `hetforge size`, and under
    which layout: the run's plan (`cluster.run_plan`) at micro-batch 1, activations recomputed per
    block where the memory needs it (the least a plan can hold, decided without a search)."""
    from hetforge.cluster.facts import card_facts, declared_facts
    from hetforge.cluster.run_plan import resolve_plan
    from hetforge.cluster.spec import read_cluster_file
    from hetforge.config import build_config

    nodes = read_cluster_file(args.cluster) if args.cluster else None
    world = sum(d.count for n in nodes for d in n.devices) if nodes else 1
    cfg = build_config({"model": {"preset": None, "n_layers": shape.n_layers, "d_model": shape.d_model,
                                  "n_heads": shape.n_heads, "d_ff": shape.d_ff, "vocab_size": args.vocab},
                        "train": {"seq_len": args.seq, "micro_batch_size": 1, "grad_accum": world,
                                  "precision": args.precision},
                        "memory": {"budget": "auto", "strategy": "full"}})
    full = type(shape)(**{**shape.to_dict(), "vocab_size": args.vocab})
    try:
        facts = declared_facts(cfg, full, nodes, args.cluster) if nodes else card_facts(cfg, full, args.device)
        plan = resolve_plan(cfg, full, facts)
    except HetforgeError as err:
        return {"fits": False, "why": " ".join(str(err).split())}
    how = "every block recomputed" + (", optimizer on the host" if any(r.optimizer_offload for r in plan.ranks) else "")
    return {"fits": True, "strategy": plan.strategy, "micro_batch": 1, "how": how,
            "peak_gib": max(r.predicted_peak_bytes or 0 for r in plan.ranks) / 2**30}


def _eval(checkpoint: str, split: str, max_batches, batch_size: int, data: str | None = None):
    from hetforge.data.shards import PackedSamples, TokenShard
    from hetforge.data.tokenizer import load_tokenizer, token_byte_lengths
    from hetforge.evaluate.perplexity import evaluate
    from hetforge.model.load import load_for_inference
    from hetforge.core.precision import resolve_device

    device = resolve_device("auto")
    model, state = load_for_inference(checkpoint, device)
    data_dir = data or state.get("data_dir")
    if data_dir is None:
        raise ConfigError(f"{state['path']} carries no data split of its own (an imported model): give --data DIR, "
                          f"a directory `hetforge prepare` wrote with this model's tokenizer")
    if not (Path(data_dir) / "meta.json").is_file():
        raise ConfigError(f"--data {data_dir}: not a prepared data directory (no meta.json; run hetforge prepare)")
    samples = PackedSamples(TokenShard(data_dir, split), state["seq_len"], split)
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    if data is None and state.get("data_fingerprint") and meta.get("fingerprint") != state["data_fingerprint"]:
        from hetforge.core.console import warn

        warn(f"{data_dir} was prepared again since {state['path']} was trained on it "
             f"(data fingerprint {meta.get('fingerprint', '?')[:12]}, the checkpoint's {state['data_fingerprint'][:12]})")
    tok = load_tokenizer(state["tokenizer"])
    if meta.get("vocab_size", 0) > model.cfg.vocab_size:
        raise ConfigError(f"--data {data_dir} was tokenized with {meta['vocab_size']} tokens, more than the model's "
                          f"{model.cfg.vocab_size}: prepare it with the model's tokenizer (data.tokenizer.path)")
    res = evaluate(model, samples, batch_size, device, max_batches, token_byte_lengths(tok))
    return model, state, tok, res


def cmd_eval(args) -> int:
    from hetforge.core.console import console

    if args.tasks:
        return _eval_tasks(args)
    model, state, tok, res = _eval(args.checkpoint, args.split, args.max_batches, args.batch_size, args.data)
    out = {"checkpoint": state["path"], "split": args.split, **res.to_dict()}
    if args.prompt:
        out["prompt"], out["sample"] = args.prompt, _sample(model, state, tok, args.prompt, 48, 0.0, None, 0)
    if args.json:
        print(json.dumps(out))
    else:
        console.print(f"checkpoint {out['checkpoint']} on {args.split}: {res.tokens:,} tokens")
        bpb = f"{res.bits_per_byte:.4f}" if res.bits_per_byte is not None else "n/a"
        console.print(f"  loss {res.loss:.4f} nats/token | perplexity {res.perplexity:.2f} | bits/byte {bpb}")
        if args.prompt:
            console.print(f"  sample: {args.prompt}[bold]{out['sample']}[/bold]")
    return 0


def _eval_tasks(args) -> int:
    from hetforge.core.console import console
    from hetforge.core.precision import resolve_device
    from hetforge.data.tokenizer import load_tokenizer
    from hetforge.evaluate.benchmarks import expand
    from hetforge.evaluate.suite import result_path, save_scores, score_tasks
    from hetforge.model.load import load_for_inference

    names = [t for arg in args.tasks for t in arg.split(",") if t.strip()]
    expand(names, args.shots)  # a bad name fails before the model loads
    device = resolve_device("auto")
    model, state = load_for_inference(args.checkpoint, device)
    tok = load_tokenizer(state["tokenizer"])
    if args.via == "lm-eval":
        try:
            from hetforge.evaluate.lm_eval_adapter import HetforgeLM, evaluate
        except ImportError:
            raise ConfigError("--via lm-eval needs lm-evaluation-harness: pip install -e '.[eval]'") from None
        lm = HetforgeLM(model=model, tokenizer=tok, device=str(device), max_length=state["seq_len"],
                        batch_size=args.batch_size)
        scores = evaluate(lm, names, args.shots, args.limit)
    else:
        def say(task):
            if not args.json:
                console.print(f"scoring {task} ({args.shots}-shot)")
        scores = score_tasks(model, tok, names, state["seq_len"], device, args.shots, args.limit, args.batch_size, say)
    step = int(state.get("step", 0))
    path = save_scores(Path(args.out) if args.out else result_path(state["path"], step, args.shots), state["path"],
                       step, args.shots, scores, args.via, args.limit)
    if args.json:
        print(json.dumps({"checkpoint": state["path"], "via": args.via, "shots": args.shots, "limit": args.limit,
                          "tasks": [s.to_dict() for s in scores], "saved": str(path)}))
        return 0
    console.print(scores_table(scores, f"{state['path']} ({args.shots}-shot, via {args.via})"))
    console.print(f"saved {path}")
    return 0


def scores_table(scores, title: str):
    """acc and acc_norm with their standard errors, as lm-eval prints them, and chance."""
    from rich.table import Table

    def pm(v, se):
        return "-" if v is None else f"{v:.4f}" + (f" ± {se:.4f}" if se is not None else "")

    t = Table(title=title)
    for col in ("task", "split", "n", "acc", "acc_norm", "chance"):
        t.add_column(col, justify="left" if col in ("task", "split") else "right")
    for s in scores:
        t.add_row(s.task if not s.members else f"[bold]{s.task}[/bold] (group)", s.split, f"{s.n:,}",
                  pm(s.acc, s.acc_stderr), pm(s.acc_norm, s.acc_norm_stderr), f"{s.chance:.4f}")
    return t


def cmd_heads(args) -> int:
    from rich.table import Table

    from hetforge.core.console import console
    from hetforge.data.tokenizer import load_tokenizer
    from hetforge.evaluate.heads import REPORTS, TASKS, held_out
    from hetforge.model.load import load_for_inference
    from hetforge.core.precision import resolve_device

    device = resolve_device("auto")
    model, state = load_for_inference(args.checkpoint, device)
    tok = load_tokenizer(state["tokenizer"])
    rows = [REPORTS[t](model, tok, state["seq_len"], device) for t in (args.task or TASKS)]
    seen = held_out(state)
    if args.json:
        print(json.dumps({"checkpoint": state["path"], "held_out": seen, "tasks": rows}))
        return 0
    t = Table(title=f"heads on pooled embeddings of {state['path']} (frozen), scored on the test split")
    for col in ("task", "metric", "head", "baseline", "train / test"):
        t.add_column(col, justify="left" if col in ("task", "metric") else "right")
    for r in rows:
        t.add_row(r["task"], r["metric"], f"{r['score']:.3f}", f"{r['baseline']:.3f} ({r['baseline_name']})",
                  f"{r['n_train']} / {r['n_test']}")
    console.print(t)
    if seen["in_pretraining"] is None:
        console.print(f"the {seen['test_papers']} test papers: {seen['note']}")
    else:
        console.print(f"the {seen['test_papers']} aclsum test papers: {seen['in_pretraining']} of them in this "
                      f"model's pre-training shards (by paper id)")
    return 0


def _sample(model, state, tok, prompt, max_new, temperature, top_k, seed) -> str:
    from hetforge.data.tokenizer import EOT
    from hetforge.evaluate.generate import generate

    ids = tok.encode(prompt, add_special_tokens=False).ids
    new = generate(model, ids, max_new, state["seq_len"], temperature, top_k, tok.token_to_id(EOT), seed)
    return tok.decode(new)


def cmd_generate(args) -> int:
    from hetforge.data.tokenizer import load_tokenizer
    from hetforge.model.load import load_for_inference
    from hetforge.core.precision import resolve_device

    model, state = load_for_inference(args.checkpoint, resolve_device("auto"))
    tok = load_tokenizer(state["tokenizer"])
    text = _sample(model, state, tok, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + text)
    return 0


def cmd_export(args) -> int:
    from hetforge.core.console import console
    from hetforge.export.hf import export_hf, import_hf

    _check_output_dir(Path(args.out), "export OUT")
    if args.to:
        out = export_hf(args.source, args.out)
        console.print(f"exported {args.source} to {out} (GPTNeoXForCausalLM: config.json, model.safetensors, "
                      f"tokenizer.json); load with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    else:
        out = import_hf(args.source, args.out)
        console.print(f"imported {args.source} to {out}; continue pre-training with --set model.init_from={out}")
    return 0


def cmd_demo(args) -> int:
    from hetforge.config import load_config
    from hetforge.core.console import console
    from hetforge.train.loop import train

    t0 = time.perf_counter()
    cfg = load_config(args.config, args.overrides)
    # The demo is a reproducible showcase: it always trains from scratch in its own run directory.
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    result = train(cfg, resume="never")
    if result.interrupted:
        _print_train_summary(result)
        return 128 + int(result.extra.get("signal") or 0)
    model, state, tok, res = _eval(str(result.checkpoint), "val", None, cfg.train.micro_batch_size)
    _print_train_summary(result, res)
    prompt = "In this paper, we propose"
    console.print(f"sample: {prompt}[bold]{_sample(model, state, tok, prompt, 40, 0.0, None, 0)}[/bold]")
    console.print(f"demo finished in {time.perf_counter() - t0:.0f}s")
    return 0


COMMANDS = {"prepare": cmd_prepare, "train": cmd_train, "balance": cmd_balance, "launch": cmd_launch, "doctor": cmd_doctor,
            "plan": cmd_plan,
            "size": cmd_size, "report": cmd_report,
            "scale": cmd_scale, "export": cmd_export, "heads": cmd_heads,
            "eval": cmd_eval, "generate": cmd_generate, "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except HetforgeError as err:  # the user's to fix: one line; anything else keeps its traceback
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2


def run() -> None:
    """The `hetforge` command: `main`, ended by `exit_process` (a torchrun worker skips the
    interpreter's finalization)."""
    from hetforge.core.process import exit_process

    exit_process(main())


if __name__ == "__main__":
    run()
