"""``assert_reload_stable``: a CPU unit test that a layer's PWAL keeps every graph-visible tensor in place.

The check is differential. One layer (the *subject*) is loaded with weights A (the load recorded, so the contract
knows what PWAL makes and writes) and sealed under a :class:`~graphsafe.GraphContract` right after, where an engine
seals; given an example input it is then warmed up (lazy scratch appears here) and run once under the capture
manifest, as an engine would capture it. It is then reloaded B, A, B, A... under the contract. After every reload:

* **addresses**: the contract must commit, and, independently of its verdict, every sealed slot, every slot
  declared during the warm-up (``stable_empty``), every parameter and buffer and every storage the forward read
  must still be where it was sealed;
* **values**, like with like (every side right after a load and its PWAL, before any forward): each tracked
  tensor that this reload's PWAL wrote (a new tensor at its path, or its version counter moved), and each
  parameter and buffer the reload wrote, must equal that of a second layer built cold on B (after A -> B), or
  what the subject held right after its first load of A (after B -> A). Tensors PWAL leaves alone (scratch) are
  address-checked only. The forward output after the reload must equal the cold layer's after the same warm-up.

A failure raises ``AssertionError`` whose message is the migration report of the subject (the same report, and
the same fixes, as ``graphsafe report``) plus the reload's outcome and the address or value checks that failed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphsafe.collectors import Manifest, record_capture
from graphsafe.contract import MODES, GraphContract, Mode, version_of
from graphsafe.errors import ContractViolation
from graphsafe.outcome import FindingKind, Fingerprint, Origin, ReloadOutcome, SlotInfo, SlotRef, Status, fingerprint
from graphsafe.paths import SlotPath
from graphsafe.registry import declarations_of
from graphsafe.report import AliasEntry, MigrationReport, migration_report

__all__ = ["ExampleInput", "LoadWeights", "MakeLayer", "ReloadUnstable", "StabilityResult", "assert_reload_stable"]

#: Builds one layer (or model) with its parameters allocated but not loaded; called once per layer the check needs.
MakeLayer = Callable[[], nn.Module]
#: Fills every parameter of the layer from the generator (deterministically), then runs the layer's PWAL.
LoadWeights = Callable[[nn.Module, torch.Generator], None]
#: A forward input, or a function of the loaded layer that returns one.
ExampleInput = torch.Tensor | Callable[[nn.Module], torch.Tensor]

_CAPTURE = "assert_reload_stable"


@dataclass(frozen=True, slots=True)
class StabilityResult:
    """What a passing :func:`assert_reload_stable` checked (so a test can tell it did not check nothing)."""

    #: One outcome per reload, in order (``2 * reloads`` of them, all committed).
    outcomes: tuple[ReloadOutcome, ...]
    #: ``layer:path`` of every sealed slot whose address was checked (declared, aliases and walker-found;
    #: parameters and buffers are counted in :attr:`state_tensors`).
    slots: tuple[str, ...]
    #: ``layer:path`` of the derived tensors compared by value with the cold-built layer.
    compared: tuple[str, ...]
    #: Parameters and buffers whose addresses were checked.
    state_tensors: int
    #: Storages the example forward read (the capture manifest), whose addresses were checked.
    manifest_storages: int
    #: Whether the forward output was compared too.
    output_compared: bool
    #: Paths restored with the slot whose storage they share (a view of a weight): nothing to declare. The same
    #: answer the seal and the migration report give (:func:`graphsafe.collectors.classify`).
    aliases: tuple[AliasEntry, ...] = ()


class ReloadUnstable(AssertionError):
    """What :func:`assert_reload_stable` raises: an ``AssertionError`` whose message is the migration report plus
    the failed checks, carrying the report itself (the same one, with the same fixes, as ``graphsafe report``) and
    the reload's outcome, for tools that apply the fixes."""

    def __init__(self, message: str, report: MigrationReport, outcome: ReloadOutcome) -> None:
        super().__init__(message)
        self.report = report
        self.outcome = outcome


ReloadUnstable.__module__ = "graphsafe.testing"  # its public home: tracebacks and reprs name that one


@dataclass(frozen=True, slots=True)
class _Tracked:
    """A sealed slot plus whether its contents are compared by value (not for static scratch)."""

    info: SlotInfo
    compare: bool

    @property
    def where(self) -> str:
        return self.info.where


