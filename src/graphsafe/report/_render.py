"""Renderings of a :class:`~graphsafe.report.MigrationReport`: text, markdown, JSON, tree and Graphviz dot.

Only JSON carries device addresses (``data_ptr``, for tools); the others never print one, so their output is
stable across runs for the same model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from graphsafe.outcome import FindingKind, SlotRef
from graphsafe.paths import format_token, parse_path
from graphsafe.report._fix_kind import FixKind

if TYPE_CHECKING:
    from graphsafe.report._entries import Fix, MigrationReport, ReportEntry, UnownedEntry

__all__ = ["FORMATS", "dot", "human_bytes", "json_text", "markdown", "render", "text", "tree"]

#: What :meth:`~graphsafe.report.MigrationReport.render` accepts.
FORMATS: Final = ("text", "markdown", "json", "tree", "dot")

_PROBLEM_FILL = "#f4cccc"
_REPAIRED_FILL = "#fce5cd"
_STABLE_FILL = "#d9ead3"
_LAYER_FILL = "#dde6f3"


def human_bytes(n: int) -> str:
    """``128 B``, ``1.5 KiB``, ``2.0 MiB``..."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _shape(shape: Sequence[int] | None) -> str:
    return "?" if shape is None else "[" + ", ".join(str(n) for n in shape) + "]"


