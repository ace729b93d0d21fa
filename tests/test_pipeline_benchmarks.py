"""The pipeline benchmark suites (pipeline_overlap, torch_pipeline) at a tiny size, so they
cannot rot: every row has the suite's columns and every number in it is positive. Speed
is the suites' job, not this test's.

Each suite runs one schedule only (1f1b here, gpipe in the other), which still reaches every
runner: one process, a 2-worker pipeline launch, a 2-worker DTensor launch, and PyTorch's
pipeline and tensor parallel scripts (skipped without torch). About 50 s here.
"""

import importlib.util

import pytest

from benchmarks import pipeline_overlap, torch_pipeline

pytestmark = pytest.mark.slow

TINY = dict(steps=3, trials=1, input_dim=16, hidden=(16, 16, 16, 16), batch=32, microbatches=4)
OVERLAP_KEYS = ["contender", "processes", "examples_per_sec_median", "trials", "speedup",
                "formula", "ratio_to_formula", "overlap_speedup", "overlap_ratio_to_formula",
                "ratio_to_ceiling"]
TORCH_KEYS = ["benchmark", "contender", "examples_per_sec_median", "trials",
              "tfdist_over_pytorch"]
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _numbers(row, keys):
    for key in keys:
        for word in str(row[key]).split():
            yield key, float(word)


def test_formulas():
    assert pipeline_overlap.formula("gpipe", 2, 8) == pytest.approx(16 / 9)
    assert pipeline_overlap.formula("1f1b", 4, 8) == pytest.approx(32 / 11)
    assert pipeline_overlap.formula("interleaved_1f1b", 2, 8) == pytest.approx(32 / 17)
    assert pipeline_overlap.formula("zero_bubble", 2, 8) == pytest.approx(48 / 25)
    assert pipeline_overlap.formula(None, 2, 8) == 1.0
    assert pipeline_overlap.formula(pipeline_overlap.INDEPENDENT, 2, 8) == 2.0


def test_rows_from_trials():
    rates = {pipeline_overlap.BASELINE: [100.0, 90.0, 110.0],
             pipeline_overlap.CEILING: [190.0],
             pipeline_overlap.SERIAL_PIPELINE: [80.0],
             "tfdist gpipe, 2 worker processes": [150.0, 170.0, 160.0]}
    meta = {pipeline_overlap.BASELINE: (None, 1),
            pipeline_overlap.CEILING: (pipeline_overlap.INDEPENDENT, 2),
            pipeline_overlap.SERIAL_PIPELINE: (None, 1),
            "tfdist gpipe, 2 worker processes": ("gpipe", 2)}
    rows = pipeline_overlap.rows_from(rates, meta, microbatches=8)
    assert [list(row) for row in rows] == [OVERLAP_KEYS] * 4
    ceiling, pipeline = rows[1], rows[3]
    assert ceiling["speedup"] == 1.9 and ceiling["formula"] == 2.0
    assert ceiling["ratio_to_formula"] == 0.95 and ceiling["overlap_speedup"] == ""
    assert ceiling["ratio_to_ceiling"] == ""
    assert pipeline["speedup"] == 1.6 and pipeline["formula"] == round(16 / 9, 3)
    assert pipeline["ratio_to_formula"] == round(1.6 / (16 / 9), 3)
    # the formula on cores that together give 1.9x: 16/9 * 0.95
    assert pipeline["ratio_to_ceiling"] == round(1.6 / (16 / 9) / 0.95, 3)
    assert pipeline["overlap_speedup"] == 2.0 and pipeline["trials"] == "150.0 170.0 160.0"
    assert rows[0]["overlap_speedup"] == "" and rows[0]["ratio_to_ceiling"] == ""


def test_pipeline_overlap_tiny(tmp_path):
    rows, notes = pipeline_overlap.compare(schedules=("1f1b",), in_process=False, **TINY)
    assert [row["contender"] for row in rows] == ["tfdist 1 process", pipeline_overlap.CEILING,
                                                  "tfdist 1f1b, 2 worker processes"], notes
    for row in rows:
        assert list(row) == OVERLAP_KEYS
        for key, value in _numbers(row, OVERLAP_KEYS[1:]):
            assert value > 0, (key, row)
    assert rows[2]["ratio_to_ceiling"] != "" and rows[1]["ratio_to_ceiling"] == ""
    text = pipeline_overlap.write(rows, notes, str(tmp_path), "pipeline_overlap", "tiny")
    assert "| contender |" in text and (tmp_path / "pipeline_overlap.csv").exists()


