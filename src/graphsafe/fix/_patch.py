"""From the report's fixes to a patch: which file and class each one edits, the new text of every file, the fixes
left to do by hand, a unified diff, and a write of every file or none."""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from graphsafe.fix._locate import ClassSite, FixError, Unplaceable, locate_class, writable
from graphsafe.report import Fix, Placement

if TYPE_CHECKING:
    from graphsafe.fix._edit import Source

__all__ = ["FileEdit", "Patch", "Unplaced", "propose"]

#: What ``graphsafe fix`` needs and how to get it, for the one-line error when it is missing.
_LIBCST_MISSING = "graphsafe fix needs LibCST to edit source while keeping its formatting: pip install 'graphsafe[fix]'"


@dataclass(frozen=True)
class FileEdit:
    """One source file: its bytes as read and as the fixes would write them."""

    path: Path
    before: bytes
    after: bytes
    encoding: str = "utf-8"

    def diff(self, name: str | None = None) -> str:
        """The unified diff of this file (``name`` in its headers, the path by default)."""
        shown = name if name is not None else str(self.path)
        old = self.before.decode(self.encoding).splitlines(keepends=True)
        new = self.after.decode(self.encoding).splitlines(keepends=True)
        lines = difflib.unified_diff(old, new, f"a/{shown}", f"b/{shown}")
        return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


@dataclass(frozen=True)
class Unplaced:
    """A fix (or some of its paths) left for the author to place, and why."""

    fix: Fix
    paths: tuple[str, ...]
    reason: str

    def describe(self) -> str:
        """Where the report puts the fix and why it was not placed, then the report's lines and note (indented)."""
        lines = [f"  {self.fix.kind.value} in {self.fix.target}: {self.reason}"]
        lines += [f"      {line}" for line in self.fix.lines]
        if self.fix.note:
            lines.append(f"      note: {self.fix.note}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Patch:
    """Every file the fixes change, and the fixes left to do by hand."""

    files: tuple[FileEdit, ...]
    unplaced: tuple[Unplaced, ...]

    @property
    def empty(self) -> bool:
        """Nothing to change and nothing left to do."""
        return not self.files and not self.unplaced

    def diff(self, relative_to: Path | None = None) -> str:
        """One unified diff of every file (paths relative to ``relative_to`` when they are inside it)."""
        base = (relative_to or Path.cwd()).resolve()
        parts = []
        for edit in self.files:
            resolved = edit.path.resolve()
            name = str(resolved.relative_to(base)) if resolved.is_relative_to(base) else str(resolved)
            parts.append(edit.diff(name))
        return "".join(parts)

    def write(self) -> None:
        """Write every file, or none: all are checked first (writable, unchanged since they were read)."""
        for edit in self.files:
            if not writable(edit.path):
                raise FixError(
                    f"{edit.path} is not writable: make it writable (or fix a writable copy); nothing written"
                )
            try:
                current = edit.path.read_bytes()
            except OSError as exc:
                raise FixError(f"cannot read {edit.path} again ({exc.strerror}); nothing written") from exc
            if current != edit.before:
                raise FixError(f"{edit.path} changed since it was read: run graphsafe fix again; nothing written")
        written: list[FileEdit] = []
        try:
            for edit in self.files:
                written.append(edit)
                _overwrite(edit.path, edit.after)
        except OSError as exc:  # a disk error past the checks: put back what was written, then say so
            for edit in written:
                with contextlib.suppress(OSError):
                    _overwrite(edit.path, edit.before)
            raise FixError(
                f"writing {written[-1].path} failed ({exc.strerror or type(exc).__name__}); the files written before "
                "it were put back: nothing written"
            ) from exc


def _overwrite(path: Path, data: bytes) -> None:
    with open(path, "r+b") as handle:  # in place: the file keeps its inode, owner and mode
        handle.write(data)
        handle.truncate()
        handle.flush()
        os.fsync(handle.fileno())


def _split(function: str) -> tuple[str, str]:
    """``module.Class.method`` as ``("module.Class", "method")``."""
    owner, _, method = function.rpartition(".")
    return owner, method


def _load(source_class: type[Source], cache: dict[Path, Source], site: ClassSite) -> Source:
    source = cache.get(site.path)
    if source is None:
        try:
            data = site.path.read_bytes()
        except OSError as exc:
            raise FixError(f"cannot read {site.path} ({exc.strerror}): graphsafe fix needs the source") from exc
        try:
            source = source_class.parse(data)
        except Exception as exc:  # a syntax LibCST cannot parse: leave the file alone, say so
            raise Unplaceable(f"LibCST cannot parse {site.path} ({type(exc).__name__})") from exc
        cache[site.path] = source
    return source


def _apply(source_class: type[Source], cache: dict[Path, Source], fix: Fix) -> list[Unplaced]:
    """Place one fix: the one mapping from a fix's placement to an edit. Returns what it could not place."""
    if fix.placement is Placement.AFTER_ASSIGNMENT and fix.function is None:
        site = locate_class(fix.owner)
        left = _load(source_class, cache, site).after_assignments(site.qualname, None, fix.paths, fix.lines)
    else:
        if fix.function is None:
            raise Unplaceable(f"the report names no function of {fix.owner} to edit")
        owner, method = _split(fix.function)
        site = locate_class(owner)
        source = _load(source_class, cache, site)
        if fix.placement is Placement.DECORATOR:
            source.decorate(site.qualname, method, fix.lines)
            left = []
        elif fix.placement is Placement.FUNCTION_END:
            source.at_end(site.qualname, method, fix.paths, fix.lines)
            left = []
        else:
            left = source.after_assignments(site.qualname, method, fix.paths, fix.lines)
    return [Unplaced(fix, (path,), why) for path, why in left]


def propose(fixes: Iterable[Fix], *, installed: Literal["refuse", "list"] = "refuse") -> Patch:
    """The patch that places ``fixes`` (the report's, in order; a fix repeated, or already in the source, adds
    nothing). Raises :class:`FixError` for a missing LibCST, and for installed code or a source file it cannot
    read unless ``installed="list"``, which lists such a fix in :attr:`Patch.unplaced` instead (a test suite's
    layers may come from installed packages); a fix it cannot place is in :attr:`Patch.unplaced` and changes no
    file."""
    try:
        from graphsafe.fix._edit import Source
    except ImportError as exc:
        raise FixError(_LIBCST_MISSING) from exc
    cache: dict[Path, Source] = {}
    unplaced: list[Unplaced] = []
    for fix in fixes:
        snapshot = {path: source.module for path, source in cache.items()}
        try:
            unplaced += _apply(Source, cache, fix)
        except (Unplaceable, FixError) as why:
            if isinstance(why, FixError) and installed == "refuse":
                raise
            for path, source in cache.items():  # a fix that raises is placed not at all
                source.module = snapshot[path] if path in snapshot else Source.parse(source.original).module
            unplaced.append(Unplaced(fix, fix.paths, str(why)))
    files = tuple(
        FileEdit(path, source.original, source.data, source.encoding)
        for path, source in cache.items()
        if source.data != source.original
    )
    return Patch(files, tuple(unplaced))
