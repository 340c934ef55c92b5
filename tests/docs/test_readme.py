"""Every ```python block of README.md and of the docs/*.md pages runs, and prints what its
comments say it prints.

Grouping: the blocks of one ``## `` section of one page run in order in one namespace (a
reader runs a section top to bottom); each section gets a fresh namespace and a fresh working
directory, and ``/tmp/`` in its blocks (code and comments) becomes that directory. The file
name and line numbers of a traceback are the page's (README.md, docs/memory.md, ...).

Where a block runs, chosen by an HTML comment on the line before it:
  (none)                       one subprocess for all of them (8 simulated CPU devices,
                               JAX_PLATFORMS=cpu), so the JAX import is paid once;
  <!-- run: 2 processes -->    every process of a real 2-process jax.distributed job
                               (tests/support/process_group.py, 4 CPU devices each), where
                               jax.distributed.initialize() has been called already, so the
                               block's own call is dropped;
  <!-- run: s3 -->             against moto (tests/support/object_stores.py), in the bucket the
                               object-store page's shell lines create;
  <!-- not run: <why> -->      skipped; NOT_RUN must list it, so nothing is skipped silently.

What is checked besides "it raises nothing": a ``print(...)`` line followed by a comment is
checked against the comment. ``# -> text``: it prints exactly ``text`` (up to two spaces,
after which an explanation may follow; a ``# -> ...`` line of its own right after a print
works too). Otherwise, when the comment starts with a Python literal (``# [2, 3]; steps 0
and 1 deleted``, ``# (8, 4): ...``, ``# True``), the printed value must equal it. The
``console`` examples of the command-line page are re-run on a directory built like the
one it describes, and their output compared (ages and timings aside; a ``...`` line stands
for any lines).
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tokenize

import pytest

from tests.support import process_group

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
# Every page whose blocks run, as paths relative to ROOT: the README, then docs/ in name order.
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
MULTI_PROCESS, S3 = "run: 2 processes", "run: s3"
# Sections of the blocks marked <!-- not run: ... -->, in page order (all in the README).
NOT_RUN: list[str] = ["Running on Cloud TPU", "Running on Cloud TPU"]
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}


@dataclasses.dataclass(frozen=True)
class Block:
    section: str  # the ``## `` heading it is under
    line: int  # the page's line number of its first line of code
    code: str
    marker: str  # the HTML comment on the line before it, without <!-- -->; "" if none
    page: str = "README.md"  # relative to ROOT

    @property
    def group(self) -> str:
        """The section's name in reports: the heading, after the page's name outside the README."""
        return self.section if self.page == "README.md" else f"{self.page}: {self.section}"


def readme_blocks(language: str) -> list[Block]:
    return page_blocks("README.md", language)


def doc_blocks(language: str) -> list[Block]:
    """The blocks of every page, README first."""
    return [block for page in PAGES for block in page_blocks(page, language)]


def page_blocks(page: str, language: str) -> list[Block]:
    with open(os.path.join(ROOT, page)) as f:
        lines = f.read().splitlines()
    blocks, section, i = [], "", 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        if not lines[i].startswith("```"):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if lines[i][3:].strip() == language:
            above = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
            marker = re.fullmatch(r"<!--\s*(.*?)\s*-->", above)
            code = "\n".join(lines[i + 1 : end])
            blocks.append(Block(section, i + 2, code, marker.group(1) if marker else "", page))
        i = end + 1
    return blocks


# Defines the checked print; sits on the first lines of every assembled script, above the
# first block (the page's line numbers are kept).
PRELUDE = """\
def _readme_print(*values, _expect):
    print(*values, flush=True)
    kind, want = _expect
    got = " ".join(map(str, values)) if kind == "text" else values[0] if len(values) == 1 else values
    same = got == want
    same = same if isinstance(same, bool) else bool(getattr(same, "all", lambda: same)())
    assert same, f"the page says this prints {want!r}, but it printed {got!r}"
