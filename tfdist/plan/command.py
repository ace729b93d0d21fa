"""`tfdist plan`: flags -> Workload + Hardware -> a table (or JSON) and the command to run.

    tfdist plan --model transformer --d_model 1024 --num_layers 24 --dataset text \\
        --optimizer adam --global_batch_size 64 --devices 8 --memory_per_device 16GiB
    tfdist plan --params 7e9 --devices 8 --memory_per_device 80GiB --json
    tfdist plan --params 7.5e9 --devices 64 --memory_per_device 80GB --zero_stage 3

Model and dataset flags are experiments/train.py's, with the same defaults.
A --params model has no model flags to print: its plans that do not depend on the
model's layers (data parallel, ZeRO over the data layout) print the other flags, to
run with the user's --model=MODULE:FUNCTION and --dataset=MODULE:FUNCTION.
Exit status: 0 with a plan, 1 when nothing fits (the answer says by how much),
2 for impossible input. Never imports TensorFlow.
"""

import dataclasses
import json
import re
import shlex
from typing import Dict, List, Optional

from tfdist import config as cfg
from tfdist.errors import require
from tfdist.plan import collectives, inventory as inventory_lib, zero
from tfdist.plan.memory import Workload
from tfdist.plan.recommend import (AUTO_ZERO, Evaluated, Hardware, Plan, check_zero_stage,
                                   device_names, gib, recommend, smallest_need, summarize)

EXIT_NO_FIT = 1
DTYPES = ("float32", "mixed_bfloat16", "mixed_float16")
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20,
         "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """'16GiB', '16G' (binary), '16GB' (decimal), '512MiB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    try:
        value = float(match.group(1)) if match else None
    except ValueError:
        value = None
    require(value is not None and unit in UNITS and value > 0,
            f"--memory_per_device must be a positive size like 16GiB, 80GB or 512MiB, "
            f"got {text!r}.")
    return int(value * UNITS[unit])


def build_parser():
    from tfdist.errors import ArgumentParser
    p = ArgumentParser(prog="tfdist plan", description="Estimates the memory per device of "
                       "each way to run a model and recommends the simplest plan that fits.")
    p.add_argument("--devices", type=int, required=True, help="devices in the job (all workers)")
    p.add_argument("--memory_per_device", required=True, help="e.g. 16GiB, 80GB, 512MiB")
    p.add_argument("--workers", type=int, default=1, help="processes the devices are spread over")
    p.add_argument("--device_type", choices=("gpu", "cpu"), default="gpu",
                   help="cpu: print --simulate_devices (a CPU-only host); gpu: --num_gpus")
    p.add_argument("--reserve", type=float, default=0.1,
                   help="fraction of each device's memory kept free for the framework")
    p.add_argument("--model", default="cnn", help="mlp, cnn, resnet, transformer")
    p.add_argument("--params", type=float, default=None,
                   help="plan for a model known only by its parameter count (e.g. 7e9)")
    p.add_argument("--hidden_sizes", default="100,50")
    p.add_argument("--filters", default="32,64")
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--d_ff", type=int, default=256)
    p.add_argument("--dataset", default="digits", help="digits, text, synthetic")
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--synthetic_shape", default="28,28,1")
    p.add_argument("--synthetic_classes", type=int, default=10)
    p.add_argument("--optimizer", default="adam", help=", ".join(cfg.OPTIMIZERS))
    p.add_argument("--dtype", default="float32", help=", ".join(DTYPES))
    p.add_argument("--global_batch_size", type=int, default=64)
    p.add_argument("--remat", choices=("full",), default=None,
                   help="activation recomputation the plan counts on (the run's --remat)")
    p.add_argument("--zero_stage", type=int, default=AUTO_ZERO,
                   help=f"plan this ZeRO stage ({', '.join(map(str, zero.STAGES))}) on the "
                        f"dtensor meshes; 0: no sharded data parallelism; default: stages "
                        f"1-3 where plain plans do not fit")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def parse(argv: List[str]):
    """Validated (args, Workload, Hardware); every mistake is a UsageError naming the value."""
    args = build_parser().parse_args(argv)
    require(args.devices >= 1, f"--devices must be >= 1, got {args.devices}.")
    require(args.workers >= 1 and args.devices % args.workers == 0,
            f"--workers must be >= 1 and divide --devices; got --workers {args.workers} "
            f"for --devices {args.devices}.")
    require(0 <= args.reserve < 1, f"--reserve must be in [0, 1), got {args.reserve}.")
    require(args.global_batch_size >= 1,
            f"--global_batch_size must be >= 1, got {args.global_batch_size}.")
    require(args.optimizer in cfg.OPTIMIZERS,
            f"Unknown --optimizer {args.optimizer!r}. Valid choices: {', '.join(cfg.OPTIMIZERS)}.")
    require(args.dtype in DTYPES,
            f"Unknown --dtype {args.dtype!r}. Valid choices: {', '.join(DTYPES)}.")
    hardware = Hardware(args.devices, parse_bytes(args.memory_per_device), args.workers,
                        args.device_type, args.reserve)
    inventory, known = _inventory(args)
    mixed = None if args.dtype == "float32" else args.dtype
    work = Workload(inventory, args.optimizer, args.global_batch_size, mixed, known, args.remat)
    check_zero_stage(args.zero_stage, work, hardware)
    return args, work, hardware


