"""pytest plugin: a contract fixture, a marker that fails a test on any reload finding, and a JSON report.

Loaded in every pytest session of an environment where graphsafe is installed (entry point ``pytest11``); turn it
off with ``-p no:graphsafe``. This module imports only pytest and the standard library; the contract subclass,
the collectors and the report load when a test first uses the fixture or the marker. Its hooks do nothing for a
test that uses neither.

``graphsafe_contract``
    A factory: ``graphsafe_contract(model, mode="strict", **options)`` returns a sealed
    :class:`~graphsafe.GraphContract` (``options`` go to its constructor: ``detect``, ``max_depth``...). The
    fixture records the outcome of every reload run through it and keeps the model alive until the test ends.

``@pytest.mark.graphsafe(mode="strict")``
    Sets the mode of every contract the test creates through the fixture (a different explicit ``mode`` is an
    error), and, once the test body has passed, fails the test if any of those contracts saw a finding in any
    reload (problems, and ``auto-restored`` repairs too: an undeclared tensor that needed repair is a finding) or
    was left not serving-safe. A marked test that created no contract through the fixture, or ran no reload through
    any of them, fails as well: the marker would otherwise check nothing. The marker reads only what the fixture
    recorded; it patches nothing.

``--graphsafe-report=PATH``
    Writes one JSON document at the end of the run: for every layer that a fixture-made contract tracked, or that
    a reload found something on, its test, the reload statuses, its findings and its migration report (the
    :class:`~graphsafe.collectors.MigrationReport` of the contract restricted to that layer). A relative
    ``PATH`` is taken from the directory pytest was invoked in; under pytest-xdist each worker writes
    ``PATH`` with its worker id before the suffix.

``--graphsafe-fix-diff=FILE``
    Writes, at the end of the run, the unified diff ``graphsafe fix`` would propose for the layers that
    fixture-made contracts tracked: the migration report's fixes of every such contract (each fix once, however
    many tests touched its class) placed in the classes' source files, which are not changed (paths relative to
    the directory pytest was invoked in: ``patch -p1 -i FILE`` there applies it). An empty file means nothing to
    fix. Fixes it cannot place, and fixes on installed code, are listed in the terminal summary with the report's
    text. Needs LibCST (``graphsafe[fix]``); ``FILE`` is taken and suffixed under pytest-xdist as
    ``--graphsafe-report``'s ``PATH`` is.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from torch import nn

    from graphsafe.contract import GraphContract
    from graphsafe.fix import Patch
    from graphsafe.outcome import ReloadOutcome
    from graphsafe.report import Fix

__all__ = ["REPORT_SCHEMA", "ContractFactory"]

#: The ``schema`` field of the ``--graphsafe-report`` document.
REPORT_SCHEMA = "graphsafe.pytest-report/1"
_MARKER = "graphsafe"
_MARKER_HELP = (
    "graphsafe(mode='strict'): contracts made by the graphsafe_contract fixture use this mode, and the test fails "
    "if any of their reloads has a finding"
)


class _Tracked:
    """One contract made through the fixture: the model (kept alive until teardown) and the outcomes of its
    reloads, in order (recorded by an ``on_outcome`` listener)."""

    def __init__(self, contract: GraphContract, model: nn.Module) -> None:
        self.contract = contract
        self.model = model
        self.outcomes: list[ReloadOutcome] = []
        contract.on_outcome(self.outcomes.append)


_TRACKED = pytest.StashKey[list[_Tracked]]()
_REPORT = pytest.StashKey["_ReportSink"]()
_FIX_DIFF = pytest.StashKey["_FixDiffSink"]()


def _marker_mode(item: pytest.Item) -> str | None:
    """The mode ``@pytest.mark.graphsafe`` asks for, ``None`` when the test is not marked."""
    marker = item.get_closest_marker(_MARKER)
    if marker is None:
        return None
    unknown = set(marker.kwargs) - {"mode"}
    if unknown or len(marker.args) > 1 or (marker.args and "mode" in marker.kwargs):
        pytest.fail(
            f"{item.nodeid}: @pytest.mark.graphsafe takes one argument, mode (got args={marker.args!r}, "
            f'kwargs={sorted(marker.kwargs)!r}); write @pytest.mark.graphsafe(mode="strict")',
            pytrace=False,
        )
    mode = marker.args[0] if marker.args else marker.kwargs.get("mode", "strict")
    from graphsafe.contract import MODES

    if mode not in MODES:
        pytest.fail(
            f"{item.nodeid}: @pytest.mark.graphsafe(mode={mode!r}): choose one of {', '.join(MODES)}", pytrace=False
        )
    return str(mode)


def _no_slots() -> dict[str, int]:
    """A layer's slot counts by origin, all zero (one key per :class:`~graphsafe.Origin`)."""
    from graphsafe.outcome import Origin

    return {origin.value: 0 for origin in Origin}