"""


def _expectation(comment: str) -> tuple[str, object] | None:
    """What a print's comment says it prints, or None when the comment is only prose."""
    text = comment.lstrip("#").strip()
    if text.startswith("->"):
        return "text", re.split(r"\s{2,}", text[2:].strip())[0]
    words = text.split()
    for candidate in (text.split(";")[0], text.split(":")[0], re.split(r"\s{2,}", text)[0], words[0] if words else ""):
        try:
            return "value", ast.literal_eval(candidate.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return None


def transform(code: str, workdir: str, *, multi_process: bool = False) -> tuple[str, int]:
    """The block as it runs (same number of lines), and how many of its prints are checked."""
    code = code.replace("/tmp/", workdir.rstrip("/") + "/")
    if multi_process:
        code = code.replace("jax.distributed.initialize()", "pass  # done by tests/support/mp_worker.py")
    lines = code.split("\n")
    comments = {
        tok.start[0] - 1: (tok.start[1], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(code).readline)
        if tok.type == tokenize.COMMENT
    }
    checked = 0
    for row, line in enumerate(lines):
        statement = line.strip()
        if not statement.startswith("print("):
            continue
        if row in comments:
            col, comment = comments[row]
            statement = line[:col].strip()
        elif (
            row + 1 in comments and not lines[row + 1][: comments[row + 1][0]].strip()
            and "->" in comments[row + 1][1][:4]
        ):
            comment = comments[row + 1][1]  # "# -> ..." alone on the next line
        else:
            continue
        expect = _expectation(comment)
        if expect is None or not statement.endswith(")"):
            continue
        indent = line[: len(line) - len(line.lstrip())]
        lines[row] = f"{indent}_readme_print({statement[len('print('):-1]}, _expect={expect!r})"
        checked += 1
    return "\n".join(lines), checked


def assemble(blocks: list[Block], workdir: str, *, multi_process: bool = False) -> tuple[str, int]:
    """One script running ``blocks`` (all of one page) in order, each at its page's line numbers."""
    out, checked = PRELUDE.split("\n"), 0
    assert len({block.page for block in blocks}) <= 1, "one script runs the blocks of one page"
    for block in blocks:
        code, n = transform(block.code, workdir, multi_process=multi_process)
        assert len(out) < block.line, f"{block.page}:{block.line}: too close to the block above"
        out += [""] * (block.line - 1 - len(out)) + code.split("\n")
        checked += n
    return "\n".join(out) + "\n", checked


# Runs sections (title, working directory, assembled source) in one process; reports each.
RUNNER = r"""
import json, linecache, os, sys, traceback
with open(sys.argv[1]) as f:
    sections = json.load(f)
results = []
for s in sections:
    os.makedirs(s["dir"], exist_ok=True)
    os.chdir(s["dir"])
    linecache.cache[s["file"]] = (len(s["source"]), None, s["source"].splitlines(True), s["file"])
    print(f"=== {s['title']}", flush=True)
    try:
        exec(compile(s["source"], s["file"], "exec"), {"__name__": "__main__"})
        from tpu_ckpt.saving import WRITER
        WRITER.settle()  # an async save left in flight must have succeeded too
        results.append([s["title"], None])
    except BaseException:
        results.append([s["title"], traceback.format_exc()])
print("RESULTS " + json.dumps(results), flush=True)
"""


def run_sections(tmp_path, groups: dict[str, list[Block]], env: dict[str, str]) -> int:
    """Runs each section's blocks (see the module docstring); returns the prints checked."""
    spec, checked = [], 0
    for number, (title, blocks) in enumerate(groups.items()):
        workdir = str(tmp_path / f"section{number:02d}")
        source, n = assemble(blocks, workdir)
        spec.append({"title": title, "dir": workdir, "source": source, "file": blocks[0].page})
        checked += n
    spec_file = tmp_path / "sections.json"
    spec_file.write_text(json.dumps(spec))
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, str(spec_file)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("RESULTS ")), None)
    assert out.returncode == 0 and line is not None, out.stdout[-6000:] + out.stderr[-6000:]
    results = json.loads(line[len("RESULTS ") :])
    failures = [f"## {title}\n{error}" for title, error in results if error]
    assert not failures, (
        "\n".join(failures) + "\n--- stdout:\n" + out.stdout[-4000:] + "\n--- stderr:\n" + out.stderr[-4000:]
    )
    assert [title for title, _ in results] == list(groups)
    return checked


def by_section(blocks: list[Block]) -> dict[str, list[Block]]:
    """Blocks grouped by section, in order: a README section under its heading, another page's
    as ``docs/page.md: heading``."""
    groups: dict[str, list[Block]] = {}
    for block in blocks:
        groups.setdefault(block.group, []).append(block)
    return groups


def by_page(blocks: list[Block]) -> dict[str, list[Block]]:
    pages: dict[str, list[Block]] = {}
    for block in blocks:
        pages.setdefault(block.page, []).append(block)
    return pages


def test_every_python_block_is_run_or_listed_as_not_run():
    blocks = doc_blocks("python")
    unknown = [b for b in blocks if b.marker not in ("", MULTI_PROCESS, S3) and not b.marker.startswith("not run:")]
    assert not unknown, f"unknown markers: {[(b.line, b.marker) for b in unknown]}"
    assert [b.section for b in blocks if b.marker.startswith("not run:")] == NOT_RUN
    assert len([b for b in blocks if not b.marker]) > 15
    assert [b for b in blocks if b.marker == MULTI_PROCESS] and [b for b in blocks if b.marker == S3]
    # The print checks are really in place (a change to the comment syntax would drop them).
    assert sum(transform(b.code, "/x")[1] for b in blocks) >= 40


def test_readme_python_blocks_run(tmp_path):
    """The README's blocks and those of every docs page, in one subprocess (JAX imported once)."""
    blocks = [b for b in doc_blocks("python") if not b.marker]
    assert {b.page for b in blocks} > {"README.md"}
    checked = run_sections(tmp_path, by_section(blocks), {**os.environ, **ENV})
    assert checked >= 30


