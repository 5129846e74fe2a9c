"""The ``graphsafe`` command line, run as a subprocess (``python -m graphsafe``) the way users run it."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest

from graphsafe.cli import main, run_demo, upstream_harm
from graphsafe.report import FORMATS, SCHEMA_ID, report_schema
from graphsafe.testing.zoo import EXAMPLES, marlin

ROOT = Path(__file__).resolve().parents[2]


def graphsafe(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "graphsafe", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=240,
    )


def _one_sentence_error(result: subprocess.CompletedProcess[str]) -> str:
    """The usage-error contract: exit 2, one line on stderr that says what is wrong, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphsafe: error: "), result.stderr
    return lines[0]


# ----------------------------------------------------------------------------------------------------------------
# Help and usage.


def test_help_lists_the_commands() -> None:
    result = graphsafe("--help")
    assert result.returncode == 0
    assert "demo" in result.stdout and "report" in result.stdout and "Exit status" in result.stdout


def test_report_help_documents_the_target_protocol_and_choices() -> None:
    result = graphsafe("report", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for needle in (
        "module:callable",
        "reload(model, seed)",
        "warmup(model)",
        "(model, reload)",
        "--format",
        *FORMATS,
        "strict",
        "recapture",
        "migrate",
        "-o",
    ):
        assert needle in text, needle


def test_no_command_and_bad_options_are_usage_errors() -> None:
    assert "no command given" in _one_sentence_error(graphsafe())
    assert "unknown format 'yaml'" in _one_sentence_error(graphsafe("report", "--format", "yaml"))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "no command given"),
        (["bogus"], "invalid choice: 'bogus'"),
        (["report", "--format", "yaml"], "unknown format 'yaml': choose one of text"),
        (["report", "--mode", "lenient"], "unknown mode 'lenient': choose one of strict"),
        (["report", "--seed", "x"], "--seed"),
        (["report", "--bogus"], "unrecognized arguments: --bogus"),
        (["demo", "--verbose", "--nope"], "unrecognized arguments: --nope"),
        (["report", "-o"], "expected one argument"),
    ],
)
def test_every_usage_error_is_one_line_on_stderr_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Argparse's own errors print the usage first (5 lines); ours are one line, exit 2."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphsafe: error: "), captured.err
    assert says in lines[0] and captured.out == ""


