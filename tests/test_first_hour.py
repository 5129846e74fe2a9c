"""A new user's first hour: bad input gets a clear one-line error that says what to do."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn

import graphsafe
from graphsafe import DeclarationError, GraphContract, GraphSafeError, graph_visible, register_derived, stable_empty

ROOT = Path(__file__).resolve().parents[1]


def test_a_collected_model_says_the_contract_holds_it_weakly() -> None:
    def load_model() -> nn.Module:
        return nn.Linear(2, 2)

    contract = GraphContract(load_model())  # nothing else holds the model
    with pytest.raises(GraphSafeError, match="holds its model weakly") as raised:
        contract.seal()
    assert "keep a reference to the model" in str(raised.value)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_static_must_be_a_bool(value: object) -> None:
    with pytest.raises(DeclarationError, match=r"static must be True or False, got"):
        graph_visible("w", static=value)  # type: ignore[arg-type]
    layer = nn.Linear(2, 2)
    layer.w = torch.zeros(2)
    with pytest.raises(DeclarationError, match=r"register_derived\(Linear, 'w'\): static must be True or False"):
        register_derived(layer, "w", static=value)  # type: ignore[arg-type]


def test_stable_empty_names_a_string_dtype() -> None:
    with pytest.raises(DeclarationError, match=r"stable_empty\(Linear, 's'\): dtype must be a torch.dtype") as e:
        stable_empty(nn.Linear(2, 2), "s", (2,), "float32", "cpu")  # type: ignore[arg-type]
    assert "'float32'" in str(e.value) and "\n" not in str(e.value)


def test_a_reload_before_seal_says_to_seal_and_nothing_about_recapture() -> None:
    model = nn.Linear(2, 2)
    contract = GraphContract(model, "strict")
    with pytest.raises(graphsafe.NotServingSafeError) as raised, contract.reload():
        pass
    message = str(raised.value)
    assert "call seal() after the first load" in message and "\n" not in message
    assert "recapture" not in message and "reseal" not in message, message


def test_the_mode_error_says_what_to_use_instead() -> None:
    with pytest.raises(ValueError, match="unknown mode 'warn'") as raised:
        GraphContract(nn.Linear(2, 2), "warn")  # type: ignore[arg-type]
    message = str(raised.value)
    assert "no mode only warns" not in message and "migration_report" in message and "graphsafe report" in message


def test_dir_of_graphsafe_lists_only_its_api() -> None:
    public = [name for name in dir(graphsafe) if not name.startswith("__")]
    assert not [name for name in public if name.startswith("_") or name in {"Any", "importlib", "TYPE_CHECKING"}]
    assert set(public) >= {"GraphContract", "graph_visible", "stable_empty", "migration_report"}


def test_docs_reference_only_files_in_the_repo_and_no_private_module() -> None:
    """ARCHITECTURE.md was referenced but not in the repo; docs/cli.md documented a private module."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#:]+\.md)", text):
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
        assert "ARCHITECTURE.md" not in text or (ROOT / "ARCHITECTURE.md").exists(), doc.name
    cli = (ROOT / "docs" / "cli.md").read_text()
    assert not re.findall(r"graphsafe(?:\.\w+)*\._\w+", cli), "docs/cli.md names a private module"


def test_the_readme_installs_from_a_checkout_with_the_cpu_torch_line_first() -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install") : readme.index("## Quick start")]
    commands = [line.split("#")[0].strip() for line in install.splitlines() if line.startswith("pip install")]
    assert commands[:3] == [
        "pip install torch --index-url https://download.pytorch.org/whl/cpu",
        "pip install .",
        "pip install '.[vllm]'",
    ], commands
    released = install.index("Once released")
    assert "pip install graphsafe" not in install[:released], "the published name only once released"
    for line in ("make demo", "make test"):
        assert line in install, line


def test_make_demo_installs_torch_from_an_index_it_names() -> None:
    """An unnamed index gives Linux the CUDA build of torch (several GB) where the README promises the CPU one."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_INDEX \?= https://download\.pytorch\.org/whl/cpu$", makefile, flags=re.M)
    torch_install = [line for line in makefile.splitlines() if "pip install" in line and "$(TORCH_SPEC)" in line]
    assert torch_install and all("--index-url '$(TORCH_INDEX)'" in line for line in torch_install), torch_install


def test_numpy_is_a_dependency_because_torch_warns_on_import_without_it() -> None:
    """torch's CPU wheels do not require numpy but print a two-line "Failed to initialize NumPy" warning on import
    without it; graphsafe depends on numpy so that a clean install imports quietly."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"numpy\b", dependency) for dependency in dependencies), dependencies


@pytest.mark.parametrize(
    "argv",
    [
        ["-c", "import graphsafe; graphsafe.GraphContract; graphsafe.migration_report; graphsafe.capture"],
        ["-m", "graphsafe", "--help"],
    ],
    ids=["import", "cli-help"],
)
def test_importing_graphsafe_and_running_the_cli_print_nothing_on_stderr(argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr


def test_a_failed_reload_with_undeclared_moves_still_says_to_declare_them() -> None:
    """A stale declared slot fails the reload; the undeclared tensor that moved beside it still needs declaring, and
    the error says so (the stale slot must not hide that hint)."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 4), requires_grad=False)

        def process_weights_after_loading(self) -> None:
            self.w_t = self.weight.t().contiguous()  # undeclared, new at every load
            if not hasattr(self, "g"):
                self.g = self.weight * 2  # declared, built at the first load only: stale at the next
                register_derived(self, "g")

    def load(model: Mixed, seed: int) -> None:
        with torch.no_grad():
            model.weight.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)))
            model.process_weights_after_loading()

    model = Mixed()
    load(model, 0)
    contract = GraphContract(model, "strict").seal()
    with pytest.raises(graphsafe.ReloadFailedError) as raised, contract.reload():
        load(model, 1)
    message = str(raised.value)
    assert "stale: declared slot 'g'" in message and "moved: undeclared slot 'w_t'" in message
    assert "Declare them with @graph_visible(...) or register_derived(...)" in message, message
