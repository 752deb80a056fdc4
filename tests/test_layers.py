"""The packages depend in one direction, checked in a fresh interpreter per package.

protocols loads neither trio nor torch (nor ninfer, nor scheduler); scheduler loads no
torch (nor ninfer, nor protocols); `ninfer.app` and the client tools load no torch;
no module of `ninfer.engine` loads trio; outside `ninfer/engine/` only the bridge
names a module of the engine's torch side; no engine module imports a server module;
outside `ninfer/frontends/` no module names a frontend's private module; and no module
imports itself or a module that imports it (at any depth of the file: a function's
import counts). The checker is run once on a copy of the tree with violations planted
in it, to show that it fails when it should.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
ENGINE_MODULES = sorted(
    f"ninfer.engine.{p.stem}" for p in (ROOT / "ninfer" / "engine").glob("_*.py")
)

# modules imported together in one fresh interpreter -> what they must not load
# (a package, or every module under it). Together is enough: if the group loads none of
# them, no member does.
RULES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("protocols",): ("trio", "torch", "hypercorn", "ninfer", "scheduler"),
    ("scheduler",): ("torch", "hypercorn", "ninfer", "protocols"),
    ("ninfer.engine",): ("torch", "trio"),
    ("ninfer.app",): ("torch",),
    ("ninfer._cli", "ninfer.tools._probes", "ninfer.tools._logs"): ("torch", "trio"),
    ("ninfer.tools._bench",): ("torch",),
    tuple(ENGINE_MODULES): ("trio", "hypercorn", "scheduler", "protocols"),
}

_PROBE = """
import importlib, sys, orjson
for name in sys.argv[1:]:
    importlib.import_module(name)
sys.stdout.buffer.write(orjson.dumps(sorted(sys.modules)))
"""


def _loaded_by(modules: tuple[str, ...], root: Path) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        check=True,
        timeout=600,
    )
    loaded: list[str] = orjson.loads(out.stdout)
    return loaded


def _bridge_violations(root: Path) -> list[str]:
    """Server modules (outside ninfer/engine/) that name an engine module other than the
    contract: only ninfer/_bridge.py may."""
    found = []
    for path in sorted((root / "ninfer").rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[:2] == ("ninfer", "engine") or rel == Path("ninfer/_bridge.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("ninfer.engine._") and name != "ninfer.engine._contract":
                    found.append(f"{rel}:{node.lineno} imports {name}")
    return found


def _imports(path: Path) -> list[tuple[ast.stmt, str]]:
    """Each import statement of a module (at any depth) with each module it names."""
    found: list[tuple[ast.stmt, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node, node.module))
        elif isinstance(node, ast.Import):
            found += [(node, a.name) for a in node.names]
    return found


def _engine_violations(root: Path) -> list[str]:
    """Engine modules that import a server module (anything of `ninfer.` outside
    `ninfer.engine`): the engine's errors are its own, the server takes them from it."""
    found = []
    for path in sorted((root / "ninfer" / "engine").glob("*.py")):
        rel = path.relative_to(root)
        for node, name in _imports(path):
            if name.startswith("ninfer.") and not name.startswith("ninfer.engine"):
                found.append(f"{rel}:{node.lineno} imports {name}")
    return found