def test_formats_and_modes_are_case_insensitive(capsys: pytest.CaptureFixture[str]) -> None:
    """``-f JSON -m Strict`` is ``-f json -m strict``."""
    status = main(["report", "graphsafe.cli:migrated_zoo", "-f", "JSON", "-m", "Strict"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert json.loads(captured.out)["schema"].startswith("graphsafe.migration-report/")
    assert "mode=strict" in captured.err


# ----------------------------------------------------------------------------------------------------------------
# demo


def test_demo_fits_one_screen_and_shows_the_measured_harm(capsys: pytest.CaptureFixture[str]) -> None:
    """By default one screen: the replay error of a plain reload as a measured number, what each
    mode did, where to go next."""
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    lines = out.rstrip("\n").splitlines()
    assert len(lines) <= 20, out
    harms = [upstream_harm(EXAMPLES[name]) for name in EXAMPLES]
    median = sorted(h.replay_error for h in harms)[len(harms) // 2]
    assert median > 0.1  # a stale replay is far off, not a rounding error
    assert f"off by {median * 100:.0f}%" in out
    for mode in ("strict", "recapture", "migrate"):
        assert sum(line.lstrip().startswith(mode) for line in lines) == 2, mode  # its row and what it does
    assert "11/11 restored" in out and "graphsafe report" in out and "--verbose" in out
    assert "results as expected" in out


def test_upstream_harm_is_measured_on_the_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The number is the replay's error: reloading the same weights moves the tensors but does no harm."""
    ex = EXAMPLES["marlin_workspace"]
    harm = upstream_harm(ex)
    assert harm.moved == harm.total > 0 and harm.replay_error > 0.1
    monkeypatch.setattr("graphsafe.cli._demo.NEW_SEED", 0)  # the first load's seed
    same = upstream_harm(ex)
    assert same.moved == harm.moved and same.replay_error < 1e-6


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_pipe_is_not_reported_as_a_bug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``graphsafe demo | head`` closes the pipe early: no "internal error ... this is a bug" and no traceback."""
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["demo", "act_order"]) == 0
    assert "internal error" not in capsys.readouterr().err


def test_demo_verbose_shows_every_example_under_every_mode() -> None:
    result = graphsafe("demo", "--verbose")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "replay error" in result.stdout
    out = result.stdout
    for name in EXAMPLES:
        assert out.count(name) >= 5, name  # upstream table, three mode tables, the migration report
    for mode in ("strict", "recapture", "migrate"):
        assert f"mode={mode}" in out
    for status in ("raised", "needs_recapture", "auto-restored", "restored"):
        assert status in out
    assert "UNEXPECTED" not in out and "results as expected" in out
    assert '@graph_visible("quant_method.kernel.workspace", "quant_method.kernel.w_packed")' in out


def test_demo_fails_when_a_migrated_example_misbehaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the migrated Marlin method loses its declarations, so its reloads produce findings."""
    monkeypatch.setattr(
        marlin.MigratedMarlinLinearMethod,
        "process_weights_after_loading",
        marlin.MarlinLinearMethod.process_weights_after_loading,
    )
    out = io.StringIO()
    assert run_demo(out, ["marlin_workspace", "act_order"]) == 1
    text = out.getvalue()
    assert "UNEXPECTED" in text and "NOT as expected" in text
    assert "marlin_workspace [migrated, mode=strict]: got raised" in text
    assert "act_order [" not in text.split("NOT as expected")[1]  # the healthy example stays expected


def test_demo_rejects_an_unknown_example() -> None:
    line = _one_sentence_error(graphsafe("demo", "no_such_site"))
    assert "no_such_site" in line and "marlin_workspace" in line


# ----------------------------------------------------------------------------------------------------------------
# report


@pytest.mark.parametrize("fmt", FORMATS)
def test_report_on_the_legacy_zoo_in_each_format(fmt: str) -> None:
    result = graphsafe("report", "--format", fmt)
    assert result.returncode == 1, result.stderr  # the legacy zoo has undeclared tensors
    out = result.stdout
    assert "graphsafe report: reload needs_recapture (mode=migrate)" in result.stderr
    if fmt == "json":
        document = json.loads(out)
        jsonschema.Draft202012Validator(report_schema()).validate(document)
        assert document["schema"] == SCHEMA_ID and document["summary"]["entries"] > 0
        paths = {(e["layer"], e["path"]) for e in document["entries"]}
        assert ("marlin_workspace.layers.1", "quant_method.kernel.workspace") in paths
    elif fmt == "dot":
        assert out.startswith("digraph migration_report {") and out.rstrip().endswith("}")
    elif fmt == "tree":
        assert "marlin_workspace.layers.0 (MarlinLinear)" in out and "kernel (MarlinKernel)" in out
    elif fmt == "markdown":
        assert out.startswith("# graphsafe migration report") and "```python" in out
    else:
        assert "graphsafe.testing.zoo.marlin.MarlinLinearMethod.process_weights_after_loading" in out
        # PWAL drops the forward's scratch. Without a capture nothing says the graph overwrites it (a dropped
        # weight-derived cache looks the same): stable_empty is only an alternative in the note, never the fix line.
        call = 'stable_empty(self, "_permute_scratch", (16, 16), torch.float32'  # PermuteMoE's own PWAL: `self`
        assert call in out and f"self._permute_scratch = {call}" not in out
        # With --capture the graph is seen writing it: the fix re-binds its stable storage at the end of that PWAL.
        captured = graphsafe("report", "--capture", "--format", fmt)
        assert f"self._permute_scratch = {call}" in captured.stdout, captured.stderr


def test_report_strict_mode_and_output_file(tmp_path: Path) -> None:
    target = tmp_path / "report.md"
    result = graphsafe("report", "--mode", "strict", "--format", "markdown", "-o", str(target))
    assert result.returncode == 1
    assert result.stdout == ""
    assert "reload failed (mode=strict)" in result.stderr and str(target) in result.stderr
    assert target.read_text().startswith("# graphsafe migration report")


def test_report_on_a_fully_migrated_model_is_empty_and_exits_0() -> None:
    result = graphsafe("report", "graphsafe.cli:migrated_zoo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nothing to migrate" in result.stdout
    assert "reload committed" in result.stderr


def test_report_with_capture_lists_unowned_storage() -> None:
    result = graphsafe("report", "--capture", "--format", "json")
    assert result.returncode == 1
    document = json.loads(result.stdout)
    assert document["summary"]["unowned"] == 2  # the module cache of both module_cache layers


TARGETS = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Linear(nn.Module):
        def __init__(self, declared):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3, 3), requires_grad=False)
            self.declared = declared

        def process_weights_after_loading(self):
            self.w_t = self.weight.t().contiguous()
            if self.declared:
                from graphsafe import register_derived
                register_derived(self, "w_t")


    def _load(model, seed):
        with torch.no_grad():
            model.weight.copy_(torch.randn(3, 3, generator=torch.Generator().manual_seed(seed)))
        model.process_weights_after_loading()


    def _model(declared):
        model = Linear(declared)
        _load(model, 0)
        return model


    class Target:
        def __init__(self, declared):
            self.model = _model(declared)

        def reload(self, model, seed):
            _load(model, seed)


    def legacy():
        return Target(False)


    def migrated():
        return Target(True)


    def as_tuple():
        return (_model(False), _load)


    def not_a_model():
        return ("model", _load)


    def number():
        return 42


    def raises():
        raise RuntimeError("no GPU here\\nsecond line")


    def broken_reload():
        def reload(model, seed):
            raise OSError("checkpoint missing")
        return (_model(False), reload)


    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def targets(tmp_path: Path) -> Path:
    (tmp_path / "mytargets.py").write_text(TARGETS)
    (tmp_path / "broken_import.py").write_text("import does_not_exist_anywhere\n")
    return tmp_path


def test_report_on_a_user_target_object_and_tuple(targets: Path) -> None:
    for spec in ("mytargets:legacy", "mytargets:as_tuple"):
        result = graphsafe("report", spec, "--format", "json", cwd=targets)
        assert result.returncode == 1, result.stderr
        document = json.loads(result.stdout)
        assert [(e["path"], e["drift"], e["owner"]) for e in document["entries"]] == [
            ("w_t", "auto-restored", "mytargets.Linear")
        ]
        assert document["fixes"][0]["lines"] == ['@graph_visible("w_t")']
    clean = graphsafe("report", "mytargets:migrated", cwd=targets)
    assert clean.returncode == 0 and "nothing to migrate" in clean.stdout


BAD_TARGETS = [
    ("mytargets", "not of the form 'module:callable'"),
    (":legacy", "not of the form 'module:callable'"),
    ("nonexistent_pkg_xyz:f", "cannot import module 'nonexistent_pkg_xyz'"),
    ("broken_import:f", "No module named 'does_not_exist_anywhere'"),
    ("mytargets:nope", "has no attribute 'nope'"),
    ("mytargets:NOT_CALLABLE", "type int, which is not callable"),
    ("mytargets:number", "returned int; expected an object with `model`"),
    ("mytargets:not_a_model", "a model of type str, not an nn.Module"),
    ("mytargets:raises", "raised RuntimeError: no GPU here"),
    ("mytargets:broken_reload", "the reload of TARGET 'mytargets:broken_reload' raised OSError"),
]


@pytest.mark.parametrize(("spec", "needle"), [BAD_TARGETS[0], BAD_TARGETS[3], BAD_TARGETS[6], BAD_TARGETS[9]])
def test_bad_targets_exit_2_with_one_sentence(targets: Path, spec: str, needle: str) -> None:
    line = _one_sentence_error(graphsafe("report", spec, cwd=targets))
    assert needle in line


@pytest.mark.parametrize(("spec", "needle"), BAD_TARGETS)
def test_every_bad_target_is_one_sentence_in_process(
    targets: Path, spec: str, needle: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same contract as above for every kind of bad TARGET, through main() (a subprocess each is slow)."""
    monkeypatch.chdir(targets)
    monkeypatch.syspath_prepend(str(targets))
    for name in ("mytargets", "broken_import"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert main(["report", spec]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphsafe: error: ") and needle in lines[0], captured.err
    assert "second line" not in lines[0] and captured.out == ""


def test_unwritable_output_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "-o", str(tmp_path / "missing-dir" / "r.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write the report" in err[0]