def assert_reload_stable(
    make_layer: MakeLayer,
    load_weights: LoadWeights,
    *,
    mode: Mode = "strict",
    reloads: int = 2,
    seed: int = 0,
    example_input: ExampleInput | None = None,
) -> StabilityResult:
    """Assert that reloading weights keeps every graph-visible tensor of a layer at its address, with new values.

    Args:
        make_layer: ``() -> nn.Module``: a new layer (or a whole model) with parameters allocated, not loaded.
            Called two or three times; every call must build the same structure.
        load_weights: ``(layer, generator) -> None``: fill every parameter from ``generator`` (same generator
            state, same values; a different seed must give different values) and run the layer's
            ``process_weights_after_loading``, the way the serving engine loads. It runs under ``torch.no_grad()``.
        mode: the contract's mode. ``"strict"``: every graph-visible tensor must be declared or kept in place;
            ``"migrate"`` also accepts undeclared tensors the contract can restore itself.
        reloads: how many A -> B -> A cycles to run (at least 1).
        seed: weights A come from ``torch.Generator().manual_seed(seed)``, weights B from ``seed + 1``.
        example_input: a tensor, or ``layer -> tensor``. When given, a warm-up forward runs after the seal
            (allocating lazy scratch, as in an engine), one forward runs under the capture manifest (so the
            storages it reads are checked too) and the output after every reload is compared.

    Returns:
        What was checked; the assertion passed.

    Raises:
        AssertionError: an address moved, the contract did not commit, or a value differs from the cold-built
            reference. The message is the migration report plus the outcome and the failed checks.
        ValueError: ``load_weights`` gave the same parameters for both seeds (a same-weights reload would hide
            stale derived tensors), or an argument is invalid.
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the report, not this module's frames
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    if reloads < 1:
        raise ValueError(f"reloads must be at least 1, got {reloads}")
    with torch.no_grad():
        return _Check(make_layer, load_weights, mode, seed, example_input).run(reloads)


class _Check:
    """The state of one :func:`assert_reload_stable` call."""

    def __init__(
        self,
        make_layer: MakeLayer,
        load_weights: LoadWeights,
        mode: Mode,
        seed: int,
        example_input: ExampleInput | None,
    ) -> None:
        self.make_layer = make_layer
        self.load_weights = load_weights
        self.mode: Mode = mode
        self.seeds = {"A": seed, "B": seed + 1}
        self.example_input = example_input
        self.outcomes: list[ReloadOutcome] = []
        self.name = "layer"  # the subject's class name, once built
        self.written: set[str] = set()  # tracked slots some reload's PWAL wrote (compared by value)

    # -- setup ---------------------------------------------------------------------------------------------------
    def _new_layer(self) -> nn.Module:
        layer = self.make_layer()
        if not isinstance(layer, nn.Module):
            raise TypeError(f"make_layer() must return an nn.Module, got {type(layer).__name__}")
        return layer

    def _load(self, layer: nn.Module, weights: str) -> None:
        self.load_weights(layer, torch.Generator().manual_seed(self.seeds[weights]))

    def _build(self, weights: str) -> nn.Module:
        layer = self._new_layer()
        self._load(layer, weights)
        return layer

    def _input(self, layer: nn.Module) -> torch.Tensor | None:
        given = self.example_input
        if given is None or isinstance(given, torch.Tensor):
            return given
        made = given(layer)
        if not isinstance(made, torch.Tensor):
            raise TypeError(f"example_input(layer) must return a tensor, got {type(made).__name__}")
        return made

    def run(self, reloads: int) -> StabilityResult:
        __tracebackhide__ = True
        subject = self._new_layer()
        self.name = type(subject).__name__
        contract = GraphContract(subject, self.mode, detect="every-reload")
        # The first load is recorded: what its PWAL made or wrote follows the weights, anything else (scratch made
        # in __init__ or by a forward) does not; the contract's freshness checks and the report's static advice
        # both read this recording.
        with contract.record_inputs():
            self._load(subject, "A")
        # Seal where an engine seals: right after the first load and its PWAL, before the warm-up and the capture.
        # What the warm-up allocates (lazy scratch) is then known not to come from PWAL, and the capture manifest
        # checks its storage.
        contract.seal()
        # Parameters and buffers are address-checked on their own (``state``), whether the seal tracks them or not.
        tracked = [
            _Tracked(info, _compare_by_value(contract, info)) for info in contract.slots() if not info.origin.is_state
        ]
        state = _state_fingerprints(subject)
        # Values are compared like with like: every side right after a load and its PWAL, before any forward (a
        # forward may write scratch); the forward outputs after the same warm-up.
        first_values: dict[str, torch.Tensor | None] = {
            t.where: _resolve(contract, t.info).clone() for t in tracked if t.compare
        }
        # Parameters and buffers too: a buffer PWAL derives in place is graph-visible like any derived tensor.
        first_state = _state_values(subject)
        x = self._input(subject)
        first_output: torch.Tensor | None = None
        if x is not None:
            subject(x)  # warm-up: lazily allocated scratch appears here, as in an engine
            with record_capture(contract, name=_CAPTURE, ignore=[x]):
                first_output = _output(subject(x))
            # Declared during the warm-up (stable_empty scratch): address-checked from now on, as the contract
            # adopts them at the next reload; static ones are never compared by value.
            tracked += [_Tracked(info, _compare_by_value(contract, info)) for info in _late_declared(subject, tracked)]

        reference = self._build("B")
        _require_different_weights(subject, reference, self.seeds)
        expected_b: dict[str, torch.Tensor | None] = {
            t.where: _clone_or_none(_resolve_on(reference, t.info)) for t in tracked if t.compare
        }
        expected_b_state = _state_values(reference)
        reference_output: torch.Tensor | None = None
        if x is not None:
            reference(x)  # the same warm-up the subject had
            reference_output = _output(reference(x))

        count = 0
        for _ in range(reloads):
            for weights, values, state_values, output in (
                ("B", expected_b, expected_b_state, reference_output),
                ("A", first_values, first_state, first_output),
            ):
                count += 1
                step = f"reload {count} of {2 * reloads} (weights -> {weights}, seed {self.seeds[weights]})"
                outcome, written, written_state = self._reload(contract, subject, weights, step, tracked)
                moved = _address_problems(contract, tracked, subject, state)
                if outcome.status is not Status.COMMITTED or moved:
                    raise self._failure(contract, step, outcome, moved, [])
                # Only what this reload's PWAL wrote (rebuilt, or wrote in place) follows the weights; a tensor it
                # left alone is scratch, whose bytes no load defines (the contract checks its freshness).
                mismatches = _value_problems(contract, [t for t in tracked if t.where in written], values, weights)
                mismatches += _state_problems(subject, written_state, state_values, weights)
                if x is not None and output is not None:
                    mismatches += _compare("forward output", _output(subject(x)), output, weights)
                if mismatches:
                    raise self._failure(contract, step, outcome, [], mismatches)
        manifest = contract.manifest
        return StabilityResult(
            outcomes=tuple(self.outcomes),
            slots=tuple(t.where for t in tracked),
            compared=tuple(t.where for t in tracked if t.compare and t.where in self.written),
            state_tensors=len(state),
            manifest_storages=len(manifest.storages()) if isinstance(manifest, Manifest) else 0,
            output_compared=x is not None,
            aliases=migration_report(contract).aliases,
        )

    # -- one reload ----------------------------------------------------------------------------------------------
    def _reload(
        self, contract: GraphContract, subject: nn.Module, weights: str, step: str, tracked: list[_Tracked]
    ) -> tuple[ReloadOutcome, set[str], set[str]]:
        """One reload under the contract; returns its outcome, the tracked slots its PWAL wrote (a new tensor
        at the path, or the old one written in place: its version counter moved or its bytes changed), as seen
        before the contract's restore, and the parameters and buffers the reload wrote (by name)."""
        generator = torch.Generator().manual_seed(self.seeds[weights])
        before = {t.where: _version_of(_resolve_on(subject, t.info)) for t in tracked if t.compare}
        # A write through ``.data``, or to an inference tensor, moves no version counter: its bytes tell.
        bytes_before = {t.where: _clone_or_none(_resolve_on(subject, t.info)) for t in tracked if t.compare}
        state_before = {
            name: (_version_of(t), t.clone()) for name, t in _state(subject).items() if t.device.type != "meta"
        }
        written: set[str] = set()
        written_state: set[str] = set()
        txn = contract.reload()
        try:
            with txn:
                self.load_weights(subject, generator)
                for t in tracked:
                    if t.where not in before:
                        continue
                    now = _resolve_on(subject, t.info)
                    if _version_of(now) != before[t.where] or not _same_bytes(bytes_before[t.where], now):
                        written.add(t.where)
                state_now = _state(subject)
                for name, (version, value) in state_before.items():
                    now = state_now.get(name)
                    if _version_of(now) != version or not _same_bytes(value, now):
                        written_state.add(name)
        except ContractViolation:  # strict mode raises on any finding; the outcome is the verdict
            if txn.outcome is None:
                raise
        except Exception as exc:
            exc.add_note(f"graphsafe: raised by load_weights during {step} under the contract")
            raise
        outcome = txn.outcome
        assert outcome is not None  # a finished transaction always records one
        self.outcomes.append(outcome)
        self.written |= written
        return outcome, written, written_state

    # -- the failure message -------------------------------------------------------------------------------------
    def _failure(
        self, contract: GraphContract, step: str, outcome: ReloadOutcome, moved: list[_Moved], mismatches: list[str]
    ) -> ReloadUnstable:
        report = migration_report(contract)
        return ReloadUnstable(self._message(report, step, outcome, moved, mismatches), report, outcome)

    def _message(
        self, report: MigrationReport, step: str, outcome: ReloadOutcome, moved: list[_Moved], mismatches: list[str]
    ) -> str:
        what = _headline(outcome, moved, mismatches)
        lines = [f"assert_reload_stable({self.name}, mode={self.mode!r}): {step} {what}.", ""]
        lines.append(report.render("text").rstrip("\n"))
        lines += ["", "Outcome of the reload:", outcome.summary()]
        # The outcome already lists what the contract found; show only what the independent checks add.
        reported = {(f.layer, f.path) for f in outcome.problems}
        extra = [m for m in moved if (m.layer, m.path) not in reported]
        if extra:
            lines += ["", "Address checks that failed beyond the contract's findings:"]
            lines += [f"  - {m.text}" for m in extra]
            if outcome.status is Status.COMMITTED:
                lines.append(
                    "  The contract committed this reload: it does not see storage that no tracked path holds, nor "
                    "parameters and buffers the seal skipped (on a device outside `devices`, or on meta). Any other "
                    "line above is a graphsafe bug: please report it."
                )
        if mismatches:
            lines += ["", "Value checks that failed:"]
            lines += [f"  - {line}" for line in mismatches]
            lines += [
                "",
                "A derived tensor that keeps its address but not its value was not rebuilt from the new weights "
                "(PWAL skipped it, or wrote it somewhere the graph does not read). Rebuild it in PWAL; declare "
                "scratch whose contents do not depend on the weights with stable_empty(...) or static=True.",
            ]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Helpers.

