"""The pytest plugin (``graphsafe.testing.plugin``), exercised in inner pytest sessions through ``pytester``.

Inner sessions load the plugin the way users get it: from the installed ``pytest11`` entry point.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest

import graphsafe.testing.plugin as plugin_module

pytest_plugins = ["pytester"]

SCHEMA = Path(plugin_module.__file__).resolve().parents[1] / "report" / "schema.json"

# Inner test modules build zoo models: act_order (legacy: one undeclared tensor per layer; migrated: declared).
HEADER = textwrap.dedent(
    """
    import pytest
    from graphsafe import ContractViolation
    from graphsafe.testing.zoo import EXAMPLES

    EX = EXAMPLES["act_order"]

    def reload(model, contract, seed=1):
        with contract.reload():
            EX.load_weights(model, EX.make_weights(model, seed))
    """
)


def write(pytester: pytest.Pytester, body: str) -> None:
    pytester.makepyfile(test_inner=HEADER + textwrap.dedent(body))


#: The source tree the outer session imports graphsafe from, for the inner sessions' PYTHONPATH.
SRC = str(Path(plugin_module.__file__).resolve().parents[2])


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """An inner session in its own process: torch registers its operator libraries once per process, so a second
    in-process session that imports torch's test helpers again fails with "Only a single TORCH_LIBRARY"."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", SRC)
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args, timeout=240)


def test_the_plugin_is_loaded_from_the_entry_point(request: pytest.FixtureRequest) -> None:
    assert request.config.pluginmanager.get_plugin("graphsafe") is plugin_module


def test_marker_fails_a_test_with_drift_and_passes_a_clean_one(pytester: pytest.Pytester) -> None:
    write(
        pytester,
        """
        @pytest.mark.graphsafe(mode="recapture")
        def test_drift(graphsafe_contract):
            model = EX.build("legacy")
            contract = graphsafe_contract(model)
            reload(model, contract)  # recapture mode: no exception, only a finding

        @pytest.mark.graphsafe(mode="recapture")
        def test_clean(graphsafe_contract):
            model = EX.build("migrated")
            reload(model, graphsafe_contract(model))
        """,
    )
    result = run(pytester, "--strict-markers")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_drift*",
            "@pytest.mark.graphsafe(mode='recapture'): a reload under the contract had findings",
            "*1 of 1 reload(s) had findings: reload 1 (needs_recapture)*",
            "*moved: undeclared slot 'g_idx_sort_indices' of layers.0 (ActOrderLinear)*",
            '*@graph_visible("g_idx_sort_indices")*',
        ]
    )
    assert "test_clean FAILED" not in result.stdout.str()


