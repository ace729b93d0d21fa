# Sourced by the batch scripts in this directory (bash): runs the job's srun so that every way
# Slurm stops a job ends in a checkpoint, exit 4 ("preempted") on every task, and, where the
# job should come back, a requeue that resumes from that checkpoint.
#
#   source examples/slurm/preemptible.sh
#   run_preemptible srun ... python -m experiments.train ...
#
# How each stop reaches the tasks (tfdist saves on SIGTERM at the next step boundary, all
# workers at the same step, and exits 4):
# - `scancel --signal=TERM JOBID`, and the TERM a preemption with GraceTime sends first: the
#   tasks get it directly.
# - `scancel --signal=TERM --batch`, `--full`, and the SIGCONT+SIGTERM with which Slurm ends a
#   job (a cancel, a preemption without GraceTime or once it is over, the time limit): the
#   batch shell gets it (and, when Slurm ends the job, the tasks too). It traps it and
#   forwards it to the job's steps with `scancel --signal=TERM` (the tasks, never srun), then
#   keeps waiting for srun. tfdist takes a repeated SIGTERM as the same request.
# - The time limit: `#SBATCH --signal=B:USR1@SECONDS` sends USR1 to the batch shell, which has
#   the tasks save the same way, then requeues the job (below).
# srun runs in a session of its own: a TERM to the batch shell also goes to its process group,
# and srun answers a TERM by SIGKILLing every task ("srun: forcing job termination"), which
# would cut the save short. Without srun in that group, only the tasks decide when to end.
#
# After srun ends, the job requeues itself (`scontrol requeue`, only for a job submitted with
# --requeue, which the scripts' #SBATCH lines ask for):
# - when Slurm has selected it for preemption (`scontrol show job` has a PreemptTime): Slurm
#   22.05 requeues a preempted job only when it is still running at the end of its GraceTime,
#   so a job whose tasks saved and exited early would end FAILED instead of coming back;
# - when the time limit's USR1 stopped it and the tasks saved (exit 4): the next run goes on
#   from that checkpoint, so a job longer than --time runs to the end in several allocations.
# A stop asked for with scancel (no preemption, no time limit) ends the job with exit 4; resubmit
# the same command, with the same --model_dir, to resume.

TFDIST_EXIT_PREEMPTED=4   # tfdist.errors.EXIT_PREEMPTED
TFDIST_STOP_REASON=""

# Forwards a stop to every step of the job (not to the batch step: srun never gets it).
tfdist_stop_tasks() {
  TFDIST_STOP_REASON="$1"
  [ -n "${SLURM_JOB_ID:-}" ] || return 0   # not under Slurm (e.g. `bash train.sbatch` by hand)
  echo "tfdist batch script: $1: asking the tasks to save and exit (scancel --signal=TERM $SLURM_JOB_ID)" >&2
  # Fails only when Slurm is ending the job itself, and then it signals the tasks too.
  scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true
}
trap 'tfdist_stop_tasks "SIGTERM"' TERM
trap 'tfdist_stop_tasks "time limit (USR1)"' USR1

tfdist_job_field() {   # tfdist_job_field NAME: one field of `scontrol show job`, e.g. PreemptTime
  { scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null || true; } | tr ' ' '\n' | sed -n "s/^$1=//p"
}

tfdist_requeue_if_due() {   # tfdist_requeue_if_due STATUS
  local status="$1" why="" preempt_time
  [ -n "${SLURM_JOB_ID:-}" ] && [ "$(tfdist_job_field Requeue)" = 1 ] || return 0
  # Not RUNNING: Slurm is ending the job itself (cancelled, or preempted and requeued by it).
  [ "$(tfdist_job_field JobState)" = RUNNING ] || return 0
  preempt_time="$(tfdist_job_field PreemptTime)"
  if [ -n "$preempt_time" ] && [ "$preempt_time" != None ]; then
    why="preempted"
  elif [ "$TFDIST_STOP_REASON" = "time limit (USR1)" ] && [ "$status" = "$TFDIST_EXIT_PREEMPTED" ]; then
    why="out of time"
  else
    return 0
  fi
  echo "tfdist batch script: $why (tasks exited $status): requeueing job $SLURM_JOB_ID; it resumes" \
       "from its newest checkpoint when it runs again (restart $((${SLURM_RESTART_COUNT:-0} + 1)))" >&2
  trap - TERM USR1   # the requeue ends this run: nothing is left to forward
  scontrol requeue "$SLURM_JOB_ID" || true
}

# run_preemptible CMD...: runs CMD (the job's srun) in its own session, waits for it through
# any number of signals, requeues when due, and returns CMD's exit status.
run_preemptible() {
  if [ -n "$TFDIST_STOP_REASON" ]; then   # stopped before the tasks started: nothing to save
    tfdist_requeue_if_due "$TFDIST_EXIT_PREEMPTED"
    return "$TFDIST_EXIT_PREEMPTED"
  fi
  setsid "$@" &
  local step=$! status=0
  # `wait` returns early whenever a trapped signal arrives; wait again until srun is gone.
  while kill -0 "$step" 2>/dev/null; do
    wait "$step" || true
  done
  wait "$step" || status=$?   # srun's own exit status (bash keeps it after the process ended)
  tfdist_requeue_if_due "$status"
  return "$status"
}
