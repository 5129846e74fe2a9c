"""``graphsafe fix`` on kernels written here, not taken from the zoo: a quant method whose PWAL is stacked under
other decorators and calls a helper, with a workspace its ``apply()`` creates lazily; a layer whose PWAL already
declares part of what it makes. After ``--write`` a strict contract commits three reloads with new weights and the
captured graph replays their output; a second run proposes nothing; only the meant lines changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fix.workdir import Workdir, only_meant_lines
from graphsafe import GraphContract, Status, capture, run_reload

KERNELS = '''"""Kernels of a serving stack, one of them half migrated."""

from __future__ import annotations

import functools

import torch
from torch import nn

from graphsafe import graph_visible

HIDDEN = 8
TOKENS = 4


def traced(fn):
    """The stack's own decorator (it keeps the signature, as functools.wraps does)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class FoldedMethod:
    """Quant method: PWAL folds the scale in (through a helper); apply() makes its workspace on first use."""

    def _fold(self, layer):
        # the folded weight, laid out (in, out)
        layer.w_folded = (layer.weight * layer.scale[:, None]).t().contiguous()

    @traced
    @torch.no_grad()
    def process_weights_after_loading(self, layer):
        self._fold(layer)
        layer.workspace = None  # the next apply() makes it again

    def apply(self, layer, x):
        if layer.workspace is None:
            layer.workspace = torch.zeros(TOKENS, HIDDEN, device=x.device)  # the kernel writes it every call
        torch.matmul(x, layer.w_folded, out=layer.workspace)
        return layer.workspace.relu()


class FoldedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(HIDDEN, HIDDEN), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(HIDDEN), requires_grad=False)
        self.workspace = None
        self.quant_method = FoldedMethod()

    def forward(self, x):
        return self.quant_method.apply(self, x)


class ScaledLinear(nn.Module):
    """Half migrated: w_t is declared, the inverse scale it also makes is not."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(HIDDEN, HIDDEN), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(HIDDEN), requires_grad=False)
        self.scratch = None

    @graph_visible("w_t")
    def process_weights_after_loading(self):
        self.w_t = self.weight.t().contiguous()
        self.inv_scale = 1.0 / self.scale  # a new tensor on every load

    def forward(self, x):
        if self.scratch is None:
            self.scratch = torch.empty(TOKENS, HIDDEN, device=x.device)
        torch.mul(x, self.inv_scale, out=self.scratch)
        return self.scratch @ self.w_t
'''

TARGET = """
import torch
from torch import nn

import kernels


def build(seed):
    model = nn.Sequential(kernels.FoldedLinear(), kernels.ScaledLinear())
    load(model, seed)
    return model


def load(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = torch.rand(param.shape, generator=generator) + 0.5
            param.copy_(value if name.endswith("scale") else value - 1.0)
        for layer in model:
            method = getattr(layer, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(layer)
            else:
                layer.process_weights_after_loading()


def x():
    return torch.randn(kernels.TOKENS, kernels.HIDDEN, generator=torch.Generator().manual_seed(7))


def target():
    def warmup(model):
        with torch.no_grad():
            model(x())

    return build(0), load, warmup
"""


def strict_three_reloads(target: object) -> None:
    build, load, x = (getattr(target, name) for name in ("build", "load", "x"))
    model: nn.Module = build(0)
    contract = GraphContract(model, "strict")
    graph = capture(contract, model, x())
    for seed in (1, 2, 3):
        outcome = run_reload(contract, lambda seed=seed: load(model, seed))
        assert outcome.status is Status.COMMITTED, outcome.summary()
        with torch.no_grad():
            assert torch.equal(graph.replay(), build(seed)(x()))


def test_kernels_written_outside_the_zoo_are_migrated(workdir: Workdir) -> None:
    file = workdir.write("kernels", KERNELS)
    workdir.write("target", TARGET)
    with pytest.raises(Exception, match="undeclared"):
        strict_three_reloads(workdir.fresh("target"))

    run = workdir.graphsafe("fix", "--write", "target:target")
    assert run.status == 1, run.err
    strict_three_reloads(workdir.fresh("target"))
    after = file.read_text(encoding="utf-8")
    added = only_meant_lines(
        KERNELS,
        after,
        lambda line: (
            line
            in (
                '@graph_visible("w_folded")',
                'layer.workspace = stable_empty(layer, "workspace", (4, 8), torch.float32, "cpu")',
                '@graph_visible("w_t", "inv_scale")',
                'register_derived(self, "scratch", static=True)',
                "from graphsafe import graph_visible, register_derived, stable_empty",
            )
        ),
    )
    assert len(added) == 5, added
    # The decorator goes innermost (it sees PWAL's own signature); the workspace PWAL drops is kept at its end;
    # the scratch forward() makes is declared right after it is made, inside the if; one import, merged.
    assert (
        '    @torch.no_grad()\n    @graph_visible("w_folded")\n    def process_weights_after_loading(self, layer):'
        in after
    )
    assert (
        "        layer.workspace = None  # the next apply() makes it again\n"
        '        layer.workspace = stable_empty(layer, "workspace", (4, 8), torch.float32, "cpu")\n\n'
        "    def apply(self, layer, x):\n"
    ) in after
    assert (
        "            self.scratch = torch.empty(TOKENS, HIDDEN, device=x.device)\n"
        '            register_derived(self, "scratch", static=True)\n'
    ) in after
    assert after.count("from graphsafe import") == 1

    again = workdir.graphsafe("fix", "target:target")
    assert (again.status, again.out) == (0, ""), again.err
