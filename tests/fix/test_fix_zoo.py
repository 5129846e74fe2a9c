"""``graphsafe fix --write`` on every legacy kernel of the zoo, copied out as a module of its own.

The fixed source must pass the check the hand-migrated zoo passes (strict contract, captured graph, three reloads
with new weights each time: every one commits and the graph replays the new weights' output), a second run must
propose nothing, and every line the fix changed must be one of the report's fix lines (or the graphsafe import
or decorator it merged into): the rest of the file stays byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from fix.workdir import Workdir, only_meant_lines
from graphsafe import GraphContract, Status, capture, run_reload
from graphsafe.testing.zoo import EXAMPLES, Example

#: Zoo examples whose legacy form holds every derived tensor at a path the report can name (module_cache's legacy
#: form keeps its tensor where no path reaches: ``unreachable``; only its migrated form holds it at a layer path).
NAMED = [name for name, example in EXAMPLES.items() if example.slot_paths and example.unreachable is None]

TARGET = """
import torch

from graphsafe.cli import ReloadTarget

import {module} as subject


def target():
    example = subject.EXAMPLE
    model = example.build("legacy", seed=0)

    def reload(model, seed):
        example.load_weights(model, example.make_weights(model, seed))

    def warmup(model):
        with torch.no_grad():
            example.forward(model, example.example_input(model))

    return ReloadTarget(model, reload, warmup)
"""


def copy_legacy(workdir: Workdir, name: str) -> tuple[Path, str]:
    """The zoo module of ``name`` as ``legacy_NAME.py`` in the work directory, with a TARGET module for it."""
    module = sys.modules[EXAMPLES[name].make_layer.__module__]
    assert module.__file__ is not None
    text = Path(module.__file__).read_text(encoding="utf-8")
    file = workdir.write(f"legacy_{name}", text)
    workdir.write(f"target_{name}", TARGET.format(module=f"legacy_{name}"))
    return file, f"target_{name}:target"


def strict_three_reloads(example: Example) -> None:
    """The hand-migrated zoo's check: a strict contract and a captured graph, three reloads with new weights;
    each commits and the graph then replays what a model built cold on those weights computes."""
    model = example.build("legacy", seed=0)
    x = example.example_input(model)
    contract = GraphContract(model, "strict")
    graph = capture(contract, model, x)
    for seed in (1, 2, 3):
        outcome = run_reload(contract, lambda seed=seed: example.load_weights(model, example.make_weights(model, seed)))
        assert outcome.status is Status.COMMITTED, outcome.summary()
        cold = example.build("legacy", seed=seed)
        with torch.no_grad():
            assert torch.equal(graph.replay(), cold(x))


def fix_lines(workdir: Workdir, target: str) -> set[str]:
    """Every line of every fix in the report ``graphsafe report`` makes for ``target`` (the same report)."""
    run = workdir.graphsafe("report", "--capture", "-f", "json", target)
    assert run.status == 1, run.err
    return {line for fix in json.loads(run.out)["fixes"] for line in fix["lines"]}


@pytest.mark.parametrize("name", NAMED)
def test_fixed_legacy_kernel_commits_three_strict_reloads(workdir: Workdir, name: str) -> None:
    file, target = copy_legacy(workdir, name)
    before = file.read_text(encoding="utf-8")
    with pytest.raises(Exception, match="undeclared"):  # the legacy source fails the check: the test can fail
        strict_three_reloads(workdir.fresh(f"legacy_{name}").EXAMPLE)
    meant = fix_lines(workdir, target)

    proposed = workdir.graphsafe("fix", target)
    assert proposed.status == 1, proposed.err
    assert file.read_text(encoding="utf-8") == before  # a diff only
    assert f"+++ b/legacy_{name}.py" in proposed.out

    written = workdir.graphsafe("fix", "--write", target)
    assert written.status == 1, written.err
    after = file.read_text(encoding="utf-8")
    added = only_meant_lines(
        before, after, lambda line: line in meant or line.startswith(("@graph_visible(", "from graphsafe import"))
    )
    assert added
    assert written.out == proposed.out  # --write writes the diff it shows

    strict_three_reloads(workdir.fresh(f"legacy_{name}").EXAMPLE)

    again = workdir.graphsafe("fix", target)
    assert (again.status, again.out) == (0, ""), again.err
    assert file.read_text(encoding="utf-8") == after


def test_a_tensor_no_path_reaches_is_listed_not_guessed(workdir: Workdir) -> None:
    """module_cache: the graph reads a tensor only a module-level dict holds. No line of code declares it (its
    migrated form writes into the cached tensor in place), so fix changes nothing and lists the unowned storage."""
    file, target = copy_legacy(workdir, "module_cache")
    before = file.read_bytes()
    run = workdir.graphsafe("fix", "--write", target)
    assert (run.status, run.out) == (1, "")
    assert "left to place by hand" in run.err and "unowned captured storage" in run.err
    assert file.read_bytes() == before
