"""The soak and chaos benchmark suites: their bad settings, the kill planner, and one tiny
real run of each so the suites cannot rot. The runs check that a suite ran and wrote its
files with the expected columns, not speed or leaks (that is the suites' job).

The two real runs start 2 and 4 `tfdist launch --workers 2` jobs: about 25 s and 60 s
here on a quiet machine.
"""

import csv
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO
from benchmarks import chaos, soak
from tfdist.errors import UsageError

SOAK_COLUMNS = ["collective", "worker", "steps", "exit", "wall_s", "threads_first", "threads_last",
                "threads_ratio", "threads_peak", "rss_first_mb", "rss_last_mb", "rss_ratio",
                "rss_kb_per_step", "pace_from_step", "fds_first", "fds_last", "first_sample_step",
                "last_sample_step", "pass"]
CHAOS_COLUMNS = ["collective", "steps", "checkpoint_every", "seed", "kills_requested",
                 "kills_delivered", "restarts_seen", "exit", "killed_ranks", "kill_steps",
                 "resumed_at", "steps_recomputed", "steps_recomputed_each", "reference_wall_s",
                 "chaos_wall_s", "max_rel_weight_diff", "worst_variable", "epochs_checked",
                 "examples_checked", "examples_trained_twice", "examples_missed", "pass"]


def test_the_soak_suite_also_soaks_the_pipeline_across_workers():
    assert soak.parse_collectives("tcp,pipeline") == ("tcp", "pipeline")
    assert soak.job_flags("pipeline") == ["--strategy=pipeline", "--pipeline_stages=2",
                                          "--microbatches=4"]
    assert soak.job_flags("shm") == ["--collective=shm"]
    command = soak.launch_command(soak.job_flags("pipeline"))
    # later flags override earlier ones: the pipeline's strategy comes after TRAIN_FLAGS'
    assert command.index("--strategy=pipeline") > command.index("--strategy=multi_worker_mirrored")


