"""The architecture's rules, checked on the source itself:

- `api/` never imports `worker/` or torch (the API stays light: no model, no GPU libraries);
- `shared/` (the client and the CLI included) never imports `api/` or `worker/`;
- `worker/` never imports `api/`, and its scheduler holds no tensor (it imports neither torch nor
  a module that does: what runs on the device is the engine core's and the model runner's);
- nothing in the product evaluates, unpickles or torch.loads anything;
- `SystemExit` is raised only by the CLI's entry point.

Imports are read with `ast` from every file, function-level imports included, so a lazy import
cannot slip past; importing the API and the client is also checked for torch in a fresh process.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_IMPORTS = {"api": {"worker", "torch"}, "shared": {"api", "worker"}, "worker": {"api"}}
FORBIDDEN_CALLS = re.compile(r"(^|[^_.a-zA-Z])(eval|exec)\(|\bpickle\b|torch\.load\(|weights_only\s*=\s*False")


def imported_packages(path: Path, package: str) -> set[tuple[str, int]]:
    """(top-level package, line) of every import in a file, relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            name = package if node.level else (node.module or "")
            found.add((name.split(".")[0], node.lineno))
    return found


def violations(root: Path) -> list[str]:
    """Every import that breaks FORBIDDEN_IMPORTS in the tree at `root`."""
    out = []
    for package, banned in FORBIDDEN_IMPORTS.items():
        for path in sorted((root / package).rglob("*.py")):
            for name, line in sorted(imported_packages(path, package)):
                if name in banned:
                    out.append(f"{path.relative_to(root)}:{line} imports {name}")
    return out


def test_no_layer_imports_what_it_must_not():
    assert violations(ROOT) == []


def test_the_scheduler_is_tensor_free():
    """worker/engine/scheduler.py decides and never computes: it imports no tensor library, and the
    worker modules it imports are only named for type checking."""
    imported = {name for name, _ in imported_packages(ROOT / "worker/engine/scheduler.py", "worker")}
    assert imported <= {"__future__", "itertools", "queue", "time", "collections", "dataclasses", "typing", "worker"}
    tree = ast.parse((ROOT / "worker/engine/scheduler.py").read_text())
    runtime = [
        node.module
        for node in tree.body  # module level, outside `if TYPE_CHECKING:`
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("worker")
    ]
    assert runtime == []


def test_the_check_catches_a_forbidden_import(tmp_path):
    for package in FORBIDDEN_IMPORTS:
        (tmp_path / package).mkdir()
    (tmp_path / "api" / "routes.py").write_text("def f():\n    from worker.batch.served import ServedModel\n")
    (tmp_path / "shared" / "client.py").write_text("import api.main\nfrom . import keys\n")
    (tmp_path / "worker" / "runner.py").write_text("import torch\nfrom api import deps\n")
    assert violations(tmp_path) == [
        "api/routes.py:2 imports worker",
        "shared/client.py:1 imports api",
        "worker/runner.py:2 imports api",
    ]