class ContractFactory:
    """The ``graphsafe_contract`` fixture's value: call it with a loaded model to get a sealed contract."""

    def __init__(self, item: pytest.Item) -> None:
        self._item = item
        self._marker_mode = _marker_mode(item)
        self._tracked: list[_Tracked] = item.stash.setdefault(_TRACKED, [])

    def __call__(self, model: nn.Module, mode: str | None = None, **options: Any) -> GraphContract:
        """Create and seal a contract on ``model`` (loaded, PWAL run); ``options`` go to ``GraphContract``."""
        wanted = self._marker_mode
        if mode is not None and wanted is not None and mode != wanted:
            pytest.fail(
                f"graphsafe_contract(mode={mode!r}) conflicts with @pytest.mark.graphsafe(mode={wanted!r}) on "
                f"{self._item.nodeid}: drop one of them",
                pytrace=False,
            )
        from graphsafe.contract import GraphContract

        contract = GraphContract(model, mode or wanted or "strict", **options)  # type: ignore[arg-type]
        contract.seal()
        self._tracked.append(_Tracked(contract, model))
        return contract

    @property
    def contracts(self) -> list[GraphContract]:
        """The contracts made so far in this test."""
        return [t.contract for t in self._tracked]

    def outcomes(self, contract: GraphContract) -> list[ReloadOutcome]:
        """Every reload outcome ``contract`` produced so far, in order."""
        for tracked in self._tracked:
            if tracked.contract is contract:
                return list(tracked.outcomes)
        raise ValueError("this contract was not made by the graphsafe_contract fixture")


