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
    """worker/scheduler.py decides and never computes: it imports no tensor library, and the
    worker modules it imports are only named for type checking."""
    imported = {name for name, _ in imported_packages(ROOT / "worker/scheduler.py", "worker")}
    assert imported <= {"__future__", "itertools", "queue", "time", "collections", "dataclasses", "typing", "worker"}
    tree = ast.parse((ROOT / "worker/scheduler.py").read_text())
    runtime = [
        node.module
        for node in tree.body  # module level, outside `if TYPE_CHECKING:`
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("worker")
    ]
    assert runtime == []


def test_the_check_catches_a_forbidden_import(tmp_path):
    for package in FORBIDDEN_IMPORTS:
        (tmp_path / package).mkdir()
    (tmp_path / "api" / "routes.py").write_text("def f():\n    from worker.served_model import ServedModel\n")
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
CODE_EXECUTION = ("worker/nnsight_jobs.py:", "shared/nnsight_client.py:")


def test_no_eval_exec_pickle_or_torch_load_in_the_product():
    found = [f"{where}: {line.strip()}" for where, line in _product_lines() if FORBIDDEN_CALLS.search(line)]
    assert [line for line in found if not line.startswith(CODE_EXECUTION)] == []


def test_system_exit_only_in_the_cli_entry_point():
    """Only the two programs' entry points exit: `actq` and the worker's engine process."""
    raising = [where for where, line in _product_lines() if re.search(r"\bSystemExit\b|\bsys\.exit\(", line)]
    entry_points = ("shared/cli/__init__.py:", "worker/engine_process.py:")
    assert all(where.startswith(entry_points) for where in raising), raising


EDIT_MODULES = [
    "shared/interventions.py",
    "shared/intervention_check.py",
    "shared/edit_refs.py",
    "shared/vectors.py",
    "api/routes/vectors.py",
    "worker/edits.py",
]


def test_interventions_look_nothing_up_by_request_text():
    """The modules that handle interventions and vector sets never resolve a name they were given:
    every getattr/setattr/hasattr/delattr names a literal attribute, nothing imports by name, and
    the one submodule lookup (worker/edits.py) takes paths the engine checked against the model's
    published module list (worker/job_prep.py `_edits`)."""
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
            if name == "get_submodule" and relative != "worker/edits.py":
                found.append(f"{relative}:{node.lineno}: get_submodule")
    assert found == []
    assert (
        "unknown = [p.module for p in edit_points if p.module not in served.module_paths]"
        in (ROOT / "worker/job_prep.py").read_text()
    )
