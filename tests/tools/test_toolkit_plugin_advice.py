"""What users touch above the contract: the testing toolkit, the pytest plugin and the vLLM adapter's
reload paths (the vLLM ones are in ``tests/vllm/test_reload_paths.py``).

Each test is a minimal reproduction of one way graphsafe's promise could break, and pins the rule that holds it.
The oracle is independent of graphsafe's reasoning: a layer built cold on the new weights (what the
reloaded layer must hold after its PWAL), and the tensors a captured graph reads.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from graphsafe import GraphContract, graph_visible, record_capture, stable_empty
from graphsafe.cli import main
from graphsafe.report import FixKind, migration_report
from graphsafe.testing import assert_reload_stable
from graphsafe.testing.zoo import EXAMPLES, lazy_scratch

pytest_plugins = ["pytester"]


# ----------------------------------------------------------------------------------------------------------------
# 1. assert_reload_stable's value check cannot tell weights A from weights B for small-magnitude tensors.


class _StaleScaleLinear(nn.Module):
    """An FP8-style per-tensor weight scale (``amax / 448``), refreshed in place by PWAL on every load, but from
    the first checkpoint it ever saw (the bug: a stash, kept as a Python list, that no load updates). The contract
    rightly commits (PWAL wrote the captured tensor in place; design.md: only a cold-built reference can tell the
    values are wrong), so the toolkit's value check is the only thing that can catch it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(64, 64), requires_grad=False)

    @graph_visible("w_scale")
    def process_weights_after_loading(self) -> None:
        if not hasattr(self, "_first"):
            self._first = self.weight.tolist()
            self.w_scale = torch.empty(1)
        self.w_scale.copy_(torch.tensor(self._first).abs().amax().reshape(1) / 448.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() * self.w_scale


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), std=st.sampled_from([2e-2, 1e-2, 1e-3]))
def test_toolkit_value_check_catches_a_stale_small_magnitude_scale(seed: int, std: float) -> None:
    """``assert_reload_stable`` compares what PWAL wrote with a layer built cold on the same weights
    through ``torch.testing.assert_close`` at its default tolerances (float32: ``atol=1e-5``). An FP8 per-tensor
    weight scale of realistic weights (std 0.02: ``amax / 448`` ~ 1.6e-4) differs between two seeds by about
    1e-5 or less, so the scale of weights A passes for the scale of weights B.

    Promise: the toolkit's docstring, "each tracked tensor that this reload's PWAL wrote ... must equal that of a
    second layer built cold on B". Observed: the assertion passes a PWAL whose scale never follows the weights
    (the graph would dequantize every reload with the first checkpoint's scale). Oracle: the cold-built layer's
    ``w_scale`` differs from the reloaded one's (asserted below, independently of the toolkit).
    """

    def load(layer: nn.Module, generator: torch.Generator) -> None:
        layer.weight.copy_(torch.randn(64, 64, generator=generator) * std)
        layer.process_weights_after_loading()

    # The oracle: weights A and B give different scales, so a layer stuck on A's is wrong after A -> B.
    cold = [_StaleScaleLinear() for _ in range(2)]
    with torch.no_grad():
        for offset, layer in enumerate(cold):
            load(layer, torch.Generator().manual_seed(seed + offset))
    assert not torch.equal(cold[0].w_scale, cold[1].w_scale)

    with pytest.raises(AssertionError, match="values differ"):
        assert_reload_stable(_StaleScaleLinear, load, seed=seed)


# ----------------------------------------------------------------------------------------------------------------
# 2. assert_reload_stable never compares a buffer PWAL writes: a PWAL wrong from the second load on passes.


