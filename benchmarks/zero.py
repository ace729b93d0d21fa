"""Sharded data parallelism (--zero_stage) measured: bytes per device and examples/s.

Bytes: a transformer is sharded at each stage on 4 simulated devices (batch=4, and the 2-D
batch=2,model=2 with the megatron layout) and each device's parameter + optimizer bytes
(`param_bytes_per_device`, read from the variables' own shards) and gradient bytes (the
layouts the update reads them in) are set beside the ZeRO formula (Rajbhandari et al.
2020) with float32 Adam's sizes: 4 bytes of parameter, 4 of gradient, 8 of state per
parameter, of which a stage divides by N what it shards. On the 2-D mesh the formula is
applied to the tensor-parallel shard (stage 0's bytes), N = 2.

Speed: 2 workers (`tfdist launch --workers 2 --dtensor`, one device and one thread each,
mesh batch=2) train the same transformer at each stage; stages alternate trial by trial,
medians of examples/s are reported beside stage 0's, the plain data parallelism of the
same DTensor collectives.

    python -m benchmarks --suite=zero                 # writes zero.{csv,md} under --out_dir
    python -m benchmarks.zero                         # the bytes rows only, one JSON list
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = (0, 1, 2, 3)
MODEL = dict(num_layers=4, d_model=128, num_heads=4, d_ff=512)
SEQ_LEN, GLOBAL_BATCH = 64, 32
MESHES = (("batch=4,model=1", "data", 4), ("batch=2,model=2", "megatron", 2))
ONE_THREAD = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
              "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
RUN_TIMEOUT_S = 900


def model_flags() -> List[str]:
    return ["--model=transformer", "--dataset=text", f"--seq_len={SEQ_LEN}",
            *(f"--{name}={value}" for name, value in MODEL.items()),
            f"--global_batch_size={GLOBAL_BATCH}", "--optimizer=adam", "--seed=1"]


def formula(params: int, stage: int, n: int) -> int:
    """ZeRO's per-device model-state bytes with float32 Adam: (4 + 4 + 8) per parameter,
    each part divided by n once the stage shards it (params at 3, gradients at 2, state
    at 1); a float32 parameter holds 4 of its bytes, so params = bytes / 4."""
    count = params // 4
    return (4 * count // (n if stage >= 3 else 1) + 4 * count // (n if stage >= 2 else 1)
            + 8 * count // (n if stage >= 1 else 1))


def measure_bytes() -> List[Dict]:
    """In this process (4 simulated CPUs): one row per mesh and stage."""
    from tfdist import config as cfg, data, devices, parallel
    from tfdist.train import runner
    devices.simulate_cpus(4)
    rows = []
    for mesh, layout, n in MESHES:
        base = None
        for stage in STAGES:
            config = cfg.RunConfig(
                strategy="dtensor", simulate_devices=4, mesh=mesh, layout=layout,
                model=cfg.ModelConfig(name="transformer", **MODEL),
                data=cfg.DataConfig(name="text", seq_len=SEQ_LEN), optimizer="adam",
                global_batch_size=GLOBAL_BATCH, zero_stage=stage)
            mode = parallel.build_parallelism(config)
            model, optimizer = runner.build_model_and_optimizer(
                config, mode, data.get_source(config.data).info)
            state = max(mode.param_bytes_per_device(model, optimizer).values())
            gradients = max(mode.gradient_bytes_per_device(model).values())
            measured = state + gradients
            base = base or gradients   # stage 0: the tensor-parallel shard of the parameters
            expected = formula(base, stage, n)
            rows.append({"mesh": mesh, "zero_stage": stage,
                         "params + optimizer MB": round(state / 1e6, 3),
                         "gradients MB": round(gradients / 1e6, 3),
                         "total MB": round(measured / 1e6, 3),
                         "formula MB": round(expected / 1e6, 3),
                         "total / formula": round(measured / expected, 4)})
    return rows


def run_stage(stage: int, out_dir: str) -> float:
    """examples/s of one 2-worker run at `stage` (a fresh launch, one thread a process)."""
    results = os.path.join(out_dir, f"stage{stage}.json")
    command = [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--devices_per_worker", "1", "--dtensor", "--",
               sys.executable, "-m", "experiments.train", "--strategy=dtensor",
               "--mesh=batch=2", f"--zero_stage={stage}", "--train_steps=40",
               "--log_every=40", f"--results_json={results}", *model_flags()]
    env = dict(os.environ, PYTHONPATH=REPO, **ONE_THREAD)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"stage {stage} failed (exit {done.returncode}):\n"
                           f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    with open(results) as f:
        return json.load(f)["examples_per_sec"]


def measure_speed(trials: int) -> List[Dict]:
    rates = {stage: [] for stage in STAGES}
    with tempfile.TemporaryDirectory() as out_dir:
        for trial in range(trials):
            for stage in STAGES:     # alternating: the machine's load falls on each alike
                rates[stage].append(run_stage(stage, out_dir))
                print(f"trial {trial + 1}/{trials} stage {stage}: "
                      f"{rates[stage][-1]:.0f} examples/s", file=sys.stderr, flush=True)
    plain = statistics.median(rates[0])
    return [{"2 workers, batch=2": f"zero_stage={stage}",
             "examples/s (median)": round(statistics.median(rates[stage])),
             "vs stage 0": round(statistics.median(rates[stage]) / plain, 3),
             "trials": " ".join(str(round(r)) for r in rates[stage])} for stage in STAGES]


def bytes_in_subprocess() -> List[Dict]:
    """The bytes rows from a fresh process: simulated devices are set before TensorFlow
    starts, and this process keeps no TensorFlow while the speed runs take the cores."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.zero"],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, **ONE_THREAD),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"the bytes measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(trials: int) -> Dict[str, List[Dict]]:
    return {"zero": bytes_in_subprocess(), "zero_speed": measure_speed(trials)}


if __name__ == "__main__":   # the bytes rows, as one JSON line (bytes_in_subprocess)
    print(json.dumps(measure_bytes()))