# ----------------------------------------------------------------------------------------------------------------
# Hooks.


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graphsafe", "graphsafe reload contracts")
    group.addoption(
        "--graphsafe-report",
        metavar="PATH",
        default=None,
        help="write a JSON migration report for every layer that graphsafe_contract contracts exercised",
    )
    group.addoption(
        "--graphsafe-fix-diff",
        metavar="FILE",
        default=None,
        help="write the diff `graphsafe fix` would make for the layers graphsafe_contract contracts exercised "
        "(needs graphsafe[fix]; no source file is changed)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_HELP)
    option = config.getoption("graphsafe_report", None)
    if option:
        sink = _ReportSink(_output_path(config, option))
        _check_writable(sink.path, "--graphsafe-report")
        config.stash[_REPORT] = sink
    option = config.getoption("graphsafe_fix_diff", None)
    if option:
        try:
            import libcst  # noqa: F401  (checked now: the diff is made at the end of the session)
        except ImportError:
            raise pytest.UsageError(
                "graphsafe pytest plugin: --graphsafe-fix-diff needs LibCST to place fixes in source: "
                "pip install 'graphsafe[fix]'"
            ) from None
        diff_sink = _FixDiffSink(_output_path(config, option), config.invocation_params.dir)
        _check_writable(diff_sink.path, "--graphsafe-fix-diff")
        config.stash[_FIX_DIFF] = diff_sink


def _output_path(config: pytest.Config, option: str) -> Path:
    """An output option's path: relative to the invocation directory, with the xdist worker id before the suffix
    (one file per worker, instead of workers overwriting each other's)."""
    path = config.invocation_params.dir / Path(option)
    worker = getattr(config, "workerinput", {}).get("workerid")
    return path.with_name(f"{path.stem}.{worker}{path.suffix}") if worker else path


def _check_writable(path: Path, option: str) -> None:
    """Refuse the session at configure time when ``path`` could not be written at its end."""
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
    except OSError as exc:
        raise pytest.UsageError(_unwritable(path, option, exc)) from None
    if not existed:
        path.unlink()


def _unwritable(path: Path, option: str, exc: OSError) -> str:
    reason = exc.strerror or type(exc).__name__
    return f"graphsafe pytest plugin: {option} {path}: cannot write there ({reason}); pass a writable file path"


@pytest.fixture
def graphsafe_contract(request: pytest.FixtureRequest) -> Iterator[ContractFactory]:
    """A factory of sealed, recorded contracts: ``contract = graphsafe_contract(model, mode="strict")``."""
    factory = ContractFactory(request.node)
    yield factory
    tracked = request.node.stash.get(_TRACKED, [])
    sink = request.config.stash.get(_REPORT, None)
    diff_sink = request.config.stash.get(_FIX_DIFF, None)
    try:
        if sink is not None:
            for entry in tracked:
                try:
                    sink.add(request.node.nodeid, entry)
                except Exception as exc:  # the report must not turn a passing test into an error
                    sink.errors.append({"test": request.node.nodeid, "error": repr(exc)})
        if diff_sink is not None:
            for entry in tracked:
                try:
                    diff_sink.add(entry)
                except Exception as exc:  # as for the report: said at the end, the test stands
                    diff_sink.errors.append(f"{request.node.nodeid}: {exc!r}")
    finally:
        # Drop the strong references (models, transactions) so nothing outlives the test.
        tracked.clear()


@pytest.hookimpl(trylast=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    # trylast: runs after the runner's own pytest_runtest_call ran the body, and only if the body passed (a
    # failing body raises out of the hook call first), so a failure of the body always stands as it is.
    mode = _marker_mode(item)
    if mode is not None:
        message = _marker_verdict(item, mode)
        if message is not None:
            pytest.fail(message, pytrace=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    sinks: list[tuple[_ReportSink | _FixDiffSink | None, str]] = [
        (session.config.stash.get(_REPORT, None), "--graphsafe-report"),
        (session.config.stash.get(_FIX_DIFF, None), "--graphsafe-fix-diff"),
    ]
    for sink, option in sinks:
        if sink is None:
            continue
        try:
            sink.write()
        except OSError as exc:  # the path went away during the session: say so in one line, fail the run
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(_unwritable(sink.path, option, exc), red=True)
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    sink = config.stash.get(_FIX_DIFF, None)
    if sink is not None:
        for line in sink.summary():
            terminalreporter.write_line(line)


# ----------------------------------------------------------------------------------------------------------------
# The marker's verdict.


#: Findings of one kind shown before the rest are counted, and fixes shown before the rest are counted.
_FIRST_FINDINGS = 1
_FIRST_FIXES = 3


def _marker_verdict(item: pytest.Item, mode: str) -> str | None:
    tracked = item.stash.get(_TRACKED, [])
    if not tracked:
        return (
            f"@pytest.mark.graphsafe(mode={mode!r}): the test created no contract through the graphsafe_contract "
            "fixture, so nothing was checked; use contract = graphsafe_contract(model)"
        )
    full = item.config.get_verbosity() > 0 or item.config.stash.get(_REPORT, None) is not None
    parts: list[str] = []
    for number, entry in enumerate(tracked, 1):
        bad = [(index, o) for index, o in enumerate(entry.outcomes, 1) if o.findings]
        if not bad and entry.contract.serving_safe:
            continue
        parts.append((_full_part if full else _short_part)(number, entry, bad))
    if not parts and not any(entry.outcomes for entry in tracked):
        return (
            f"@pytest.mark.graphsafe(mode={mode!r}): no reload ran through the contract(s) the test made with the "
            "graphsafe_contract fixture, so nothing was checked (a reload outside the contract moves what the graphs "
            "read unseen); reload inside `with contract.reload():`"
        )
    if not parts:
        return None
    header = f"@pytest.mark.graphsafe(mode={mode!r}): a reload under the contract had findings"
    if not full:
        parts.append("(every finding and the whole migration report: run pytest with -v, or --graphsafe-report=PATH)")
    return "\n\n".join([header, *parts])


def _full_part(number: int, entry: _Tracked, bad: list[tuple[int, ReloadOutcome]]) -> str:
    """Every reload with findings, each finding in full, and the whole migration report (``-v``)."""
    from graphsafe.report import migration_report

    contract = entry.contract
    lines = [f"contract #{number} on {type(entry.model).__name__} (mode={contract.mode}):"]
    for index, outcome in bad:
        lines.append(f"reload {index}: " + outcome.summary())
        lines += [f"  - {f.describe()}" for f in outcome.auto_restored]
    if not contract.serving_safe:
        lines.append(f"not serving-safe at the end of the test: {contract.unsafe_reason}")
    lines += ["", migration_report(contract).render("text").rstrip("\n")]
    return "\n".join(lines)


def _short_part(number: int, entry: _Tracked, bad: list[tuple[int, ReloadOutcome]]) -> str:
    """The default: which reloads, the first finding of each kind with a count of the rest, and the fix."""
    from graphsafe.report import migration_report

    contract = entry.contract
    reloads = ", ".join(f"{index} ({outcome.status.value})" for index, outcome in bad)
    lines = [
        f"contract #{number} on {type(entry.model).__name__} (mode={contract.mode}): "
        f"{len(bad)} of {len(entry.outcomes)} reload(s) had findings: reload {reloads}"
    ]
    by_kind: dict[str, list[str]] = {}
    for _, outcome in bad:
        for finding in outcome.findings:
            first = finding.describe().splitlines()[0]  # the sentence; the lines below it are addresses
            by_kind.setdefault(finding.kind.value, []).append(first)
    for kind, described in by_kind.items():
        lines += [f"  - {_clip(text)}" for text in described[:_FIRST_FINDINGS]]
        if len(described) > _FIRST_FINDINGS:
            lines.append(f"    ... and {len(described) - _FIRST_FINDINGS} more {kind} finding(s)")
    if not contract.serving_safe:
        lines.append(f"not serving-safe at the end of the test: {_clip(str(contract.unsafe_reason))}")
    fixes = migration_report(contract).fixes
    if fixes:
        lines.append("fix:")
        for fix in fixes[:_FIRST_FIXES]:
            lines.append(f"  {'on' if fix.kind.value == 'graph_visible' else 'in'} {_clip(fix.target)}")
            lines += [f"      {line}" for line in fix.lines]
        if len(fixes) > _FIRST_FIXES:
            lines.append(f"  ... and {len(fixes) - _FIRST_FIXES} more fix(es)")
    return "\n".join(lines)


def _clip(text: str, width: int = 200) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# ----------------------------------------------------------------------------------------------------------------
# --graphsafe-report.


class _ReportSink:
    """Per-layer records gathered at each test's teardown, written once at the end of the session."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.layers: list[dict[str, Any]] = []
        self.tests: set[str] = set()
        self.errors: list[dict[str, str]] = []

    def add(self, nodeid: str, tracked: _Tracked) -> None:
        from graphsafe.report import migration_report

        contract = tracked.contract
        outcomes = tracked.outcomes
        report = migration_report(contract)
        self.tests.add(nodeid)
        counts: dict[str, dict[str, int]] = {}
        classes: dict[str, str] = {}
        for slot in contract.slots():
            counts.setdefault(slot.layer, _no_slots())[slot.origin.value] += 1
            classes[slot.layer] = slot.layer_class
        for outcome in outcomes:
            for finding in outcome.findings:
                counts.setdefault(finding.layer, _no_slots())
                classes.setdefault(finding.layer, finding.layer_class)
        if report.unowned:
            counts.setdefault("", _no_slots())
            classes.setdefault("", type(tracked.model).__name__)
        for layer, slots in counts.items():
            entries = tuple(e for e in report.entries if e.layer == layer)
            fixes = tuple(f for f in report.fixes if layer in f.layers)
            # Unowned storage belongs to no layer: it goes with the model's root.
            unowned = report.unowned if layer == "" else ()
            aliases = tuple(a for a in report.aliases if a.layer == layer)
            own = dataclasses.replace(
                report,
                entries=entries,
                fixes=fixes,
                unowned=unowned,
                aliases=aliases,
                undecided=tuple(u for u in report.undecided if layer in u.layers),
                declared=tuple(d for d in report.declared if d.layer == layer),
                declared_problems=sum(d.layer == layer for d in report.declared),
            )
            self.layers.append(
                {
                    "test": nodeid,
                    "layer": layer,
                    "layer_class": classes.get(layer, ""),
                    "mode": contract.mode,
                    "reloads": [o.status.value for o in outcomes],
                    "serving_safe": contract.serving_safe,
                    "slots": slots,
                    "findings": [f.to_dict() for o in outcomes for f in o.findings if f.layer == layer],
                    "report": own.to_dict(),
                }
            )

    def write(self) -> None:
        document = {"schema": REPORT_SCHEMA, "tests": sorted(self.tests), "layers": self.layers, "errors": self.errors}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(document, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# --graphsafe-fix-diff.


class _FixDiffSink:
    """The report's fixes of every fixture-made contract (each once), placed at the end of the session."""

    def __init__(self, path: Path, base: Path) -> None:
        self.path = path
        self.base = base
        self.fixes: dict[tuple[object, ...], Fix] = {}
        self.errors: list[str] = []
        self.patch: Patch | None = None

    def add(self, tracked: _Tracked) -> None:
        from graphsafe.report import migration_report

        for fix in migration_report(tracked.contract).fixes:
            # The same class in many tests (or layers) is one fix: the layer names are not part of what is written.
            key = (fix.kind, fix.owner, fix.target, fix.paths, fix.lines, fix.placement, fix.function)
            self.fixes.setdefault(key, fix)

    def write(self) -> None:
        from graphsafe.fix import FixError, propose

        try:
            self.patch = propose(self.fixes.values(), installed="list")
            text = self.patch.diff(relative_to=self.base)
        except FixError as exc:  # LibCST went missing since configure: the one line says what to install
            self.errors.append(str(exc))
            text = ""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(text, encoding="utf-8")

    def summary(self) -> list[str]:
        """The terminal summary's lines: the file written, and what is left to place by hand."""
        patch = self.patch
        files = len(patch.files) if patch is not None else 0
        lines = [f"graphsafe fix diff: {len(self.fixes)} fix(es), {files} file(s) to change, written to {self.path}"]
        if patch is not None and patch.unplaced:
            lines.append(f"graphsafe fix diff: {len(patch.unplaced)} item(s) left to place by hand:")
            lines += [unplaced.describe() for unplaced in patch.unplaced]
        lines += [f"graphsafe fix diff: error: {error}" for error in self.errors]
        return lines
