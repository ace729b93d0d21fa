"""Every fenced code example of README.md and docs/**/*.md runs, as written.

A ```python block runs in a fresh `python -c` process, a ```bash (```shell, ```sh) block
under `bash -e`, both with the repository root as the working directory and the
environment of a fresh shell (no cluster variables of the test run). Output-only blocks
(```text, ```console) are not examples. An example that cannot run here as written (it
needs a cluster, Slurm, GPUs, or is the whole suite) carries, on the line before its
fence,

    <!-- example: skip because <reason> -->

and is reported as a skipped test with that reason. Each test is named by file:line, so a
failure names the example.
"""

import os
import pathlib
import re
import subprocess
import sys
from typing import List, NamedTuple, Optional

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
RUNNABLE = {"python": "python", "bash": "bash", "shell": "bash", "sh": "bash"}
OUTPUT_ONLY = {"text", "console", "yaml", "json", "ini", "toml"}
SKIP_MARKER = re.compile(r"^<!--\s*example:\s*skip because (?P<reason>.+?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
TIMEOUT_SECONDS = 600
# TensorFlow's C++ log lines (absl's format) and its GPU probing: none in an example's output.
TENSORFLOW_LOG_LINE = re.compile(r"(^|\] )[IWE]\d{4} [\d:.]+ +\d+ \S+\.cc:\d+\]|cuInit|cudart|"
                                 r"absl::InitializeLog")
# Variables of a cluster, a scheduler or this test run, which a user's fresh shell lacks.
CLEARED_ENV = re.compile(r"^(TF_CONFIG|TFDIST_.*|DTENSOR_.*|SLURM_.*|OMPI_.*|PMIX_.*|PRTE_.*|"
                         r"KERAS_DISTRIBUTION_.*|PYTEST_.*|TF_CPP_MIN_LOG_LEVEL)$")


class Block(NamedTuple):
    path: str            # relative to the repository root
    line: int            # 1-based line of the opening fence
    language: str        # the fence's first word, "" if none
    code: str
    skip: Optional[str]  # the marker's reason


def doc_files() -> List[pathlib.Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def fenced_blocks(path: pathlib.Path) -> List[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening.group("fence"), len(opening.group("indent"))
        info = opening.group("info").strip()
        language = info.split()[0].lower() if info else ""
        end = i + 1
        while end < len(lines) and not re.match(rf"^ {{0,{indent + 3}}}{fence[0]}{{{len(fence)},}}\s*$",
                                                lines[end]):
            end += 1
        code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
        marker = SKIP_MARKER.match(lines[i - 1].strip()) if i > 0 else None
        blocks.append(Block(str(path.relative_to(REPO)), i + 1, language, code,
                            marker.group("reason") if marker else None))
        i = end + 1
    return blocks


ALL_BLOCKS = [block for path in doc_files() for block in fenced_blocks(path)]
EXAMPLES = [block for block in ALL_BLOCKS if block.language in RUNNABLE]


def example_id(block: Block) -> str:
    return f"{block.path}:{block.line}"


def fresh_shell_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not CLEARED_ENV.match(k)}
    # `python` and `tfdist` are this interpreter's (the venv's), as in an activated shell.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.mark.parametrize("block", EXAMPLES, ids=example_id)
def test_example_runs_as_written(block):
    if block.skip:
        pytest.skip(f"docs example, not run: {block.skip}")
    if RUNNABLE[block.language] == "python":
        command = [sys.executable, "-c", block.code]
    else:
        command = ["bash", "-e", "-c", block.code]
    done = subprocess.run(command, cwd=REPO, env=fresh_shell_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_SECONDS)
    assert done.returncode == 0, (
        f"{example_id(block)} ({block.language}) exited {done.returncode}\n"
        f"--- stdout (end)\n{done.stdout[-3000:]}\n--- stderr (end)\n{done.stderr[-5000:]}")
    if "TFDIST_TF_LOGS" not in block.code:   # a quiet start (tfdist.quiet), what users see
        noise = [line for line in done.stderr.splitlines() if TENSORFLOW_LOG_LINE.search(line)]
        assert noise == [], f"{example_id(block)} printed TensorFlow's log lines: {noise[:5]}"


def test_the_docs_have_examples_and_every_block_says_what_it_is():
    """A block without a language would be neither run nor declared output; a skip marker
    must stand right before a runnable block, or it skips nothing."""
    assert len(EXAMPLES) >= 15, [example_id(b) for b in EXAMPLES]
    untagged = [example_id(b) for b in ALL_BLOCKS
                if b.language not in RUNNABLE and b.language not in OUTPUT_ONLY]
    assert not untagged, f"fenced blocks without a known language: {untagged}"
    blocks_at = {(b.path, b.line) for b in EXAMPLES}
    stray = []
    for path in doc_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "example:" in line and line.strip().startswith("<!--"):
                if not SKIP_MARKER.match(line.strip()):
                    stray.append(f"{path.relative_to(REPO)}:{number} (malformed)")
                elif (str(path.relative_to(REPO)), number + 1) not in blocks_at:
                    stray.append(f"{path.relative_to(REPO)}:{number} (no example after it)")
    assert not stray, stray