def test_torch_pipeline_tiny(tmp_path):
    rows, notes = torch_pipeline.compare(tp=(16, 64, 8), schedules=("gpipe",), **TINY)
    names = [row["contender"] for row in rows]
    expected = ["tfdist gpipe, 2 worker processes",
                "tfdist dtensor megatron, mesh batch=1,model=2, 2 processes"]
    if HAVE_TORCH:
        expected.insert(1, "pytorch ScheduleGPipe, 2 processes (gloo)")
        expected.append("pytorch ColwiseParallel + RowwiseParallel, 2 processes (gloo)")
    else:
        assert any("pip install torch" in note for note in notes)
    assert names == expected, notes
    for row in rows:
        assert list(row) == TORCH_KEYS
        tfdist_row = row["contender"].startswith("tfdist")
        keys = TORCH_KEYS[2:] if tfdist_row and HAVE_TORCH else TORCH_KEYS[2:4]
        for key, value in _numbers(row, keys):
            assert value > 0, (key, row)
    torch_pipeline.overlap.write(rows, notes, str(tmp_path), "torch_pipeline", "tiny")
    assert (tmp_path / "torch_pipeline.md").exists()
    if not HAVE_TORCH:
        pytest.skip("torch not installed: pip install torch (PyTorch rows not checked)")


def test_pinned_processes_take_the_cores_by_rank():
    from benchmarks import pinned
    assert [pinned.core_for(rank, {0, 1}) for rank in range(4)] == [0, 1, 0, 1]
    assert pinned.core_for(1, {6, 4}) == 6   # the cores this process may use, in order


def test_a_failing_ceiling_run_is_reported_not_summed():
    with pytest.raises(pipeline_overlap.ContenderFailed, match=r"2 independent processes: exit 2"):
        pipeline_overlap.independent_rate(2, 2, ["--model=no_such_model"], timeout=120)


def phase_work(input_dim, hidden):
    """Per stage of the 2-stage cut tfdist makes (the planner's, TF-free): (forward, backward)
    matrix-product work in parameters. Every layer's backward computes its weight gradient
    and its input gradient, except the model's first layer, which has no input gradient."""
    from tfdist.plan import command, memory
    flags = [flag for flag in pipeline_overlap.mlp_flags(input_dim, hidden, 64)
             if flag.startswith(("--model", "--hidden_sizes", "--dataset", "--synthetic_shape"))]
    _, work, _ = command.parse(["--devices=2", "--memory_per_device=8GiB",
                                "--device_type=cpu", *flags])
    stages = memory.pipeline_stages(work.inventory, 2)
    first = next(layer.params for layer in stages[0] if layer.params)
    work_of = []
    for k, layers in enumerate(stages):
        forward = sum(layer.params for layer in layers)
        work_of.append((forward, 2 * forward - (first if k == 0 else 0)))
    return work_of


def test_the_default_model_cuts_into_stages_balanced_in_both_phases():
    """gpipe runs each phase at its slowest stage's pace, so the suite's model must be
    balanced in forward and backward work separately (the module docstring says why)."""
    (forward_0, backward_0), (forward_1, backward_1) = phase_work(
        pipeline_overlap.DEFAULT_INPUT, pipeline_overlap.DEFAULT_HIDDEN)
    assert forward_0 / forward_1 == pytest.approx(1.0, abs=0.05)
    assert backward_0 / backward_1 == pytest.approx(1.0, abs=0.05)
    # The former default, 2048-2048x4-10: stage 1 has 4/3 of stage 0's backward work.
    (_, backward_0), (_, backward_1) = phase_work(2048, (2048,) * 4)
    assert backward_1 / backward_0 == pytest.approx(4 / 3, rel=0.01)


def test_the_load_note_reports_the_hypervisor_steal_of_the_run():
    before = [100, 0, 50, 800, 0, 0, 0, 50, 0, 0]
    after = [700, 0, 150, 900, 0, 0, 0, 250, 0, 0]   # 1000 ticks spent, 200 of them stolen
    note = pipeline_overlap.load_note((1.0, 1.0, 1.0), (2.0, 2.0, 2.0), before, after)
    assert note.endswith("; hypervisor steal 20.0% of CPU time")
    assert "steal" not in pipeline_overlap.load_note((1.0,) * 3, (2.0,) * 3)   # no /proc/stat
    ticks = pipeline_overlap.cpu_ticks()   # this machine's real counters, where it has them
    assert ticks is None or (len(ticks) >= 8 and all(t >= 0 for t in ticks))


def test_the_cli_can_leave_out_the_ceiling_and_in_process_rows():
    args = pipeline_overlap.parse_args(["--schedules", "gpipe,1f1b", "--no_ceiling",
                                        "--no_in_process", "--out_dir", "/tmp/x"])
    assert (args.ceiling, args.in_process, args.out_dir) == (False, False, "/tmp/x")
    defaults = pipeline_overlap.parse_args([])
    assert defaults.ceiling and defaults.in_process