@pytest.mark.parametrize("call, message", [
    (lambda: soak.parse_collectives("auto,bogus"),
     "Unknown collective 'bogus' in --collectives='auto,bogus'. Valid choices: fastest, auto, ring"),
    (lambda: soak.parse_collectives(" , "), "--collectives names none, got ' , '"),
    (lambda: soak.parse_collectives("pipeline,tcp,pipeline"),
     "--collectives='pipeline,tcp,pipeline' names pipeline more than once; name each job once."),
    (lambda: soak.run_suite(["tcp"], steps=0, checkpoint_every=10, timeout=60),
     "--steps must be >= 1, got 0"),
    (lambda: soak.run_suite(["tcp"], steps=10, checkpoint_every=-1, timeout=60),
     "--checkpoint_every must be >= 1, got -1"),
    (lambda: chaos.run_suite(0, 100, 10, seed=0, collective="auto", timeout=60),
     "--kills must be >= 1, got 0"),
    (lambda: chaos.run_suite(2, 100, 10, seed=0, collective="gloo", timeout=60),
     "Unknown collective 'gloo'"),
])
def test_bad_settings_are_usage_errors_naming_the_value(call, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        call()


def step_line(step, total=100):
    return f"[worker 0] tfdist 12:00:00 step {step}/{total}  loss 1.0  100 examples/s"


def test_a_kill_waits_for_a_checkpoint_of_its_own_attempt(tmp_path):
    planner = chaos.KillPlanner(kills=2, checkpoint_every=10, seed=0, model_dir=str(tmp_path))
    planner.read([step_line(s) for s in range(1, 41)])
    assert planner.due() is None                 # no checkpoint committed yet
    target, rank = planner.target
    assert 10 < target <= 30 and rank in (0, 1)  # uniform in (R + C, R + 3C], R = 0
    (tmp_path / "checkpoints.json").write_text(json.dumps({"checkpoints": ["ckpt-10", "ckpt-20"]}))
    assert planner.due() == (rank, target)
    planner.killed()
    assert planner.due() is None                 # one kill per attempt

    # The restarted attempt resumes at 20: its newest checkpoint must pass 20 first.
    planner.read(["[tfdist launch] worker 1 was killed by SIGKILL (9); ended every worker. "
                  "restart 1/2 with fresh ports."] + [step_line(s) for s in range(21, 61)])
    assert planner.attempts[-1].resumed_at == 20 and planner.restarts_seen == 1
    assert planner.due() is None
    (tmp_path / "checkpoints.json").write_text(json.dumps({"checkpoints": ["ckpt-20", "ckpt-30"]}))
    target, _ = planner.target
    assert 30 < target <= 50 and planner.due() is not None
    assert chaos.kept_ranges([0, 20, 40], 100) == [(0, 1, 20), (20, 21, 40), (40, 41, 100)]
    # A fall-back to an older checkpoint (20 after 40): the attempt resumed at 20 kept 21..60.
    assert chaos.kept_ranges([0, 40, 20, 60], 100) == [(0, 1, 20), (20, 21, 60), (60, 61, 100)]


def run_suite(args, out_dir, timeout):
    command = [sys.executable, "-m", "benchmarks", *args, f"--out_dir={out_dir}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO))
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def read_csv(path):
    with open(path) as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_the_soak_suite_judges_growth_per_step_past_warm_up_over_long_runs_only():
    at_10, at_2000 = soak.Sample(120, 700_000, 15, 10), soak.Sample(120, 770_000, 15, 2000)
    at_22000 = soak.Sample(120, 830_000, 15, 22000)
    assert soak.rss_kb_per_step([at_2000, at_22000]) == 3.0   # 60 MB over 20,000 steps
    assert not soak.growth_ok([at_2000, at_22000])            # under the 1.5x ratio all the same
    assert soak.growth_ok([at_2000, soak.Sample(120, 771_000, 15, 22000)])   # the loss list's pace
    short = soak.Sample(120, 830_000, 15, 2060)                # too few steps for a pace: not judged
    assert soak.growth_ok([at_2000, short]) and soak.growth_ok([])
    assert soak.rss_kb_per_step([at_2000, at_2000]) is None
    trace = soak.WorkerTrace()
    for s in (at_10, soak.Sample(120, 760_000, 15, 1990), at_2000, at_22000):
        trace.add(s)
    assert (trace.first, trace.settled, trace.last) == (at_10, at_2000, at_22000)
    assert list(trace.paced.values()) == [at_2000, at_22000]
    outcome = soak.RunOutcome(0, 1.0, 22000, {}, {0: trace}, "")
    [row] = soak.rows_of("shm", 22000, outcome)
    assert (row["rss_kb_per_step"], row["pace_from_step"], row["rss_ratio"], row["pass"]) == (
        "3.00", 2000, "1.19", "NO")
    # Warm-up growth alone (here 70 MB by step 2,000, then flat) is not a pace.
    warm = soak.WorkerTrace()
    for s in (at_10, at_2000, soak.Sample(120, 771_000, 15, 22000)):
        warm.add(s)
    [row] = soak.rows_of("shm", 22000, soak.RunOutcome(0, 1.0, 22000, {}, {0: warm}, ""))
    assert (row["rss_kb_per_step"], row["pass"]) == ("0.05", "yes")


def mb_every_500_steps(rss_mb_at):
    return [soak.Sample(120, round(rss_mb_at(step) * 1024), 15, step)
            for step in range(2000, 20001, 500)]


def test_the_soak_pace_is_a_fit_through_every_sample_not_two_end_points():
    """Modelled on the cross-worker pipeline's driver with validation (2026-12-05): sampled
    by hand, 917 MB at step 2,000, 920 by 4,000, then 920-921 to step 18,000; the suite's two
    end points read 0.48-0.53 KB a step from it. Here 913 at 2,000, 920 by 4,000, flat, and a
    last sample 2 MB high. A leak under the same noise is still caught."""
    warm_up_then_flat = mb_every_500_steps(
        lambda step: 922 if step == 20000 else min(920, 913 + 7 * (step - 2000) / 2000))
    two_points = soak.rss_kb_per_step([warm_up_then_flat[0], warm_up_then_flat[-1]])
    assert two_points > soak.MAX_RSS_KB_PER_STEP
    assert soak.rss_kb_per_step(warm_up_then_flat) < 0.25 and soak.growth_ok(warm_up_then_flat)
    leak = mb_every_500_steps(lambda step: 900 + 0.6 * step / 1024 + (2 if step % 1000 else -2))
    assert 0.55 < soak.rss_kb_per_step(leak) < 0.65 and not soak.growth_ok(leak)


@pytest.mark.slow
def test_the_soak_suite_runs_and_writes_its_table(tmp_path):
    done = run_suite(["--suite=soak", "--collectives=tcp", "--steps=60", "--checkpoint_every=20",
                      "--run_timeout=240"], tmp_path, timeout=300)
    columns, rows = read_csv(tmp_path / "soak.csv")
    assert columns == SOAK_COLUMNS
    assert [(r["collective"], r["worker"], r["steps"], r["exit"]) for r in rows] == [
        ("tcp", "0", "60/60", "0"), ("tcp", "1", "60/60", "0")]
    for row in rows:
        assert int(row["threads_first"]) > 0 and int(row["rss_last_mb"]) > 0
        assert 1 <= int(row["first_sample_step"]) <= int(row["last_sample_step"]) == 60
    assert (tmp_path / "soak.md").read_text() in done.stdout


@pytest.mark.slow
def test_the_chaos_suite_kills_restarts_and_counts(tmp_path):
    done = run_suite(["--suite=chaos", "--kills=2", "--checkpoint_every=10", "--run_timeout=300"],
                     tmp_path, timeout=600)
    columns, rows = read_csv(tmp_path / "chaos.csv")
    assert columns == CHAOS_COLUMNS
    (row,) = rows
    assert row["exit"] == "0" and row["kills_delivered"] == row["restarts_seen"] == "2"
    assert len(row["resumed_at"].split()) == 2 and int(row["examples_checked"]) > 0
    float(row["max_rel_weight_diff"])   # a number: the run finished and was compared
    assert (tmp_path / "chaos.md").read_text() in done.stdout


# --------------------------------------------------------------------------- allreduce: the mpi rows

def test_allreduce_names_map_to_a_collective_and_a_launch():
    from benchmarks import allreduce
    assert allreduce.DEFAULT_COLLECTIVES.split(",") == ["auto", "ring", "tcp", "shm", "mpi",
                                                        "mpi_tcp"]
    launch = allreduce.launch_command("python", 2, "mpi_tcp", "1")
    assert launch[:8] == ["python", "-m", "tfdist.launch", "--workers", "2", "--mpi",
                          "--mpi_args", "--mca pml ob1 --mca btl tcp,self"]
    assert "--collectives=mpi_tcp" in launch and allreduce.VARIANTS["mpi_tcp"][0] == "mpi"
    assert "--mpi" not in allreduce.launch_command("python", 2, "shm", "1")
    with pytest.raises(UsageError, match="Unknown collective 'gloo' in --collectives='tcp,gloo'. "
                                         "Valid choices: auto, ring, nccl, tcp, shm, mpi, mpi_tcp"):
        allreduce.parse_collectives("tcp,gloo", given=True)


@pytest.mark.slow
def test_the_allreduce_suite_times_mpi_over_shared_memory_and_tcp(tmp_path):
    from benchmarks import allreduce
    if allreduce.mpi_missing():
        pytest.skip(f"MPI not installed: {allreduce.mpi_missing()}")
    done = run_suite(["--suite=allreduce", "--collectives=mpi,mpi_tcp", "--sizes_mb=1"],
                     tmp_path, timeout=240)
    columns, rows = read_csv(tmp_path / "allreduce.csv")
    assert columns == ["collective", "replicas", "bytes", "time_ms", "algbw_GBps", "busbw_GBps"]
    assert [(r["collective"], r["replicas"], r["bytes"]) for r in rows] == [
        ("mpi", "2", str(1 << 20)), ("mpi_tcp", "2", str(1 << 20))]
    assert all(float(r["busbw_GBps"]) > 0 for r in rows)
    assert (tmp_path / "allreduce.md").read_text() in done.stdout


def test_paired_refuses_what_it_cannot_compare():
    from benchmarks import paired
    assert paired.parse_contenders("tcp, shm") == ["tcp", "shm"]
    with pytest.raises(UsageError, match="Unknown collective 'gloo' in --contenders='shm,gloo'. "
                                         "Valid names: tf, tcp, shm, mpi"):
        paired.parse_contenders("shm,gloo")
    for text in ("shm", "shm,shm", "tcp,shm,mpi"):
        with pytest.raises(UsageError, match="two different collectives"):
            paired.parse_contenders(text)
    done = subprocess.run([sys.executable, "-m", "benchmarks.paired", "--pairs=0"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--pairs must be >= 1" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "benchmarks.paired", "--workload=tiny"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and ("Unknown --workload='tiny'. Valid: throughput, latency"
                                     in done.stderr), done.stderr


def test_paired_flips_the_order_and_counts_the_pairs_won():
    from benchmarks import paired
    calls = []
    rates = {"shm": iter([100.0, 100.0, 100.0]), "mpi": iter([110.0, 90.0, 105.0])}
    runs = {name: (lambda name=name: calls.append(name) or next(rates[name])) for name in rates}
    rows = paired.run_pairs(runs, 3)
    assert calls == ["shm", "mpi", "mpi", "shm", "shm", "mpi"]
    assert [row["mpi/shm"] for row in rows] == [1.1, 0.9, 1.05]
    total = paired.summary(rows, "shm", "mpi")
    assert total["mpi/shm"] == 1.05 and total["order"] == "mpi at or above shm in 2 of 3 pairs"


@pytest.mark.slow
def test_the_paired_benchmark_runs_both_contenders(tmp_path):
    from benchmarks import allreduce
    contenders = "tcp,shm" if allreduce.mpi_missing() else "shm,mpi"
    a, b = contenders.split(",")
    command = [sys.executable, "-m", "benchmarks.paired", f"--contenders={contenders}",
               "--pairs=1", "--steps=5", "--workload=latency", f"--out_dir={tmp_path}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO))
    assert done.returncode == 0, done.stderr[-3000:]
    columns, rows = read_csv(tmp_path / "paired_latency.csv")   # the default workload's: paired.csv
    assert columns == ["pair", "order", a, b, f"{b}/{a}"]
    assert [row["pair"] for row in rows] == ["1", "median"]
    assert all(float(row[name]) > 0 for row in rows for name in (a, b, f"{b}/{a}"))
