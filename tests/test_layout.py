"""The package's shape: no import cycle among spd modules (at module level or inside functions); the old
import paths still work."""

import ast
import subprocess
import sys

import pytest

from conftest import REPO


def _import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in (REPO / "spd").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (path, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, package) in modules.items():
        here = name.split(".") if package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):  # every import statement, in functions too
            if isinstance(node, ast.ImportFrom):
                base = (
                    ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level
                    else node.module or ""
                )
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target not in (name, "spd"):
                    graph[name].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    graph = _import_graph()
    assert len(graph) > 30 and graph["spd.decoding.engine"]  # the graph was read
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_public_api_is_importable_from_spd_and_import_spd_stays_light():
    """Every name of ``spd.__all__`` is the object of its home module; ``import spd`` alone loads no torch (in a
    fresh interpreter, so earlier imports do not hide it)."""
    code = (
        "import sys, spd\nlight = 'torch' not in sys.modules\nimport importlib\n"
        "same = all(getattr(spd, n) is getattr(importlib.import_module(m), n) for n, m in spd._EXPORTS.items())\n"
        "print(light, same, sorted(spd._EXPORTS) == sorted(set(spd.__all__) - {'__version__'}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "True"], proc.stdout
    import spd

    with pytest.raises(AttributeError, match="no attribute 'PipelineEngine'"):
        spd.PipelineEngine  # noqa: B018 - the attribute access is what must raise


def test_every_stage_backend_has_the_protocols_methods():
    """LocalStages and RemoteStages are StageBackends, LocalBatch and RemoteBatch BatchBackends: each method of the
    protocol, with its parameters in order."""
    import inspect

    from spd.decoding.backend import BatchBackend, LocalBatch, LocalStages, StageBackend
    from spd.runtime.batch import RemoteBatch
    from spd.runtime.remote import RemoteStages

    def methods(protocol):
        return {name: fn for name, fn in vars(protocol).items() if inspect.isfunction(fn) and not name.startswith("_")}

    for protocol, backends in ((StageBackend, (LocalStages, RemoteStages)), (BatchBackend, (LocalBatch, RemoteBatch))):
        assert methods(protocol), protocol
        for backend in backends:
            for name, fn in methods(protocol).items():
                assert callable(getattr(backend, name, None)), (backend.__name__, name)
                want = list(inspect.signature(fn).parameters)
                got = list(inspect.signature(getattr(backend, name)).parameters)
                assert got == want, (backend.__name__, name, got, want)
