"""The launcher's output: every worker's lines pass through whole, each with its prefix."""

import codecs
import os
import re
import select
import sys
import threading
from typing import Dict, List

LOG_PREFIX = "[tfdist launch] "
HOLD_SECONDS = 0.25          # an unfinished output line waits this long for its end (see pump)
IDLE_READ_SECONDS = 1.0      # a quiet worker pipe is looked at again this often
READ_BYTES = 65536
MAX_HELD_CHARS = 65536       # of a redrawn line that never ends, only its tail is kept

_output_lock = threading.Lock()


def log(message: str) -> None:
    terminal(sys.stderr).write("launch", LOG_PREFIX, message + "\n")


_LINE_PIECES = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


def pieces(text: str) -> List[str]:
    """Splits text after each line end (\n, \r\n) and each \r (a redraw of the line)."""
    return _LINE_PIECES.findall(text)


class Terminal:
    """One of the launcher's output streams, shared by every worker's pipes.

    It knows whose line is open (the text after the last newline), so each new
    line, and each \r redraw (a new line from the terminal's point of view),
    starts with its worker's prefix, and another worker's text never continues
    a line: it first ends the open line with a newline.
    """

    def __init__(self, stream):
        self.stream = stream
        self.owner = None          # who wrote the open line; None right after a newline
        self.redrawing = False     # the owner's line just ended in \r: its next text redraws it

    def write(self, owner, prefix: str, text: str) -> None:
        out = []
        with _output_lock:
            for piece in pieces(text):
                if self.owner not in (None, owner):
                    out.append("\n")
                    self.owner, self.redrawing = None, False
                lone_newline = piece == "\n" and self.redrawing   # "\r" then "\n": the line just ends
                if (self.owner is None or self.redrawing) and not lone_newline:
                    out.append(prefix)
                out.append(piece)
                self.owner = None if piece.endswith("\n") else owner
                self.redrawing = piece.endswith("\r")
            if out:
                self._emit("".join(out))

    def end(self, owner) -> None:
        """`owner` has no more output: end its open line, if any."""
        with _output_lock:
            if self.owner == owner:
                self.owner, self.redrawing = None, False
                self._emit("\n")

    def _emit(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):   # our own stdout closed: keep draining the worker anyway
            pass


_terminals: Dict[int, Terminal] = {}


def terminal(stream) -> Terminal:
    with _output_lock:
        return _terminals.setdefault(id(stream), Terminal(stream))


class FinalTextOnly:
    """What a worker other than the chief shows: each line's final text, not its redraws.

    Keras' progress bar (and tqdm's) redraws its line with \r many times a
    second; from every worker at once they would only fight over the terminal,
    and the chief's bar is the job's. A line without \r passes through as it
    comes; a line with \r is held to its end and shows once, as it finally
    looks (a terminal shows the text after the last \r, or before it on "\r\n").
    The launcher does this, not the training code, so it works for any worker
    command, a user's own `model.fit(verbose=1)` script included.
    """

    def __init__(self):
        self.redrawn = False    # this line had a \r: hold it until it ends
        self.shown = False      # some of this line already went out
        self.frame = ""         # the text since the line's last \r
        self.previous = ""      # the frame before that \r

    def __call__(self, text: str) -> str:
        out = []
        for piece in pieces(text):
            if not self.redrawn and not piece.endswith("\r"):
                out.append(piece)
                self.shown = not piece.endswith("\n")
            elif piece.endswith("\r"):
                self.redrawn, self.previous, self.frame = True, self.frame + piece[:-1], ""
            elif piece.endswith("\n"):
                out.append(self._final(piece.rstrip("\r\n")) + "\n")
            else:
                self.frame = (self.frame + piece)[-MAX_HELD_CHARS:]   # bounded, however long the line
        return "".join(out)

    def flush(self) -> str:
        """The held line at the end of the output (no newline: Terminal.end adds it)."""
        return self._final("") if self.redrawn else ""

    def _final(self, ending: str) -> str:
        text = (self.frame + ending) or self.previous
        shown, self.redrawn, self.shown, self.frame, self.previous = self.shown, False, False, "", ""
        return ("\r" if shown else "") + text


def pump(pipe, out: Terminal, owner, prefix: str, keep=None) -> None:
    """Copies a worker pipe to `out` as it comes, until EOF.

    Reads chunks (os.read), not lines: a \r redraw must not wait for a newline.
    A chunk's last, unfinished line waits up to HOLD_SECONDS for its end, which
    keeps lines whole when several workers print at once (print() writes a text
    and its newline separately); a redraw (the text after a \r) goes out at once.
    The incremental decoder never splits a UTF-8 character across chunks. `keep`
    filters the text (FinalTextOnly).
    """
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    keep = keep or (lambda text: text)
    fd, unfinished, redrawing = pipe.fileno(), "", False
    poller = select.poll()   # not select.select: it fails on descriptors past 1024
    poller.register(fd, select.POLLIN)
    with pipe:
        while True:
            ready = poller.poll(1000 * (HOLD_SECONDS if unfinished else IDLE_READ_SECONDS))
            if not ready or len(unfinished) > READ_BYTES:   # quiet, or a line too long to hold
                out.write(owner, prefix, keep(unfinished))
                unfinished = ""
                continue
            chunk = os.read(fd, READ_BYTES)
            if not chunk:
                break
            text = unfinished + decoder.decode(chunk)
            cut = max(text.rfind("\n"), text.rfind("\r")) + 1
            redrawing = text[cut - 1] == "\r" if cut else redrawing
            if redrawing:   # text after a \r is a redraw (Keras writes "\r" + bar): a terminal shows it now
                cut = len(text)
            out.write(owner, prefix, keep(text[:cut]))
            unfinished = text[cut:]
    rest = keep(unfinished + decoder.decode(b"", final=True))
    flush = getattr(keep, "flush", None)
    out.write(owner, prefix, rest + (flush() if flush else ""))
    out.end(owner)