#: Findings that say a graph-visible tensor is no longer at (or no longer fits) its captured storage.
_ADDRESS_KINDS = frozenset(
    {
        FindingKind.MOVED,
        FindingKind.VANISHED,
        FindingKind.RESPECIFIED,
        FindingKind.DEAD,
        FindingKind.ALIAS_BROKEN,
        FindingKind.ORPHANED,
    }
)


def _headline(outcome: ReloadOutcome, moved: list[_Moved], mismatches: list[str]) -> str:
    """What went wrong, in the failure's first line: the problems this reload really had, worst first."""
    if mismatches:
        return "kept the addresses, but the values differ from a layer built cold on the same weights"
    kinds = [f.kind for f in outcome.problems]
    parts: list[str] = []
    if FindingKind.RELOAD_ERROR in kinds:
        parts.append("raised while loading the weights")
    if moved or _ADDRESS_KINDS.intersection(kinds):
        parts.append("did not keep every graph-visible tensor at its captured address")
    if stale := kinds.count(FindingKind.STALE):
        parts.append(
            f"left {stale} graph-visible tensor(s) at the captured address with stale values (not rebuilt from "
            "the new weights)"
        )
    if FindingKind.UNTRACKABLE in kinds or FindingKind.BUDGET_EXHAUSTED in kinds:
        parts.append("reached graph-visible tensors it cannot track")
    return "; ".join(parts) or f"ended {outcome.status.value}"