def _inventory(args):
    if args.params is not None:
        require(args.params >= 1, f"--params must be >= 1, got {args.params:g}.")
        return inventory_lib.from_param_count(int(args.params), args.num_layers), False
    return inventory_lib.inventory(model_config(args), data_config(args)), True


def model_config(args) -> cfg.ModelConfig:
    return cfg.ModelConfig(name=args.model,
                           hidden_sizes=cfg.parse_ints(args.hidden_sizes, "hidden_sizes"),
                           filters=cfg.parse_ints(args.filters, "filters"),
                           num_layers=args.num_layers, d_model=args.d_model,
                           num_heads=args.num_heads, d_ff=args.d_ff)


def data_config(args) -> cfg.DataConfig:
    return cfg.DataConfig(name=args.dataset, seq_len=args.seq_len,
                          synthetic_shape=cfg.parse_ints(args.synthetic_shape, "synthetic_shape"),
                          synthetic_classes=args.synthetic_classes)


# --------------------------------------------------------------------------- the command it prints

MODEL_FLAGS = {"mlp": ("hidden_sizes",), "cnn": ("filters",), "resnet": ("filters",),
               "transformer": ("num_layers", "d_model", "num_heads", "d_ff")}
DATASET_FLAGS = {"digits": (), "text": ("seq_len",),
                 "synthetic": ("synthetic_shape", "synthetic_classes")}


USER_MODEL_FLAGS = ("--model=MODULE:FUNCTION", "--dataset=MODULE:FUNCTION")


def has_flags(evaluated: Evaluated, args) -> bool:
    """Whether the plan has flags to print. A registry model's always have; a --params
    model's only where the plan does not depend on its layers (no layout or stage cut to
    fit): data parallelism, and DTensor's data layout (with or without a ZeRO stage)."""
    c = evaluated.candidate
    if args.params is None:
        return True
    return c.strategy in ("default", "mirrored", "multi_worker_mirrored") or (
        c.strategy == "dtensor" and c.layout == "data")


def model_flags(args) -> List[str]:
    """The model and dataset flags as given; none for a --params model (the user adds
    USER_MODEL_FLAGS)."""
    if args.params is not None:
        return []
    flags = [f"--model={args.model}"]
    flags += [f"--{name}={getattr(args, name)}" for name in MODEL_FLAGS[args.model]]
    flags += [f"--dataset={args.dataset}"]
    return flags + [f"--{name}={getattr(args, name)}" for name in DATASET_FLAGS[args.dataset]]