def _restorable(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def _layer_name(layer: str) -> str:
    """A layer's qualified name as people read it (``<model>`` for the root; see :class:`SlotRef`)."""
    return str(SlotRef(layer, ""))


def _entry_note(entry: ReportEntry) -> str:
    parts = []
    if entry.shares_storage_with is not None:
        parts.append(f"same storage as {entry.shares_storage_with}")
    if entry.lazy:
        parts.append("not there after PWAL")
    if entry.reason:
        parts.append(entry.reason)
    return "; ".join(parts)


def _headline(report: MigrationReport) -> str:
    if report.clean:
        return "nothing to migrate: no undeclared graph-visible tensor"
    parts = []
    if report.untrackable:
        parts.append(
            f"{len(report.untrackable)} untrackable place(s): device tensors no slot path can name, so no reload of "
            "their layer commits"
        )
    if report.entries:
        parts.append(
            f"{len(report.entries)} undeclared graph-visible tensor(s) in {len(report.layers)} layer(s), "
            f"{human_bytes(report.nbytes)}; {len(report.fixes)} fix(es)"
            + (f", {len(report.undecided)} choice(s) to make" if report.undecided else "")
        )
    if report.unowned:
        parts.append(f"{len(report.unowned)} unowned captured storage(s)")
    return "; ".join(parts)


def _source_line(report: MigrationReport) -> str:
    text = f"source: {report.source}"
    if report.mode is not None:
        text += f" (mode={report.mode})"
    if report.status is not None:
        text += f", last reload: {report.status.value}"
    if report.declared_problems:
        text += f"; {report.declared_problems} problem(s) on declared slots (listed below)"
    return text


def _fix_heading(fix: Fix) -> str:
    if fix.kind is FixKind.GRAPH_VISIBLE:
        return f"@graph_visible on {fix.target}"
    return f"register_derived in {fix.target}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def text(report: MigrationReport) -> str:
    """A terminal rendering: a headline, a table of entries, the grouped fixes, unowned storage, notes."""
    lines = [f"graphsafe migration report: {_headline(report)}", _source_line(report)]
    if report.entries:
        rows = [["LAYER", "CLASS", "PATH", "SHAPE", "DTYPE", "DEVICE", "BYTES", "DRIFT", "RESTORABLE", "NOTE"]]
        for e in report.entries:
            rows.append(
                [
                    _layer_name(e.layer),
                    e.layer_class,
                    e.path,
                    _shape(e.shape),
                    e.dtype,
                    e.device,
                    human_bytes(e.nbytes),
                    e.drift,
                    _restorable(e.restorable),
                    _entry_note(e),
                ]
            )
        lines += ["", *_table(rows)]
    if report.fixes or report.undecided:
        lines += ["", "Fixes, grouped by owner (each covers every layer listed):"]
        for number, fix in enumerate(report.fixes, 1):
            lines.append(f"  [{number}] {_fix_heading(fix)}")
            lines.append(f"      layers: {', '.join(_layer_name(n) for n in fix.layers)}")
            lines += [f"        {line}" for line in fix.lines]
            if fix.note:
                lines.append(f"      note: {fix.note}")
    for number, undecided in enumerate(report.undecided, len(report.fixes) + 1):
        lines.append(f"  [{number}] choose, for {', '.join(undecided.paths)} of {undecided.owner}")
        lines.append(f"      layers: {', '.join(_layer_name(n) for n in undecided.layers)}")
        lines.append(f"      {undecided.reason}:")
        for letter, choice in zip("ab", undecided.choices, strict=False):
            lines.append(f"      ({letter}) if {choice.when}: in {choice.target}")
            lines += [f"        {line}" for line in choice.lines]
    if report.declared:
        lines += ["", "Problems on declared slots (the declaration or the code around it needs a change):"]
        for problem in report.declared:
            where = f"{_layer_name(problem.layer)} ({problem.layer_class})"
            lines.append(f"  - {problem.drift}: {problem.path!r} of {where}: {problem.detail}")
    if report.unowned:
        lines += ["", "Unowned captured storage (a captured graph reads it; no layer path reaches it):"]
        rows = [_unowned_cells(u, human_bytes) for u in report.unowned]
        lines += ["  " + row for row in _table(rows)]
    if report.untrackable:
        lines += ["", "Untrackable (findings: no reload of these layers commits until the code changes):"]
        for u in report.untrackable:
            lines += [f"  - {u.where}: {u.detail}", f"      fix: {u.fix}"]
    if report.notes:
        lines += ["", "Notes:"] + [f"  - {note}" for note in report.notes]
    return "\n".join(lines) + "\n"


def _unowned_cells(unowned: UnownedEntry, size: Callable[[int], str]) -> list[str]:
    """Description, dtype, shape, device and size (``?`` where the manifest did not say)."""
    return [
        unowned.description,
        unowned.dtype or "?",
        _shape(unowned.shape),
        unowned.device or "?",
        size(unowned.nbytes) if unowned.nbytes is not None else "?",
    ]


def _md(cell: str) -> str:
    return cell.replace("|", "\\|")


def markdown(report: MigrationReport) -> str:
    """GitHub-flavoured markdown: a summary, a table of entries, one section per fix with a code block."""
    headline, source = _headline(report), _source_line(report)
    lines = [
        "# graphsafe migration report",
        "",
        headline[:1].upper() + headline[1:] + ".",
        "",
        source[:1].upper() + source[1:] + ".",
    ]
    if report.entries:
        lines += [
            "",
            "## Undeclared graph-visible tensors",
            "",
            "| Layer | Class | Path | Shape | Dtype | Device | Bytes | Drift | Restorable | Note |",
            "|---|---|---|---|---|---|---:|---|---|---|",
        ]
        for e in report.entries:
            cells = [
                f"`{_layer_name(e.layer)}`",
                f"`{e.layer_class}`",
                f"`{e.path}`",
                _shape(e.shape),
                e.dtype,
                e.device,
                str(e.nbytes),
                e.drift,
                _restorable(e.restorable),
                _entry_note(e),
            ]
            lines.append("| " + " | ".join(_md(c) for c in cells) + " |")
    if report.fixes:
        lines += ["", "## Fixes", "", "Grouped by owner: each fix covers every layer it lists."]
        for number, fix in enumerate(report.fixes, 1):
            what = "Decorate" if fix.kind is FixKind.GRAPH_VISIBLE else "Call `register_derived`"
            lines += [
                "",
                f"### {number}. {what}: `{fix.target}`"
                if fix.kind is FixKind.GRAPH_VISIBLE
                else f"### {number}. {what}",
                "",
            ]
            if fix.kind is not FixKind.GRAPH_VISIBLE:
                lines += [f"In {fix.target}.", ""]
            layers = ", ".join(f"`{_layer_name(name)}`" for name in fix.layers)
            lines += [f"Layers: {layers}.", "", "```python", *fix.lines, "```"]
            if fix.note:
                lines += ["", f"Note: {fix.note}."]
    for undecided in report.undecided:
        lines += ["", f"## Choose: `{'`, `'.join(undecided.paths)}` of `{undecided.owner}`", ""]
        layers = ", ".join(f"`{_layer_name(name)}`" for name in undecided.layers)
        lines += [f"Layers: {layers}.", "", f"{undecided.reason}:"]
        for choice in undecided.choices:
            lines += ["", f"- If {choice.when}: in {choice.target}.", "", "  ```python"]
            lines += [f"  {line}" for line in choice.lines] + ["  ```"]
    if report.declared:
        lines += ["", "## Problems on declared slots", ""]
        lines += [
            f"- {p.drift}: `{p.path}` of `{_layer_name(p.layer)}` ({p.layer_class}): {_md(p.detail)}"
            for p in report.declared
        ]
    if report.unowned:
        lines += [
            "",
            "## Unowned captured storage",
            "",
            "| Description | Dtype | Shape | Device | Bytes |",
            "|---|---|---|---|---:|",
        ]
        for u in report.unowned:
            lines.append("| " + " | ".join(_md(c) for c in _unowned_cells(u, str)) + " |")
    if report.untrackable:
        lines += ["", "## Untrackable", "", "No reload of these layers commits until the code changes.", ""]
        lines += [f"- {u.where}: {u.detail}. Fix: {u.fix}." for u in report.untrackable]
    if report.notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in report.notes]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Where the tensors hang: a trie of path tokens per layer.


@dataclass
class _Node:
    name: str
    cls: str | None = None
    entry: ReportEntry | None = None
    children: dict[str, _Node] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.cls})" if self.cls else self.name

    @property
    def dot_label(self) -> str:
        return f"{self.name}\n{self.cls}" if self.cls else self.name


