"""The manual's examples (README.md, then docs/ in mkdocs.yml's nav order: `pages`), extracted
from the pages themselves and run as a reader would paste them.

A fenced `sh` or `python` block right after a `<!-- run -->` line is an example; a fenced block
right after a `<!-- output -->` line, as the next block after an example, is what that example
prints. Shell examples (of every page, in page order) run in one bash session in order (a
variable such as `ID` set by one is there for the next, as in a terminal), Python examples in one
interpreter in order (as in a REPL), all in one working directory. The only change made to an
example before it runs: the stack's address `localhost:8000` / `127.0.0.1:8000` gets the test
stack's port (and ACTQ_API_URL, which `actq` commands default to http://127.0.0.1:8000, names it
too), and that port reads as 8000 again in what the examples print.

An expected output matches line by line; `…` in it stands for any text (ids, timestamps).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RUN, OUTPUT = "<!-- run -->", "<!-- output -->"
NO_RUN = re.compile(r"<!-- no-run: .+ -->")
ADDRESS = re.compile(r"\b(localhost|127\.0\.0\.1):8000\b")
PORT = 8000


@dataclass
class Example:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    expected: str | None
    path: Path | None = None  # the page it is on


def pages(root: Path) -> list[Path]:
    """The manual's pages in reading order: README.md, then every docs/ page in mkdocs.yml's nav
    (a page's examples may use what an earlier example on the same page set up)."""
    import yaml

    nav = yaml.safe_load((root / "mkdocs.yml").read_text())["nav"]

    def walk(items: list) -> list[str]:
        found: list[str] = []
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            found += walk(value) if isinstance(value, list) else [value]
        return found

    return [root / "README.md"] + [root / "docs" / name for name in walk(nav)]


def where(example: Example, root: Path) -> str:
    """`docs/capture.md line 12`: where a reader finds an example."""
    name = example.path.relative_to(root) if example.path is not None else "README.md"
    return f"{name} line {example.line}"


def _fences(text: str) -> list[tuple[int, str, str, str]]:
    """(line of the opening fence, language, body, the line before the fence) for every block."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, lang = i, lines[i][3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append((start + 1, lang, "\n".join(lines[i + 1 : end]) + "\n", lines[i - 1] if i else ""))
            i = end + 1
        else:
            i += 1
    return blocks


def examples(readme: Path) -> list[Example]:
    blocks = _fences(readme.read_text())
    found: list[Example] = []
    for k, (line, lang, body, before) in enumerate(blocks):
        if before.strip() != RUN:
            continue
        assert lang in ("sh", "python"), f"{readme.name} line {line}: only sh and python examples can run"
        following = blocks[k + 1] if k + 1 < len(blocks) else None
        expected = following[2] if following and following[3].strip() == OUTPUT else None
        found.append(Example(line, lang, body, expected, readme))
    return found


def talks_to_a_stack(lang: str, body: str) -> bool:
    return lang in ("sh", "python") and bool(
        ADDRESS.search(body)
        or "Client(" in body
        or "OpenAI(" in body
        or "actq run-file" in body
        or "load_file(" in body
    )


def unmarked_stack_examples(readme: Path) -> list[int]:
    """Lines of sh/python blocks that talk to a stack but are neither run by the test nor marked
    `<!-- no-run: why -->` (e.g. the block that starts the stack)."""
    return [
        line
        for line, lang, body, before in _fences(readme.read_text())
        if talks_to_a_stack(lang, body) and before.strip() != RUN and not NO_RUN.fullmatch(before.strip())
    ]


def matches(expected: str, actual: str) -> bool:
    want, got = expected.strip("\n").splitlines(), actual.strip("\n").splitlines()
    if len(want) != len(got):
        return False
    for w, g in zip(want, got, strict=True):
        pattern = ".*?".join(re.escape(part) for part in w.rstrip().split("…"))
        if not re.fullmatch(pattern, g.rstrip()):
            return False
    return True


_PYTHON_DRIVER = """
import contextlib, io, json, sys, traceback
namespace = {"__name__": "__main__"}
for line in sys.stdin:
    code, out = json.loads(line), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<README>", "exec"), namespace)
        result = {"ok": True, "stdout": out.getvalue(), "error": ""}
    except BaseException:
        result = {"ok": False, "stdout": out.getvalue(), "error": traceback.format_exc()}
    sys.__stdout__.write(json.dumps(result) + "\\n")
    sys.__stdout__.flush()
"""


def _shell(code: str, cwd: Path, env: dict[str, str], state: Path, timeout: float) -> dict:
    """One shell example in a fresh bash that reads, then saves, the variables examples set (the
    names a bare bash with this environment does not have)."""
    bare = subprocess.run(["bash", "-c", "compgen -v"], env=env, capture_output=True, text=True, check=True)
    known = " ".join(bare.stdout.split())
    script = (
        f"set -eo pipefail\nsource {state}\n{code}\n"
        "for v in $(compgen -v); do "
        f'case " {known} " in *" $v "*) ;; *) declare -p "$v";; esac; done > {state}\n'
    )
    done = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return {"ok": done.returncode == 0, "stdout": done.stdout, "error": done.stderr}


def run_all(found: list[Example], port: int, cwd: Path, env: dict[str, str], timeout: float = 600) -> list[dict]:
    """Run every example in order; returns, per example, `ok`, `stdout` and `error`."""
    env = {**env, "ACTQ_API_URL": f"http://127.0.0.1:{port}"}
    state = cwd / ".readme-shell-state"
    state.write_text("")
    python = subprocess.Popen(
        [sys.executable, "-c", _PYTHON_DRIVER],
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    results: list[dict] = []
    try:
        for example in found:
            started = time.monotonic()
            code = ADDRESS.sub(lambda m: f"{m.group(1)}:{port}", example.code)
            if example.lang == "sh":
                results.append(_shell(code, cwd, env, state, timeout))
            else:
                assert python.stdin is not None and python.stdout is not None
                python.stdin.write(json.dumps(code) + "\n")
                python.stdin.flush()
                answer = python.stdout.readline()
                results.append(json.loads(answer) if answer else {"ok": False, "stdout": "", "error": "Python exited"})
            results[-1]["seconds"] = time.monotonic() - started
        for result in results:  # what the reader sees: the API names itself by the address asked
            result["stdout"] = re.sub(rf"\b(localhost|127\.0\.0\.1):{port}\b", rf"\1:{PORT}", result["stdout"])
    finally:
        python.kill()
        python.communicate()  # reaps it and closes its pipes
    return results