class _CompoundingBuffer(nn.Module):
    """PWAL derives a buffer the checkpoint does not carry, in place, with ``mul_`` where ``copy_`` was meant:
    right after the first load (ones * amax), compounded from the second on (amax_A * amax_B * ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 8), requires_grad=False)
        self.register_buffer("inv_scale", torch.ones(8))

    def process_weights_after_loading(self) -> None:
        self.inv_scale.mul_(self.weight.abs().amax(dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.t()) * self.inv_scale


def _load_compounding(layer: nn.Module, generator: torch.Generator) -> None:
    layer.weight.copy_(torch.randn(8, 8, generator=generator))
    layer.process_weights_after_loading()


def test_toolkit_compares_a_buffer_pwal_writes_with_the_cold_built_layer() -> None:
    """A layer whose PWAL writes a derived buffer in place, wrongly from the second load on. Without
    ``example_input`` (optional), ``assert_reload_stable`` checks parameters and buffers for their address only
    (``state_tensors``) and compares by value only the non-state slots PWAL wrote, so the buffer's values are
    never compared; the contract commits (a buffer is an input, never checked for freshness).

    Promise: the toolkit's docstring, "each tracked tensor that this reload's PWAL wrote ... must equal that of a
    second layer built cold on B". Observed: it passes while the buffer a graph reads holds amax_A * amax_B.
    Oracle: a layer built cold on weights B (seed 1).
    """
    subject, cold = _CompoundingBuffer(), _CompoundingBuffer()
    with torch.no_grad():
        _load_compounding(subject, torch.Generator().manual_seed(0))
        _load_compounding(subject, torch.Generator().manual_seed(1))  # a reload to B
        _load_compounding(cold, torch.Generator().manual_seed(1))
    assert not torch.allclose(subject.inv_scale, cold.inv_scale), "the oracle: the reloaded buffer is wrong"

    with pytest.raises(AssertionError, match="inv_scale"):
        assert_reload_stable(_CompoundingBuffer, _load_compounding)


# ----------------------------------------------------------------------------------------------------------------
# 3. The pytest marker passes a test that never reloaded through the contract it made.

_SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_marker_fails_a_test_whose_contract_saw_no_reload(pytester: pytest.Pytester) -> None:
    """A marked test makes its contract through the fixture, then reloads the model without ``contract.reload()`` (the
    easy slip: the ``with`` forgotten). The legacy layer's PWAL moves its derived tensor, so a captured graph reads the
    old storage, but no reload ran under the contract: no outcome, no finding, and the contract still says serving-safe.

    Promise: docs/making-a-kernel-reload-safe.md: the marker fails a test that made no contract "the marker would
    otherwise check nothing"; a contract that saw no reload checks nothing either. Observed: the test passes.
    Oracle: the test body itself asserts the derived tensor moved.
    """
    pytester.makepyfile(
        test_inner=textwrap.dedent(
            """
            import pytest
            from graphsafe.testing.zoo import EXAMPLES

            EX = EXAMPLES["act_order"]

            @pytest.mark.graphsafe(mode="strict")
            def test_reload_forgot_the_contract(graphsafe_contract):
                model = EX.build("legacy")
                graphsafe_contract(model)
                layer = model.layers[1]
                captured = layer.g_idx_sort_indices.data_ptr()
                EX.load_weights(model, EX.make_weights(model, 1))  # no `with contract.reload():`
                assert layer.g_idx_sort_indices.data_ptr() != captured  # the graph's tensor moved
            """
        )
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", _SRC)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", timeout=240)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*no reload*"])


# ----------------------------------------------------------------------------------------------------------------
# 4. The report's "keep the vanished scratch" fix, pasted literally into a layer's own PWAL, breaks loading.


def test_report_fix_pasted_into_a_layers_own_pwal_keeps_loading_working(monkeypatch: pytest.MonkeyPatch) -> None:
    """The zoo's legacy ``lazy_permute_scratch``: ``PermuteMoE`` has its own PWAL, ``(self)``, which drops
    the scratch the captured forward writes. The report's fix says: at the end of
    ``PermuteMoE.process_weights_after_loading``, paste
    ``layer._permute_scratch = stable_empty(layer, "_permute_scratch", (16, 16), torch.float32, "cpu")``. That
    method has no ``layer``: pasted literally, the very next load raises ``NameError``.

    Promise (3): the report's advice is exact, pasted as printed (docs/migration-report.md: "the exact line that
    declares it"); advice that breaks loading is a bug. Oracle: the pasted layer loads, and a strict contract
    then commits a reload with the captured scratch and ``w_t`` kept at their addresses.
    """
    example = EXAMPLES["lazy_permute_scratch"]
    model = example.build("legacy")
    contract = GraphContract(model, "migrate").seal()
    x = example.example_input(model)
    model(x)  # warm-up: the scratch appears
    with record_capture(contract, ignore=[x]):
        model(x)
    with contract.reload():
        example.load_weights(model, example.make_weights(model, 1))
    report = migration_report(contract)
    pwal = "graphsafe.testing.zoo.lazy_scratch.PermuteMoE.process_weights_after_loading"
    (decorator,) = [f for f in report.fixes if f.kind is FixKind.GRAPH_VISIBLE and f.target == pwal]
    (fix,) = [f for f in report.fixes if f.kind is FixKind.REGISTER_DERIVED and f.target.startswith(pwal)]
    assert "at its end" in fix.target

    # Paste the printed lines on and at the end of that PWAL, literally, and compile it where it is defined.
    source = textwrap.dedent(inspect.getsource(lazy_scratch.PermuteMoE.process_weights_after_loading))
    source = "".join(f"{line}\n" for line in decorator.lines) + source
    source += "".join(f"    {line}\n" for line in fix.lines)
    namespace = {**vars(lazy_scratch), "graph_visible": graph_visible, "stable_empty": stable_empty}
    exec(compile(source, "<pasted fix>", "exec"), namespace)
    monkeypatch.setattr(
        lazy_scratch.PermuteMoE, "process_weights_after_loading", namespace["process_weights_after_loading"]
    )

    pasted = example.build("legacy")  # the first load runs the pasted PWAL
    strict = GraphContract(pasted, "strict").seal()
    pasted(x)
    with record_capture(strict, ignore=[x]):
        pasted(x)
    captured = {i: layer._permute_scratch.data_ptr() for i, layer in enumerate(pasted.layers)}
    with strict.reload():
        example.load_weights(pasted, example.make_weights(pasted, 1))
    assert strict.last_outcome is not None and strict.last_outcome.committed
    assert {i: layer._permute_scratch.data_ptr() for i, layer in enumerate(pasted.layers)} == captured


# ----------------------------------------------------------------------------------------------------------------
# 5. `graphsafe report` on a TARGET whose reload loads nothing advises static=True for a weight-derived tensor.

_NOOP_TARGET = """
import torch
from torch import nn