def _layer_tries(report: MigrationReport) -> dict[str, _Node]:
    """A trie of path tokens per layer, keyed by the layer's qualified name, in order of first entry."""
    roots: dict[str, _Node] = {}
    for entry in report.entries:
        root = roots.get(entry.layer)
        if root is None:
            root = roots[entry.layer] = _Node(_layer_name(entry.layer), entry.layer_class)
        tokens = parse_path(entry.path)
        node = root
        for depth, token in enumerate(tokens):
            name = format_token(token, first=True)  # each step on a line of its own: no leading dot
            last = depth == len(tokens) - 1
            cls = entry.via[depth] if not last and depth < len(entry.via) else None
            key = f"{name} ({cls})" if cls else name
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(name, cls)
            node = child
        node.entry = entry
    return roots


def _leaf_text(entry: ReportEntry) -> str:
    text = f"{entry.dtype}{_shape(entry.shape)} {entry.device}, {human_bytes(entry.nbytes)}, {entry.drift}"
    if entry.shares_storage_with is not None:
        text += f" (same storage as {entry.shares_storage_with})"
    return text


def tree(report: MigrationReport) -> str:
    """A text tree per layer: layer -> quant_method -> kernel -> workspace, leaves with dtype, shape and drift."""
    if not report.entries:
        return f"({_headline(report)})\n"
    lines: list[str] = []

    def walk(node: _Node, prefix: str) -> None:
        children = list(node.children.values())
        for index, child in enumerate(children):
            last = index == len(children) - 1
            label = child.label if child.entry is None else f"{child.label}: {_leaf_text(child.entry)}"
            lines.append(f"{prefix}{'└── ' if last else '├── '}{label}")
            walk(child, prefix + ("    " if last else "│   "))

    for root in _layer_tries(report).values():
        lines.append(root.label)
        walk(root, "")
    return "\n".join(lines) + "\n"


def _dot_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _fill(entry: ReportEntry) -> str:
    if entry.drift_kind is FindingKind.AUTO_RESTORED:
        return _REPAIRED_FILL
    return _PROBLEM_FILL if entry.problem else _STABLE_FILL


def dot(report: MigrationReport) -> str:
    """Graphviz: layers, the objects on each path and the tensors (filled by drift), fixes as notes."""
    lines = [
        "digraph migration_report {",
        "  rankdir=LR;",
        '  node [shape=box, fontname="monospace", fontsize=10];',
        f"  label={_dot_string('graphsafe migration report: ' + _headline(report))};",
        "  labelloc=t;",
    ]
    ids: dict[int, str] = {}
    layer_ids: dict[str, str] = {}

    def node_id(node: _Node) -> str:
        if id(node) not in ids:
            ids[id(node)] = f"n{len(ids)}"
        return ids[id(node)]

    def emit(node: _Node) -> None:
        for child in node.children.values():
            cid = node_id(child)
            if child.entry is None:
                lines.append(f"  {cid} [label={_dot_string(child.dot_label)}];")
            else:
                entry = child.entry
                label = f"{child.name}\n{entry.dtype}{_shape(entry.shape)} {human_bytes(entry.nbytes)}\n{entry.drift}"
                lines.append(
                    f"  {cid} [shape=ellipse, style=filled, fillcolor={_dot_string(_fill(entry))}, "
                    f"label={_dot_string(label)}];"
                )
            lines.append(f"  {node_id(node)} -> {cid};")
            emit(child)

    for layer, root in _layer_tries(report).items():
        rid = node_id(root)
        layer_ids[layer] = rid
        fill, label = _dot_string(_LAYER_FILL), _dot_string(root.dot_label)
        lines.append(f"  {rid} [style=filled, fillcolor={fill}, label={label}];")
        emit(root)
    for number, fix in enumerate(report.fixes):
        fid = f"fix{number}"
        label = "\n".join(fix.lines) + "\n" + ("on " if fix.kind is FixKind.GRAPH_VISIBLE else "in ") + fix.target
        lines.append(f"  {fid} [shape=note, label={_dot_string(label)}];")
        for layer in fix.layers:
            target = layer_ids.get(layer)
            if target is not None:
                lines.append(f"  {fid} -> {target} [style=dashed, arrowhead=none];")
    for number, unowned in enumerate(report.unowned):
        label = f"unowned: {unowned.description}\n{unowned.dtype or '?'}{_shape(unowned.shape)}"
        lines.append(
            f"  u{number} [shape=box3d, style=filled, fillcolor={_dot_string(_PROBLEM_FILL)}, "
            f"label={_dot_string(label)}];"
        )
    lines.append("}")
    return "\n".join(lines) + "\n"


def json_text(report: MigrationReport) -> str:
    """The JSON document (:meth:`~graphsafe.report.MigrationReport.to_dict`), indented."""
    return json.dumps(report.to_dict(), indent=2) + "\n"


_RENDERERS: Final[dict[str, Callable[[MigrationReport], str]]] = {
    "text": text,
    "markdown": markdown,
    "json": json_text,
    "tree": tree,
    "dot": dot,
}


def render(report: MigrationReport, fmt: str) -> str:
    """``report`` in one of :data:`FORMATS`; raises ``ValueError`` naming the choices for any other."""
    renderer = _RENDERERS.get(fmt)
    if renderer is None:
        raise ValueError(f"unknown report format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return renderer(report)