def train_flags(evaluated: Evaluated, args, hardware: Hardware) -> List[str]:
    """experiments/train.py flags that run the chosen candidate (model and data as given)."""
    c = evaluated.candidate
    flags = [f"--strategy={c.strategy}", *model_flags(args)]
    flags += [f"--optimizer={args.optimizer}", f"--global_batch_size={args.global_batch_size}"]
    policy = c.mixed_precision or (None if args.dtype == "float32" else args.dtype)
    if policy:
        flags.append(f"--mixed_precision={policy}")
    if args.remat:
        flags.append(f"--remat={args.remat}")
    per_worker = hardware.devices // hardware.workers
    device_flag = "--simulate_devices" if hardware.device_type == "cpu" else "--num_gpus"
    if hardware.workers == 1 or hardware.device_type == "gpu":
        flags.append(f"{device_flag}={per_worker}")
    collective = collective_for(evaluated, args, hardware).collective
    if collective is not None:
        flags.append(f"--collective={collective}")
    if c.strategy == "dtensor":
        flags += [f"--mesh=batch={c.replicas},model={c.model_ways}", f"--layout={c.layout}"]
    if c.zero_stage:
        flags.append(f"--zero_stage={c.zero_stage}")
    if c.strategy == "pipeline":
        flags += [f"--pipeline_stages={c.stages}", f"--microbatches={c.microbatches}",
                  f"--pipeline_schedule={c.schedule}"]
    return flags


def collective_for(evaluated: Evaluated, args, hardware: Hardware) -> collectives.Choice:
    """CPU workers that `tfdist launch` starts on this host, one device each: the exact
    collective that trained fastest there (collectives.py holds the measured tables), MPI
    only where it is installed; every other layout keeps TF's collectives. The gradients'
    size only picks which all-reduce bandwidth the reason shows."""
    inventory, _ = _inventory(args)
    gradient_bytes = 4 * sum(w.size for w in inventory.weights if w.trainable)
    return collectives.choose(evaluated.candidate.strategy, hardware.device_type,
                              hardware.devices, hardware.workers, args.dtype, gradient_bytes)