class Cached(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 8), requires_grad=False)

    def process_weights_after_loading(self):
        if getattr(self, "w_t", None) is None:  # an "already processed" guard: never rebuilt on reload
            self.w_t = self.weight.t().contiguous()

    def forward(self, x):
        return x @ self.w_t


def load(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.weight.copy_(torch.randn(8, 8, generator=generator))
    model.process_weights_after_loading()


def target():
    model = Cached()
    load(model, 0)
    return model, lambda model, seed: None  # the reload forgot to load: nothing changes
"""


def test_cli_report_refuses_a_target_whose_reload_loads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TARGET whose ``reload(model, seed)`` loads nothing (a slip: it loads into another model, or
    returns a lazy loader it never runs). The reload commits with no finding; the report lists ``w_t`` (computed
    from the weight by PWAL, kept by an "already processed" guard) and, since the recorded reload saw PWAL leave
    it alone, advises ``@graph_visible("w_t", static=True)``. Pasted, that exempts ``w_t`` from the freshness
    check: a real reload with new weights then commits ``w_t`` stale.

    Promise (1)/(3): the report's advice must not leave a graph-read tensor unprotected; ``assert_reload_stable``
    refuses the same situation (identical weights) with a clear error. Oracle: ``w_t`` is computed from the
    weight (a cold layer on other weights has another ``w_t``). Expected: a usage error (exit 2, one line) saying
    the reload changed no weight, instead of a report.
    """
    (tmp_path / "noop_target.py").write_text(_NOOP_TARGET)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    status = main(["report", "noop_target:target", "-m", "strict"])
    out, err = capsys.readouterr()
    assert "static=True" not in out, "advice that exempts a weight-derived tensor from the freshness check"
    assert status == 2, (status, err)
    assert len(err.strip().splitlines()) == 1 and "graphsafe: error:" in err


# ----------------------------------------------------------------------------------------------------------------
# 6. `graphsafe report -f json`: a TARGET that prints corrupts the JSON document on stdout.

_PRINTING_TARGET = """
import torch
from torch import nn

print("importing the model package")


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4), requires_grad=False)

    def process_weights_after_loading(self):
        self.w_t = self.weight.t().contiguous()

    def forward(self, x):
        return x @ self.w_t


def load(model, seed):
    print(f"loading weights (seed {seed}) ...")  # what loaders do: progress on stdout
    with torch.no_grad():
        model.weight.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)))
    model.process_weights_after_loading()


def target():
    model = Linear()
    load(model, 0)
    return model, load, lambda model: print("warm-up", model(torch.ones(1, 4)).shape)
"""


def test_cli_report_json_on_stdout_stays_valid_when_the_target_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``graphsafe report TARGET -f json | jq`` with a TARGET whose import, load, reload or warm-up print
    progress to stdout, as model loaders do. The CLI runs the TARGET with stdout as it is, so those lines land in
    front of (and inside) the JSON document.

    Promise: docs/cli.md, "A summary line goes to stderr ..., so stdout carries only the report
    (``--format json | jq`` works)". Observed: stdout is not valid JSON. Oracle: ``json.loads`` of stdout, and the
    document's schema field.
    """
    import json

    (tmp_path / "printing_target.py").write_text(_PRINTING_TARGET)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    status = main(["report", "printing_target:target", "-f", "json", "--capture"])
    out, err = capsys.readouterr()
    assert status == 1, err  # w_t is undeclared
    document = json.loads(out)
    assert document["schema"] == "graphsafe.migration-report/1"
    assert "loading weights" in err  # the TARGET's own output is not lost: it goes to stderr


# ----------------------------------------------------------------------------------------------------------------
# 7. The report's decorator covers only the layers that had an entry, not every layer its PWAL runs for.


class _BiasLinear(nn.Module):
    """One class, two configurations (as in any engine: a bias on some projections only): PWAL derives
    ``bias_t`` where there is a bias."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(4), requires_grad=False) if bias else None

    def process_weights_after_loading(self) -> None:
        if self.bias is not None:
            self.bias_t = (self.bias * 2).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.t()
        return y + self.bias_t if self.bias is not None else y


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_BiasLinear(True), _BiasLinear(False)])