@pytest.mark.parametrize("module", ["api.main", "shared.client", "shared.cli.app"])
def test_importing_the_api_the_client_or_the_cli_loads_no_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def _product_lines():
    for folder in ("api", "worker", "shared"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if not line.lstrip().startswith("#"):
                    yield f"{path.relative_to(ROOT)}:{number}", line


# The one exception, documented as code execution (docs/nnsight.md): the trusted
# nnsight job kind loads the payload that nnsight's client serialized, through nnsight itself.
# Its client helper loads the saves the server sent back, as nnsight's own client does.
CODE_EXECUTION = ("worker/nnsight/jobs.py:", "shared/nnsight_client.py:")


def test_no_eval_exec_pickle_or_torch_load_in_the_product():
    found = [f"{where}: {line.strip()}" for where, line in _product_lines() if FORBIDDEN_CALLS.search(line)]
    assert [line for line in found if not line.startswith(CODE_EXECUTION)] == []


def test_system_exit_only_in_the_cli_entry_point():
    """Only the two programs' entry points exit: `actq` and the worker's engine process."""
    raising = [where for where, line in _product_lines() if re.search(r"\bSystemExit\b|\bsys\.exit\(", line)]
    entry_points = ("shared/cli/__init__.py:", "worker/engine/process.py:")
    assert all(where.startswith(entry_points) for where in raising), raising


EDIT_MODULES = [
    "shared/interventions.py",
    "shared/intervention_check.py",
    "shared/edit_refs.py",
    "shared/vectors.py",
    "api/routes/vectors.py",
    "worker/hooks/edits.py",
]


def test_interventions_look_nothing_up_by_request_text():
    """The modules that handle interventions and vector sets never resolve a name they were given:
    every getattr/setattr/hasattr/delattr names a literal attribute, nothing imports by name, and
    the one submodule lookup (worker/hooks/edits.py) takes paths the engine checked against the model's
    published module list (worker/batch/job_prep.py `_edits`)."""
    import ast

    found = []
    for relative in EDIT_MODULES:
        tree = ast.parse((ROOT / relative).read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name in ("getattr", "setattr", "hasattr", "delattr"):
                if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
                    found.append(f"{relative}:{node.lineno}: {name} with a computed name")
            builtin = isinstance(node.func, ast.Name)  # re.compile and Redis's eval of a fixed script are fine
            if name == "import_module" or (builtin and name in ("__import__", "eval", "exec", "compile")):
                found.append(f"{relative}:{node.lineno}: {name}")
            if name == "get_submodule" and relative != "worker/hooks/edits.py":
                found.append(f"{relative}:{node.lineno}: get_submodule")
    assert found == []
    assert (
        "unknown = [p.module for p in edit_points if p.module not in served.module_paths]"
        in (ROOT / "worker/batch/job_prep.py").read_text()
    )


# The worker's wings, top to bottom (docs/architecture.md): the Celery side (worker/*.py), the engine
# process, trusted nnsight code, results in the store, the running batch, the model and its device
# state, what runs inside its forward passes, and a job's rules that need no model. A module imports
# only from its own wing or the wings below it, type-only imports included.
WINGS = ("", "engine", "nnsight", "results", "batch", "model", "hooks", "rules")
MAX_FLOORS = 8  # the longest chain of imports inside one wing
MAX_LINES = 500


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS) else ""


def worker_imports(root: Path) -> dict[str, list[tuple[str, int, bool]]]:
    """Each worker module's imports of other worker modules: (module, line, under `if TYPE_CHECKING:`)."""
    modules = {_module(p, root): p for p in (root / "worker").rglob("*.py")}
    found: dict[str, list[tuple[str, int, bool]]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typed = {
            inner.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for statement in node.body
            for inner in ast.walk(statement)
            if hasattr(inner, "lineno")
        }
        out = []
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "worker" and node.module:
                base = node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "worker"]
            out += [(t, node.lineno, node.lineno in typed) for t in targets if t in modules and t != name]
        found[name] = out
    return found


def wing_violations(root: Path) -> list[str]:
    """Imports that run up a wing, import cycles (type-only imports aside), wings over MAX_FLOORS."""
    imports = worker_imports(root)
    out = []
    for name, targets in sorted(imports.items()):
        if _wing(name) not in WINGS:
            out.append(f"{name} is in no wing: add it to WINGS (tests/test_layout.py) and docs/architecture.md")
            continue
        for target, line, _ in targets:
            if _wing(target) in WINGS and WINGS.index(_wing(target)) < WINGS.index(_wing(name)):
                out.append(f"{name}:{line} imports {target}, a wing above it")
    runtime = {name: {t for t, _, typed in targets if not typed} for name, targets in imports.items()}
    state: dict[str, int] = {}
    floors: dict[str, int] = {}

    def walk(name: str, stack: list[str]) -> int:
        if state.get(name) == 1:
            out.append("import cycle: " + " -> ".join(stack[stack.index(name) :] + [name]))
            return 0
        if name in floors:
            return floors[name]
        state[name] = 1
        below = [walk(t, [*stack, name]) for t in sorted(runtime[name]) if _wing(t) == _wing(name) and t.count(".") > 1]
        state[name] = 2
        floors[name] = 1 + max(below, default=0)
        return floors[name]

    for name in sorted(runtime):
        walk(name, [])
        if floors[name] > MAX_FLOORS:
            out.append(f"{name} stands {floors[name]} floors high in its wing (at most {MAX_FLOORS})")
    return out


def test_the_worker_s_wings_import_downwards_only_without_cycles():
    assert wing_violations(ROOT) == []


def test_the_wing_check_catches_an_arrow_up_a_cycle_and_a_module_outside_the_wings(tmp_path):
    for folder in ("worker/engine", "worker/model", "worker/tools"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "worker/__init__.py").write_text("")
    (tmp_path / "worker/engine/core.py").write_text("from worker.model import served\n")
    (tmp_path / "worker/model/served.py").write_text("from worker.model.kv import Cache\n")
    (tmp_path / "worker/model/kv.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from worker.model import served\n"
        "if TYPE_CHECKING:\n"
        "    from worker.engine.core import X\n"
    )
    (tmp_path / "worker/tools/x.py").write_text("")
    found = wing_violations(tmp_path)
    assert "worker.model.kv:4 imports worker.engine.core, a wing above it" in found
    assert any(
        line.startswith("import cycle: worker.model.kv -> worker.model.served -> worker.model.kv") for line in found
    )
    assert any(line.startswith("worker.tools.x is in no wing") for line in found)


def test_no_product_file_is_over_500_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for folder in ("api", "worker", "shared")
        for path in (ROOT / folder).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