def command(evaluated: Evaluated, args, hardware: Hardware) -> List[str]:
    """The whole command line. Several CPU workers: under `tfdist launch` on this host.
    Several GPU workers: the command each host runs (with its TF_CONFIG, see
    run_it_heading), since one host's workers would otherwise share its GPUs."""
    train = ["python", "-m", "experiments.train", *train_flags(evaluated, args, hardware)]
    if hardware.workers == 1 or hardware.device_type == "gpu":
        return train
    launch = ["tfdist", "launch"]
    if collective_for(evaluated, args, hardware).collective == "mpi":
        launch.append("--mpi")     # Open MPI's mpirun starts the ranks (shared memory on one host)
    launch += ["--workers", str(hardware.workers)]
    if hardware.device_type == "cpu":
        launch += ["--devices_per_worker", str(hardware.devices // hardware.workers)]
    if evaluated.candidate.strategy == "dtensor":
        launch.append("--dtensor")
    return launch + ["--"] + train


# --------------------------------------------------------------------------- output

def to_json(plan: Plan, args, work: Workload, hw: Hardware) -> Dict:
    """`command` runs as it is (a registry model); `flags` are the plan's experiments.train
    flags, for a --params model without USER_MODEL_FLAGS (None: no flags to print)."""
    chosen = plan.chosen
    runnable = chosen is not None and work.inventory.model != inventory_lib.PARAMS_ONLY
    flags = chosen is not None and has_flags(chosen, args)
    return {
        "model": work.inventory.model, "num_params": work.inventory.num_params,
        "devices": hw.devices, "workers": hw.workers,
        "memory_per_device": hw.memory_per_device, "usable_per_device": hw.usable,
        "fits": chosen is not None, "reason": plan.reason,
        "shortfall_bytes": None if chosen else _shortfall(plan, hw),
        "recommended": _candidate_json(chosen, hw) if chosen else None,
        "command": command(chosen, args, hw) if runnable else None,
        "flags": train_flags(chosen, args, hw) if flags else None,
        "collective": _collective_json(chosen, args, hw) if chosen else None,
        "run_on": ("every worker host" if hw.workers > 1 and hw.device_type == "gpu"
                   else "this host"),
        "candidates": [_candidate_json(e, hw) for e in plan.evaluated],
    }


def _collective_json(chosen: Evaluated, args, hw: Hardware) -> Optional[Dict]:
    choice = collective_for(chosen, args, hw)
    return {"name": choice.collective, "reason": choice.reason} if choice.collective else None


def _shortfall(plan: Plan, hw: Hardware) -> Optional[int]:
    best = smallest_need(plan.evaluated)
    return best.peak - hw.usable if best else None


def _candidate_json(e: Evaluated, hw: Hardware) -> Dict:
    names = device_names(hw, e.candidate)
    out = {"plan": e.candidate.describe(), **dataclasses.asdict(e.candidate), "problem": e.problem,
           "fits": e.fits(hw), "peak_bytes": e.peak}
    out["param_bytes_per_device"] = {names[d.device]: d.state for d in e.devices}
    out["gradient_bytes_per_device"] = {names[d.device]: d.gradients for d in e.devices}
    out["per_device"] = [{"device": names[d.device], "params": d.params,
                          "optimizer": d.optimizer, "gradients": d.gradients,
                          "activations": d.activations, "total": d.total} for d in e.devices]
    return out


def table(plan: Plan, args, work: Workload, hw: Hardware) -> str:
    lines = [summarize(work.inventory) + f"; {args.optimizer}, {args.dtype}, global batch "
             f"{args.global_batch_size}; {hw.devices} device(s) x {gib(hw.memory_per_device)} "
             f"({gib(hw.usable)} usable)", ""]
    header = ("plan", "params+opt", "grads", "activations", "peak (worst device)", "fits")
    rows = [header] + [_row(e, hw) for e in plan.evaluated]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    if not work.activations_known:
        lines.append("(activations not estimated for a --params model)")
    lines += ["", plan.reason]
    chosen = plan.chosen
    if chosen and has_flags(chosen, args):
        choice = collective_for(chosen, args, hw)
        if choice.collective:
            lines += ["", choice.reason]
        lines += ["", run_it_heading(chosen, hw, your_model=args.params is not None),
                  "  " + shlex.join(command(chosen, args, hw))]
    elif chosen:
        lines += ["", f"Recommended: {chosen.candidate.describe()} (a --params model has "
                      f"no flags to run for this plan, which depends on the model's layers; "
                      f"plan a registry model for those)."]
    return "\n".join(lines)


def run_it_heading(chosen: Evaluated, hw: Hardware, your_model: bool = False) -> str:
    model = (f" with your model (add {' '.join(USER_MODEL_FLAGS)}; the estimate assumed "
             f"its variables split evenly)" if your_model else "")
    if hw.workers == 1 or hw.device_type == "cpu":
        return f"Run it{model}:"
    env = ("TF_CONFIG (`tfdist tf-config --hosts ... --index I`)"
           if chosen.candidate.strategy != "dtensor" else "DTENSOR_* variables")
    return f"Run it{model} on each of the {hw.workers} worker hosts, with its {env}:"


def _row(e: Evaluated, hw: Hardware):
    if e.problem:
        return (e.candidate.describe(), "-", "-", "-", "-", f"no: {e.problem}")
    worst = max(e.devices, key=lambda d: d.total)
    fits = "yes" if e.fits(hw) else f"no (+{gib(e.peak - hw.usable)})"
    return (e.candidate.describe(), gib(worst.state), gib(worst.gradients),
            gib(worst.activations), gib(worst.total), fits)


def main(argv: List[str]) -> int:
    args, work, hardware = parse(argv)
    plan = recommend(work, hardware, args.zero_stage)
    if args.json:
        print(json.dumps(to_json(plan, args, work, hardware), indent=2))
    else:
        print(table(plan, args, work, hardware))
    return 0 if plan.chosen else EXIT_NO_FIT