def _late_declared(model: nn.Module, tracked: list[_Tracked]) -> list[SlotInfo]:
    """Declared slots the seal did not see (declared after it, by a forward): fingerprinted now."""
    known = {t.where for t in tracked}
    late: list[SlotInfo] = []
    for qualname, layer in model.named_modules():
        for path, declaration in declarations_of(layer).items():
            value = SlotPath(path).resolve_or(layer, None)
            if not isinstance(value, torch.Tensor) or str(SlotRef(qualname, path)) in known:
                continue
            info = SlotInfo(
                qualname,
                type(layer).__name__,
                path,
                Origin.DECLARED,
                fingerprint(value),
                True,
                None,
                declaration.source,
            )
            late.append(info)
    return late


class _Version:
    """Which tensor object is at a path and how often it was written in place. Held by identity and a weak
    reference to its storage, never a weak reference to the tensor (``torch.utils.swap_tensors``, which a loader
    may use, refuses a tensor that has one), and never strongly (that would change what the contract sees)."""

    __slots__ = ("ident", "impl", "storage", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ident = id(tensor)
        self.impl = tensor._cdata  # a swap keeps the object and changes this
        try:
            self.storage: weakref.ReferenceType[Any] | None = weakref.ref(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError, TypeError):  # no storage of its own (a wrapper, sparse)
            self.storage = None
        self.version = version_of(tensor)  # -1 for an inference tensor, which counts no writes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Version):
            return NotImplemented
        if self.storage is None or other.storage is None:
            return False
        storage = self.storage()
        return (
            (self.ident, self.impl, self.version) == (other.ident, other.impl, other.version)
            and storage is not None
            and storage is other.storage()
        )

    __hash__ = None  # type: ignore[assignment]


def _version_of(tensor: torch.Tensor | None) -> _Version | None:
    """``None`` where no tensor is at the path."""
    return None if tensor is None else _Version(tensor)


def _clone_or_none(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


def _same_bytes(before: torch.Tensor | None, now: torch.Tensor | None) -> bool:
    """Same dtype, shape and bytes (NaNs compare equal to themselves; -0.0 and 0.0 differ)."""
    if before is None or now is None:
        return before is None and now is None
    if before.dtype != now.dtype or before.shape != now.shape or before.device != now.device:
        return False
    try:
        return torch.equal(before.reshape(-1).view(torch.uint8), now.reshape(-1).view(torch.uint8))
    except RuntimeError:  # a dtype with no byte view: compare values
        return torch.equal(before, now)


def _output(value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"the layer's forward must return a tensor to be compared, got {type(value).__name__}")
    return value.clone()


def _layer_of(model: nn.Module, qualname: str) -> nn.Module | None:
    try:
        return model.get_submodule(qualname) if qualname else model
    except AttributeError:
        return None


def _compare_by_value(contract: GraphContract, info: SlotInfo) -> bool:
    """Static declared slots (``stable_empty`` scratch) hold contents no reload defines: address-checked only."""
    layer = _layer_of(contract.model, info.layer)
    declaration = declarations_of(layer).get(info.path) if layer is not None else None
    return declaration is None or not declaration.static


def _resolve(contract: GraphContract, info: SlotInfo) -> torch.Tensor:
    value = _resolve_on(contract.model, info)
    if value is None:
        raise AssertionError(f"{info.where} was sealed but does not resolve right after")
    return value


def _resolve_on(model: nn.Module, info: SlotInfo) -> torch.Tensor | None:
    layer = _layer_of(model, info.layer)
    value = SlotPath(info.path).resolve_or(layer, None) if layer is not None else None
    return value if isinstance(value, torch.Tensor) else None


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name (graph-visible too: a loader that replaces one moves it)."""
    return dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])


def _state_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name, cloned (right after a load and its PWAL)."""
    return {name: tensor.clone() for name, tensor in _state(model).items() if tensor.device.type != "meta"}


def _state_problems(
    subject: nn.Module, written: set[str], expected: dict[str, torch.Tensor], weights: str
) -> list[str]:
    """Parameters and buffers the reload wrote (the loader, or PWAL in place) against the same on the reference."""
    now = _state(subject)
    problems: list[str] = []
    for name in sorted(written):
        want = expected.get(name)
        if want is None:
            problems.append(f"{name} (parameter/buffer): the layer built cold on weights {weights} has none")
        elif name in now:
            problems += _compare(f"{name} (parameter/buffer)", now[name], want, weights)
    return problems


def _state_fingerprints(model: nn.Module) -> dict[str, Fingerprint]:
    return {name: fingerprint(tensor) for name, tensor in _state(model).items() if tensor.device.type != "meta"}


def _require_different_weights(subject: nn.Module, reference: nn.Module, seeds: dict[str, int]) -> None:
    ours = dict(subject.named_parameters())
    theirs = dict(reference.named_parameters())
    if ours.keys() != theirs.keys():
        raise ValueError(
            f"make_layer() built different structures on two calls (parameters {sorted(ours)} vs {sorted(theirs)})"
        )
    if ours and all(torch.equal(ours[name], theirs[name]) for name in ours):
        raise ValueError(
            f"load_weights gave identical parameters for seeds {seeds['A']} and {seeds['B']}: fill them from the "
            "generator it is given (a same-weights reload cannot reveal a derived tensor that was not rebuilt)"
        )


@dataclass(frozen=True, slots=True)
class _Moved:
    """One failed address check: the slot (``layer``, ``path``) and what happened to it."""

    layer: str
    path: str
    text: str


def _moved(before: Fingerprint, now: torch.Tensor | None) -> str | None:
    if now is None:
        return f"no longer resolves to a tensor (sealed {before.describe()})"
    after = fingerprint(now)
    if not before.same_storage(after) or after.data_ptr != before.data_ptr:
        return f"moved from {before.describe()} to {after.describe()}"
    if after.key != before.key:
        return f"same storage, new layout: {before.describe()} -> {after.describe()}"
    return None


def _address_problems(
    contract: GraphContract, tracked: list[_Tracked], subject: nn.Module, state: dict[str, Fingerprint]
) -> list[_Moved]:
    problems: list[_Moved] = []
    for t in tracked:
        problem = _moved(t.info.fingerprint, _resolve_on(subject, t.info))
        if problem is not None:
            problems.append(_Moved(t.info.layer, t.info.path, f"{t.where} ({t.info.origin.value}): {problem}"))
    now = _state(subject)
    for name, before in state.items():
        problem = _moved(before, now.get(name))
        if problem is not None:
            layer, _, path = name.rpartition(".")
            problems.append(_Moved(layer, path, f"{name} (parameter/buffer): {problem}"))
    manifest = contract.manifest
    if isinstance(manifest, Manifest):
        problems.extend(_manifest_problems(manifest, subject))
    return problems


def _manifest_problems(manifest: Manifest, subject: nn.Module) -> list[_Moved]:
    problems: list[_Moved] = []
    for entry in manifest.storages():
        storage = entry.storage_ref()
        first = entry.holders[0] if entry.holders else None
        if storage is None:
            problem = "freed: the graph would read freed memory"
        elif storage.data_ptr() != entry.data_ptr:
            problem = f"now at @0x{storage.data_ptr():x}"
        elif entry.holders and not any(_holds(subject, h.layer, h.slot_path, storage) for h in entry.holders):
            problem = "no longer held at any of those paths"
        else:
            continue
        problems.append(
            _Moved(first.layer if first else "", first.path if first else "", f"{entry.describe()}: {problem}")
        )
    return problems


def _holds(subject: nn.Module, qualname: str, slot: SlotPath, storage: object) -> bool:
    layer = _layer_of(subject, qualname)
    value = slot.resolve_or(layer, None) if layer is not None else None
    return isinstance(value, torch.Tensor) and value.untyped_storage() is storage


def _value_problems(
    contract: GraphContract, tracked: list[_Tracked], expected: dict[str, torch.Tensor | None], weights: str
) -> list[str]:
    problems: list[str] = []
    for t in tracked:
        if not t.compare:
            continue
        want = expected.get(t.where)
        if want is None:
            problems.append(f"{t.where}: the layer built cold on weights {weights} has no tensor at this path")
            continue
        problems += _compare(t.where, _resolve(contract, t.info), want, weights)
    return problems


#: torch.testing's default relative tolerance per floating dtype (its absolute one is 1e-5 for all of them).
_RTOL = {
    torch.float16: 1e-3,
    torch.bfloat16: 1.6e-2,
    torch.float32: 1.3e-6,
    torch.float64: 1e-7,
    torch.complex64: 1.3e-6,
    torch.complex128: 1e-7,
}


def _compare(what: str, actual: torch.Tensor, expected: torch.Tensor, weights: str) -> list[str]:
    """Exact for integers; floats within torch's default dtype tolerances (kernels may round differently when
    the same values sit at another alignment), far tighter than the gap between two seeds' weights. The absolute
    tolerance (1e-5) is scaled down to a tensor smaller than 1: an FP8 scale of 1e-4 differs between two seeds by
    about 1e-5, so a fixed 1e-5 would pass the other weights' scale."""
    rtol = _RTOL.get(expected.dtype)
    atol: float | None = None
    if rtol is not None and expected.numel() and expected.device.type != "meta":
        atol = 1e-5 * min(1.0, float(expected.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()))
    try:
        if atol is None:  # integers (exact) and dtypes torch picks its own tolerances for
            torch.testing.assert_close(actual, expected, equal_nan=True, check_device=True)
        else:
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True, check_device=True)
    except AssertionError as exc:
        detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        return [f"{what}: differs from weights {weights}: {detail}"]
    return []