def _load_two(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
        for layer in model.layers:
            layer.process_weights_after_loading()


def test_report_decorator_is_advised_only_for_paths_every_layer_of_its_pwal_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two layers of one class, one with a bias (its PWAL derives ``bias_t``), one without. Only the first
    has an entry, so the report's rule "a decorator for the paths every layer of the PWAL has" is computed over
    that one layer: ``@graph_visible("bias_t")`` on ``_BiasLinear.process_weights_after_loading``. Pasted, the
    decorator raises ``DeclarationError`` at the PWAL of the layer without a bias: loading breaks.

    Promise (3): docs/migration-report.md, "Paths only some of its layers have would make the decorator raise on
    the others; they get register_derived(layer, "path") lines". Oracle: paste every printed fix literally and
    load the model (then a strict reload must commit).
    """
    model = _TwoLinears()
    _load_two(model, 0)
    contract = GraphContract(model, "migrate").seal()
    with contract.reload():
        _load_two(model, 1)
    report = migration_report(contract)
    assert report.fixes, "the undeclared bias_t needs a fix"

    pwal = _BiasLinear.process_weights_after_loading
    for fix in report.fixes:
        assert fix.target.endswith("_BiasLinear.process_weights_after_loading") or "after it assigns" in fix.target
        if fix.kind is FixKind.GRAPH_VISIBLE:
            for line in reversed(fix.lines):
                pwal = eval(line[1:], {"graph_visible": graph_visible})(pwal)
        else:  # register_derived lines, run inside the PWAL after it assigns each path, with ``layer`` bound
            inner = pwal

            def pwal(self: nn.Module, _inner=inner, _lines=fix.lines) -> None:  # type: ignore[no-untyped-def]
                from graphsafe import register_derived

                _inner(self)
                for line in _lines:
                    if hasattr(self, line.split('"')[1]):
                        exec(line, {"register_derived": register_derived}, {"layer": self, "self": self})

    monkeypatch.setattr(_BiasLinear, "process_weights_after_loading", pwal)
    pasted = _TwoLinears()
    _load_two(pasted, 0)  # the first load runs the pasted PWAL on both layers
    strict = GraphContract(pasted, "strict").seal()
    with strict.reload():
        _load_two(pasted, 1)
    assert strict.last_outcome is not None and strict.last_outcome.committed


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