def test_marker_fails_a_test_that_swallows_a_strict_violation(pytester: pytest.Pytester) -> None:
    write(
        pytester,
        """
        @pytest.mark.graphsafe
        def test_swallowed(graphsafe_contract):
            model = EX.build("legacy")
            contract = graphsafe_contract(model)
            with pytest.raises(ContractViolation):
                reload(model, contract)
        """,
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*mode='strict'*had findings*", "*not serving-safe at the end of the test*"])


def test_marker_counts_auto_restored_repairs_as_findings(pytester: pytest.Pytester) -> None:
    write(
        pytester,
        """
        @pytest.mark.graphsafe(mode="migrate")
        def test_repaired(graphsafe_contract):
            model = EX.build("legacy")
            contract = graphsafe_contract(model)
            reload(model, contract)
            assert contract.last_outcome.committed  # the reload itself was safe...
        """,
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)  # ...but the kernel relied on a repair
    result.stdout.fnmatch_lines(["*auto-restored: undeclared slot 'g_idx_sort_indices'*"])


def test_marker_sees_every_reload_not_only_the_last(pytester: pytest.Pytester) -> None:
    write(
        pytester,
        """
        @pytest.mark.graphsafe(mode="recapture")
        def test_bad_then_good(graphsafe_contract):
            model = EX.build("legacy")
            contract = graphsafe_contract(model)
            contract.on_recapture(lambda outcome: None)  # "recapture", then the contract reseals itself
            reload(model, contract, seed=1)
            reload(model, contract, seed=2)
            assert contract.last_outcome.status.value == "needs_recapture"
            contract.reseal()
        """,
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*2 of 2 reload(s) had findings: reload 1 (needs_recapture), 2 (needs_recapture)*"])


MIGRATE_THREE_TIMES = """
    import torch
    from graphsafe.testing.zoo import ZooModel

    @pytest.mark.graphsafe(mode="migrate")
    def test_migrate(graphsafe_contract):
        cpu = torch.device("cpu")
        names = ("act_order", "marlin_workspace", "cutlass_moe_strides", "mla_transposed", "flashinfer_swiglu")
        model = ZooModel([EXAMPLES[name].make_layer("legacy", cpu) for name in names])
        EX.load_weights(model, EX.make_weights(model, 0))
        contract = graphsafe_contract(model)
        for seed in (1, 2, 3):
            reload(model, contract, seed)
    """


def _failure_section(result: pytest.RunResult, test: str) -> list[str]:
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if line.startswith("___") and f" {test} " in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(("___", "=")))
    return lines[start + 1 : end]


def test_a_marker_failure_is_short_by_default_and_full_with_v(pytester: pytest.Pytester) -> None:
    """Every finding of every reload with its addresses was 264 lines; by default the first
    finding of each kind, a count of the rest and the fix, in at most about 30 lines."""
    write(pytester, MIGRATE_THREE_TIMES)
    short = _failure_section(run(pytester), "test_migrate")
    text = "\n".join(short)
    assert len(short) <= 30, text
    assert "3 of 3 reload(s) had findings" in text and "more auto-restored finding(s)" in text
    assert "fix:" in text and '@graph_visible("g_idx_sort_indices")' in text and "more fix(es)" in text
    assert "@0x" not in text and "run pytest with -v, or --graphsafe-report=PATH" in text
    full = "\n".join(_failure_section(run(pytester, "-v"), "test_migrate"))
    assert full.count("auto-restored: undeclared slot") > 20 and "reload 3: reload committed" in full
    assert "graphsafe migration report:" in full


def test_a_strict_failure_shows_the_test_not_graphsafe_s_source(pytester: pytest.Pytester) -> None:
    """A strict violation showed about 40 lines of graphsafe's own source (``__tracebackhide__``
    now hides its frames for graphsafe's own errors)."""
    write(
        pytester,
        """
        def test_strict(graphsafe_contract):
            model = EX.build("legacy")
            reload(model, graphsafe_contract(model))
        """,
    )
    section = _failure_section(run(pytester), "test_strict")
    text = "\n".join(section)
    assert "UndeclaredDriftError" in text and "with contract.reload():" in text
    assert "_contract.py" not in text and "def _apply" not in text and "raise _violation" not in text, text
    assert len(section) <= 40, text


def test_marker_without_a_contract_fails_instead_of_checking_nothing(pytester: pytest.Pytester) -> None:
    write(
        pytester,
        """
        @pytest.mark.graphsafe
        def test_unused():
            EX.build("legacy")
        """,
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*created no contract through the graphsafe_contract fixture*"])


def test_marker_mode_conflicts_and_bad_modes_are_one_line_errors(pytester: pytest.Pytester) -> None:
    write(
        pytester,
        """
        @pytest.mark.graphsafe(mode="strict")
        def test_conflict(graphsafe_contract):
            graphsafe_contract(EX.build("migrated"), mode="migrate")

        @pytest.mark.graphsafe(mode="lenient")
        def test_bad_mode(graphsafe_contract):
            graphsafe_contract(EX.build("migrated"))
        """,
    )
    result = run(pytester)
    result.assert_outcomes(failed=1, errors=1)  # a bad marker is caught when the fixture is set up
    result.stdout.fnmatch_lines(
        ["*graphsafe_contract(mode='migrate') conflicts with @pytest.mark.graphsafe(mode='strict')*"]
    )
    result.stdout.fnmatch_lines(["*@pytest.mark.graphsafe(mode='lenient'): choose one of strict, recapture, migrate*"])
    # one line each, no traceback through the plugin's code
    output = result.stdout.str()
    assert "plugin.py" not in output and "ValueError" not in output, output


def test_fixture_gives_sealed_recorded_contracts_and_releases_them(pytester: pytest.Pytester) -> None:
    write(
        pytester,
        """
        import gc
        import weakref

        REFS = []

        def test_fixture(graphsafe_contract):
            model = EX.build("legacy")
            contract = graphsafe_contract(model, mode="recapture", detect="sealed-paths")
            assert contract.sealed and contract.serving_safe
            assert (contract.mode, contract.detect) == ("recapture", "sealed-paths")
            assert {(s.origin.value, s.path) for s in contract.slots()} == {
                ("walker", "g_idx_sort_indices"), ("parameter", "weight"), ("parameter", "g_idx")
            }
            reload(model, contract)  # unmarked: the fixture records, it does not judge
            outcomes = graphsafe_contract.outcomes(contract)
            assert [o.status.value for o in outcomes] == ["needs_recapture"]
            assert graphsafe_contract.contracts == [contract]
            REFS.extend([weakref.ref(model), weakref.ref(contract)])

        def test_released_after_teardown():
            gc.collect()
            assert len(REFS) == 2 and all(ref() is None for ref in REFS)
        """,
    )
    result = run(pytester, "-p", "no:randomly")
    result.assert_outcomes(passed=2)


def test_report_option_writes_one_entry_per_layer(pytester: pytest.Pytester) -> None:
    write(
        pytester,
        """
        def test_drift(graphsafe_contract):
            model = EX.build("legacy")
            reload(model, graphsafe_contract(model, mode="recapture"))

        def test_clean(graphsafe_contract):
            model = EX.build("migrated")
            reload(model, graphsafe_contract(model))

        def test_plain():
            assert True

        def test_buffer(graphsafe_contract):
            import torch
            from torch import nn

            layer = nn.Linear(2, 2)
            layer.register_buffer("offset", torch.zeros(2))
            with graphsafe_contract(nn.Sequential(layer)).reload():
                layer.offset.copy_(torch.ones(2))
        """,
    )
    result = run(pytester, "--graphsafe-report=out/report.json")
    result.assert_outcomes(passed=4)
    document = json.loads((pytester.path / "out" / "report.json").read_text())
    assert document["schema"] == plugin_module.REPORT_SCHEMA and document["errors"] == []
    assert document["tests"] == ["test_inner.py::test_buffer", "test_inner.py::test_clean", "test_inner.py::test_drift"]
    layers = {(entry["test"].split("::")[1], entry["layer"]): entry for entry in document["layers"]}
    buffer = layers.pop(("test_buffer", "0"))
    assert buffer["slots"] == {"declared": 0, "parameter": 2, "buffer": 1, "alias": 0, "walker": 0}
    assert buffer["reloads"] == ["committed"]
    assert set(layers) == {(t, f"layers.{i}") for t in ("test_drift", "test_clean") for i in (0, 1)}
    schema = json.loads(SCHEMA.read_text())
    for entry in document["layers"]:
        jsonschema.validate(entry["report"], schema)
        assert entry["layer_class"] == ("Linear" if entry["test"].endswith("test_buffer") else "ActOrderLinear")
    drift = layers[("test_drift", "layers.1")]
    assert drift["reloads"] == ["needs_recapture"] and not drift["serving_safe"]
    assert drift["slots"] == {"declared": 0, "parameter": 2, "buffer": 0, "alias": 0, "walker": 1}  # weight, g_idx
    assert {f["kind"] for f in drift["findings"]} == {"moved"}
    assert {f["layer"] for f in drift["findings"]} == {"layers.1"}
    assert [e["path"] for e in drift["report"]["entries"]] == ["g_idx_sort_indices"]
    assert {e["layer"] for e in drift["report"]["entries"]} == {"layers.1"}
    clean = layers[("test_clean", "layers.0")]
    assert clean["reloads"] == ["committed"] and clean["findings"] == []
    assert clean["slots"] == {"declared": 1, "parameter": 2, "buffer": 0, "alias": 0, "walker": 0}
    assert clean["report"]["entries"] == []


def test_report_json_gives_each_layer_its_own_problems_on_declared_slots(pytester: pytest.Pytester) -> None:
    write(
        pytester,
        """
        import torch
        from torch import nn
        from graphsafe import register_derived

        class Once(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.empty(2, 2), requires_grad=False)

            def process_weights_after_loading(self):
                if not hasattr(self, "g"):  # built at the first load only: stale at the next
                    self.g = self.weight * 2
                    register_derived(self, "g")

        def load(model, seed):
            with torch.no_grad():
                for layer in model:
                    layer.weight.copy_(torch.randn(2, 2, generator=torch.Generator().manual_seed(seed)))
                    layer.process_weights_after_loading()

        def test_stale(graphsafe_contract):
            model = nn.Sequential(Once(), Once())
            load(model, 0)
            contract = graphsafe_contract(model, mode="recapture")
            with pytest.raises(ContractViolation), contract.reload():
                load(model, 1)
        """,
    )
    result = run(pytester, "--graphsafe-report=report.json")
    result.assert_outcomes(passed=1)
    document = json.loads((pytester.path / "report.json").read_text())
    reports = {entry["layer"]: entry["report"] for entry in document["layers"]}
    for layer in ("0", "1"):
        assert [(p["layer"], p["path"], p["drift"]) for p in reports[layer]["declared_problems"]] == [
            (layer, "g", "stale")
        ], reports[layer]
        assert reports[layer]["summary"]["declared_problems"] == 1


def test_without_the_option_no_report_is_written(pytester: pytest.Pytester) -> None:
    write(pytester, "def test_one(graphsafe_contract):\n    graphsafe_contract(EX.build('migrated'))\n")
    run(pytester).assert_outcomes(passed=1)
    assert not list(pytester.path.rglob("*.json"))


def test_opting_out_removes_marker_fixture_and_option(pytester: pytest.Pytester) -> None:
    # Plain pytest tests (no graphsafe import), so the subprocess below stays quick.
    pytester.makepyfile(
        test_inner="""
        import pytest

        @pytest.mark.graphsafe
        def test_marked():
            pass

        def test_fixture(graphsafe_contract):
            pass

        def test_plain():
            pass
        """
    )
    # In a subprocess: an in-process run would reuse this session's cache of known marker names.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:graphsafe", "--strict-markers")
    result.assert_outcomes(errors=1)  # --strict-markers: the unknown marker fails collection
    result.stdout.fnmatch_lines(["*'graphsafe' not found in `markers` configuration option*"])

    result = run(pytester, "-p", "no:graphsafe")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*fixture 'graphsafe_contract' not found*"])

    result = run(pytester, "-p", "no:graphsafe", "--graphsafe-report=r.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_importing_the_plugin_loads_nothing_beyond_the_package(pytester: pytest.Pytester) -> None:
    # pytest imports the plugin in every session; what it needs (the contract subclass, the report, torch-heavy
    # collectors) loads on first use. The parent package `graphsafe` is imported either way.
    script = pytester.makepyfile(
        probe="""
        import sys
        import graphsafe
        before = set(sys.modules)
        import graphsafe.testing.plugin
        print(sorted(m for m in set(sys.modules) - before if m.startswith("graphsafe")))
        """
    )
    result = pytester.run(sys.executable, str(script))
    assert result.ret == 0, result.stderr.str()
    assert result.stdout.lines[-1] == "['graphsafe.testing', 'graphsafe.testing.plugin']"


def test_marker_is_registered_for_strict_markers(pytester: pytest.Pytester) -> None:
    result = run(pytester, "--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.graphsafe(mode='strict'): *"])


@pytest.mark.parametrize("where", ["file-as-directory", "directory"])
def test_an_unwritable_report_path_is_a_one_line_usage_error_before_any_test_runs(
    pytester: pytest.Pytester, where: str
) -> None:
    write(
        pytester,
        """
        def test_clean():
            pass
        """,
    )
    pytester.path.joinpath("blocker").write_text("a file, not a directory\n")
    target = "blocker/report.json" if where == "file-as-directory" else "."
    result = run(pytester, f"--graphsafe-report={target}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.stderr.lines if "graphsafe" in line and "--graphsafe-report" in line]
    assert len(errors) == 1 and "writable" in errors[0], result.stderr.str()
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    assert "test_clean" not in result.stdout.str()  # refused before collecting, not after running the tests
