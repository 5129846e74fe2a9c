"""Every fix the toolkit prints, applied literally to every legacy zoo example, makes the assertion pass.

The toolkit's failure carries the migration report (:class:`graphsafe.testing.ReloadUnstable`): the same report and
the same fix generator as ``graphsafe report``. Each fix is applied the way its target says, from its printed lines
only: ``@graph_visible(...)`` lines are evaluated and stacked on the PWAL the fix names; ``register_derived`` and
``stable_empty`` lines run with ``layer`` bound, after that PWAL returns ("after it assigns each path", "at its
end") or right after the forward that allocates the path (lazy tensors).
"""

from __future__ import annotations

import pydoc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from graphsafe import graph_visible, register_derived, stable_empty
from graphsafe.paths import SlotPath
from graphsafe.report import FixKind, MigrationReport
from graphsafe.testing import ReloadUnstable, assert_reload_stable
from graphsafe.testing.zoo import EXAMPLES, Example, ZooModel

_NAMESPACE = {"graph_visible": graph_visible, "register_derived": register_derived, "stable_empty": stable_empty}
_LAZY = "right after the code that assigns each path"


def _protocol(example: Example) -> tuple[Callable[[], nn.Module], Callable[[nn.Module, torch.Generator], None]]:
    def make_layer() -> nn.Module:
        return ZooModel([example.make_layer("legacy", torch.device("cpu")) for _ in range(2)])

    def load_weights(model: nn.Module, generator: torch.Generator) -> None:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        example.load_weights(model, example.make_weights(model, seed))

    return make_layer, load_weights


def _run_lines(paths: tuple[str, ...], lines: tuple[str, ...], layer: nn.Module) -> None:
    """Each line of a fix (one per path), for the paths this layer has (a fix may cover only some layers)."""
    for path, line in zip(paths, lines, strict=True):
        if line.startswith(("layer.", "self.")) or isinstance(SlotPath(path).resolve_or(layer, None), torch.Tensor):
            # A fix for the layer's own code names it `self`; one for a quant method's `(self, layer)`, `layer`.
            exec(line, dict(_NAMESPACE, torch=torch), {"layer": layer, "self": layer})


class _Applied:
    """The fixes applied so far: PWAL patches (on the classes, through monkeypatch) and forward hooks (lazy)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.decorators: dict[str, list[str]] = {}  # PWAL qualname -> @graph_visible lines
        self.after_pwal: dict[str, list[tuple[tuple[str, ...], tuple[str, ...]]]] = {}
        self.lazy: list[tuple[frozenset[str], tuple[str, ...], tuple[str, ...]]] = []
        self.originals: dict[str, Any] = {}

    def add(self, report: MigrationReport) -> int:
        """Apply every fix of ``report``; returns how many."""
        for fix in report.fixes:
            if fix.kind is FixKind.GRAPH_VISIBLE:
                self.decorators.setdefault(fix.target, []).extend(fix.lines)
            elif _LAZY in fix.target:
                self.lazy.append((frozenset(fix.layers), fix.paths, fix.lines))
            else:
                pwal = fix.target.split(",")[0]
                assert pydoc.locate(pwal) is not None, f"the fix names no PWAL to edit: {fix.target}"
                self.after_pwal.setdefault(pwal, []).append((fix.paths, fix.lines))
        for pwal in {*self.decorators, *self.after_pwal}:
            self._patch(pwal)
        return len(report.fixes)

    def _patch(self, pwal: str) -> None:
        owner_name, _, attribute = pwal.rpartition(".")
        owner = pydoc.locate(owner_name)
        assert isinstance(owner, type), pwal
        original = self.originals.setdefault(pwal, owner.__dict__[attribute])
        function = original
        for line in reversed(self.decorators.get(pwal, [])):  # stacked decorators apply bottom-up
            function = eval(line.removeprefix("@"), dict(_NAMESPACE))(function)
        after = list(self.after_pwal.get(pwal, []))

        def patched(self_: Any, *args: Any, **kwargs: Any) -> Any:
            result = function(self_, *args, **kwargs)
            layer = args[0] if args and isinstance(args[0], nn.Module) else self_
            for paths, lines in after:
                _run_lines(paths, lines, layer)
            return result

        self.monkeypatch.setattr(owner, attribute, patched)

    def make_layer(self, make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        lazy = list(self.lazy)

        def build() -> nn.Module:
            model = make()
            for qualname, module in model.named_modules():
                for layers, paths, lines in lazy:
                    if qualname in layers:
                        module.register_forward_hook(lambda m, _i, _o, p=paths, li=lines: _run_lines(p, li, m))
            return model

        return build


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_printed_fix_applied_literally_makes_the_zoo_example_pass(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = EXAMPLES[name]
    make_layer, load_weights = _protocol(example)
    applied = _Applied(monkeypatch)
    rounds = 0
    while True:
        try:
            result = assert_reload_stable(
                applied.make_layer(make_layer), load_weights, example_input=example.example_input
            )
            break
        except ReloadUnstable as failure:
            report = failure.report
            if not report.fixes:
                # Nothing to declare: what is left is storage no path reaches (a module-level cache), which the
                # report lists as unowned with what to change, not as a line to add.
                assert name == "module_cache" and report.unowned, str(failure)
                return
            rounds += 1
            assert rounds <= 2, f"the fixes of round {rounds - 1} did not hold:\n{failure}"
            applied.add(report)
    assert rounds >= 1  # the legacy example failed before its fixes
    assert all(outcome.committed for outcome in result.outcomes)