def _frontend_violations(root: Path) -> list[str]:
    """Server modules outside ninfer/frontends/ that name a frontend's private module:
    the lifespan, the app and the flow take what the package exports."""
    found = []
    for path in sorted((root / "ninfer").rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[:2] == ("ninfer", "frontends"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "ninfer.frontends._"
            ):
                found.append(f"{rel}:{node.lineno} imports {node.module}")
    return found


def _module_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the three packages -> the modules of them it imports (`from a.b
    import c` names a.b.c where that is a module, else a.b)."""
    paths = {}
    for package in ("ninfer", "scheduler", "protocols"):
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            paths[".".join(parts)] = path
    graph = {}
    for name, path in paths.items():
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    named.add(full if full in paths else node.module)
            elif isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
        graph[name] = named & paths.keys()
    return graph


def _circle_violations(root: Path) -> list[str]:
    """Two modules that import each other, or one that imports itself."""
    graph = _module_graph(root)
    return [
        f"{a} and {b} import each other" if a != b else f"{a} imports itself"
        for a in sorted(graph)
        for b in sorted(graph[a])
        if a <= b and a in graph[b]
    ]


def layer_violations(root: Path) -> list[str]:
    problems = []
    # One interpreter per group, started together (each spends most of its time
    # importing: on two cores the checks take half as long).
    with ThreadPoolExecutor(max_workers=len(RULES)) as pool:
        loads = list(pool.map(lambda modules: _loaded_by(modules, root), RULES))
    for (modules, forbidden), loaded in zip(RULES.items(), loads, strict=True):
        for bad in forbidden:
            if any(m == bad or m.startswith(bad + ".") for m in loaded):
                engine = modules == tuple(ENGINE_MODULES)
                name = "ninfer.engine._*" if engine else ", ".join(modules)
                problems.append(f"import {name} loads {bad}")
    return (
        problems
        + _bridge_violations(root)
        + _frontend_violations(root)
        + _engine_violations(root)
        + _circle_violations(root)
    )


def test_the_packages_depend_in_one_direction() -> None:
    assert layer_violations(ROOT) == []


def test_the_checker_fails_on_planted_violations(tmp_path: Path) -> None:
    for package in ("ninfer", "scheduler", "protocols"):
        shutil.copytree(
            ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    # What v0.1 did: the engine's message module pulled torch into every Trio-side module.
    contract = tmp_path / "ninfer" / "engine" / "_contract.py"
    contract.write_text(contract.read_text() + "\nimport torch  # planted\n")
    json_mod = tmp_path / "protocols" / "_json.py"
    json_mod.write_text(json_mod.read_text() + "\nimport trio  # planted\n")
    flow = tmp_path / "ninfer" / "_flow.py"
    flow.write_text(flow.read_text() + "\nfrom ninfer.engine._model import Transformer\n")
    # What the lifespan did before frontends/_grammar.py: reach into a frontend's module.
    lifespan = tmp_path / "ninfer" / "_lifespan.py"
    lifespan.write_text(lifespan.read_text() + "\nfrom ninfer.frontends._tools import ToolPlan\n")
    # What four engine modules did before: take their errors from the server's module.
    gguf_mod = tmp_path / "ninfer" / "engine" / "_gguf.py"
    gguf_mod.write_text(gguf_mod.read_text() + "\nfrom ninfer._config import SETTINGS\n")
    # What the log tools did before _logs.py: the summary's module and the figure's
    # imported each other (and the summary's imported itself).
    logtools = tmp_path / "ninfer" / "tools" / "_logtools.py"
    logtools.write_text(
        logtools.read_text()
        + "\ndef _plot():\n    from ninfer.tools._logplot import plot_log\n"
        + "    from ninfer.tools._logtools import read_logs\n"
    )
    problems = layer_violations(tmp_path)
    assert "ninfer.tools._logplot and ninfer.tools._logtools import each other" in problems
    assert "ninfer.tools._logtools imports itself" in problems
    assert any(p.startswith("ninfer/engine/_gguf.py:") for p in problems)
    assert "import protocols loads trio" in problems
    assert any(p.startswith("ninfer/_lifespan.py:") and "frontends._tools" in p for p in problems)
    assert "import ninfer.app loads torch" in problems
    assert "import ninfer.engine loads torch" in problems
    assert any(p.startswith("ninfer/_flow.py:") for p in problems)


def test_no_test_module_imports_another() -> None:
    """What tests share lives in the harness (conftest, server, fakeengine, tinymodel,
    contract): a test module that imports another runs the other's collection-time
    code and breaks when a private helper of it moves."""
    found = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        found += [
            f"{path.name}:{node.lineno} imports {name}"
            for node, name in _imports(path)
            if name.startswith("test_")
        ]
    assert found == []