MULTI_PROCESS_PAGES = sorted(by_page([b for b in doc_blocks("python") if b.marker == MULTI_PROCESS]))


@pytest.mark.parametrize("page", MULTI_PROCESS_PAGES)
def test_readme_multi_host_blocks_run_in_two_processes(tmp_path, page):
    blocks = by_page([b for b in doc_blocks("python") if b.marker == MULTI_PROCESS])[page]
    shared = tmp_path / "shared"  # both processes' /tmp/: shared storage, as GCS would be
    shared.mkdir()
    source, checked = assemble(blocks, str(shared), multi_process=True)
    assert checked >= 3
    script = tmp_path / f"{os.path.basename(page)}.py"
    script.write_text(source)
    results = process_group.run("exec_file", 2, str(shared), str(script), timeout=180)
    for r in results:
        assert r.returncode == 0 and r.result is not None and r.result["ok"], r.output


@pytest.mark.emulator
def test_readme_object_store_blocks_run_against_moto(tmp_path, s3_server):
    try:
        s3_server.create_bucket("ckpts")  # what the object-store page's shell lines do
    except Exception as e:  # noqa: BLE001 - only an existing bucket is fine
        if "BucketAlready" not in str(e):
            raise
    blocks = [b for b in doc_blocks("python") if b.marker == S3]
    # os.environ holds the fixture's AWS_ENDPOINT_URL and credentials.
    assert run_sections(tmp_path, by_section(blocks), {**os.environ, **ENV}) >= 2


# Builds the directory the command-line page shows: a CheckpointManager's steps 100 and
# 200 of a small Adam state, and the staging directory of a save of step 300 killed before
# its commit (its data files, no manifest). Then runs the commands and reports their output.
CLI_EXAMPLE = r"""
import contextlib, io, json, os, shutil, sys
import jax, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import tpu_ckpt as tc
from tpu_ckpt import cli

directory, commands = sys.argv[1], json.loads(sys.argv[2])
mesh = jax.make_mesh((4, 2), ("data", "model"))
put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
params = {"w": put(np.random.default_rng(0).normal(size=(512, 256)).astype(np.float32), P("data", "model")),
          "b": put(np.zeros(256, np.float32), P("model"))}
tx = optax.adam(1e-3)
with tc.CheckpointManager(directory) as manager:
    for step in (100, 200):
        manager.save(step, {"params": params, "opt_state": tx.init(params), "step": step})
        params = jax.tree.map(lambda x: x + 1, params)
shutil.copytree(os.path.join(directory, "step_200"), os.path.join(directory, "step_300.tmp-3f9a1c2b7d4e"),
                ignore=shutil.ignore_patterns("manifest.json"))
outputs = []
for argv in commands:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(argv)
    outputs.append([status, out.getvalue()])
print("OUTPUTS " + json.dumps(outputs))
"""


def _normalize(line: str) -> str:
    line = re.sub(r"checked in \d+(\.\d+)?s", "checked in <time>", line.rstrip())
    line = re.sub(r"\s+\d+[smhd]$", " <age>", line)  # ls's AGE column
    return " ".join(line.split())


def _matches(expected: list[str], actual: list[str]) -> bool:
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(_matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and _matches(expected[1:], actual[1:])


def test_readme_command_line_examples_print_what_they_show(tmp_path):
    examples: list[tuple[list[str], list[str]]] = []
    for block in doc_blocks("console"):
        for line in block.code.split("\n"):
            if line.startswith("$ "):
                examples.append((shlex.split(line[2:], comments=True), []))
            else:
                examples[-1][1].append(line)
    assert [words[:2] for words, _ in examples] == [
        ["tpu-ckpt", "ls"], ["tpu-ckpt", "inspect"], ["tpu-ckpt", "verify"], ["tpu-ckpt", "diff"], ["tpu-ckpt", "gc"],
    ]
    here = f"{tmp_path}/"
    commands = [[word.replace("/tmp/", here) for word in words[1:]] for words, _ in examples]
    out = subprocess.run(
        [sys.executable, "-c", CLI_EXAMPLE, str(tmp_path / "run"), json.dumps(commands)],
        env={**os.environ, **ENV}, capture_output=True, text=True, timeout=120,
    )
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("OUTPUTS ")), None)
    assert out.returncode == 0 and line is not None, out.stdout[-4000:] + out.stderr[-4000:]
    for (words, shown), (status, printed) in zip(examples, json.loads(line[len("OUTPUTS ") :])):
        assert status == (1 if words[1] == "diff" else 0), (words, status, printed)
        expected = [_normalize(x) for x in shown]
        actual = [_normalize(x) for x in printed.replace(here, "/tmp/").splitlines()]
        while expected and not expected[-1]:
            expected.pop()
        assert _matches(expected, actual), (
            f"$ {' '.join(words)}\nthe page shows:\n" + "\n".join(shown) + "\nit prints:\n" + printed
        )
