"""Progress on long runs: a live bar on a terminal, plain log lines otherwise."""

import logging
import sys
import time

log = logging.getLogger("tfdist")


class Progress:
    """Reports step, loss and examples/sec; quiet unless this process is the chief."""

    def __init__(self, total_steps: int, global_batch_size: int, log_every: int,
                 enabled: bool = True, stream=None):
        self.total_steps = total_steps
        self.global_batch_size = global_batch_size
        self.log_every = log_every
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_time = time.perf_counter()
        self._last_step = 0

    def _rate(self, step: int) -> float:
        now = time.perf_counter()
        rate = (step - self._last_step) * self.global_batch_size / max(now - self._last_time, 1e-9)
        self._last_time, self._last_step = now, step
        return rate

    def update(self, step: int, loss: float) -> None:
        due = step % self.log_every == 0 or step == self.total_steps
        if not self.enabled or not (due or self.is_tty):
            return
        if self.is_tty:
            self._draw_bar(step, loss)
        elif due:
            log.info("step %d/%d  loss %.4f  %.0f examples/s",
                     step, self.total_steps, loss, self._rate(step))

    def _draw_bar(self, step: int, loss: float) -> None:
        if step % max(1, min(self.log_every, 10)) and step != self.total_steps:
            return
        width = 30
        filled = width * step // self.total_steps
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r[{bar}] {step}/{self.total_steps}  loss {loss:.4f}  "
                          f"{self._rate(step):.0f} ex/s ")
        if step == self.total_steps:
            self.stream.write("\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            if self.is_tty:
                self.stream.write("\n")
            log.info(text)


def configure_logging(level=logging.INFO) -> None:
    """tfdist's own lines on stderr; TensorFlow's and tfds' chatter only from WARNING up."""
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    if not log.handlers:
        _attach_handler()
    log.setLevel(level)


def ensure_logging() -> None:
    """Makes `tfdist.run` from Python show its progress although the caller set up no
    logging (Python would drop INFO lines then). A caller who configured the "tfdist"
    logger or the root logger keeps exactly that: nothing added, no line twice."""
    if log.handlers or logging.getLogger().handlers:
        return
    _attach_handler()
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def _attach_handler() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("tfdist %(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.propagate = False   # a root handler the caller adds later must not print it again
