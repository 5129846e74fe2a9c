"""The source edits of ``graphsafe fix``, on a LibCST tree: formatting and comments outside the edited lines stay
byte for byte.

Three edits, one per :class:`~graphsafe.report.Placement`: a ``@graph_visible`` decorator on a method (merged into
one already there), statements right after the statements that assign a path, statements at the end of a method.
Each also adds the names the lines call to the module's ``from graphsafe import ...`` (once). A path the class
already declares (a ``graph_visible`` decorator, a ``register_derived`` / ``stable_empty`` / ``declare`` call
naming it) is never declared again, which is what makes a second run propose nothing. Code the edits do not
understand (a class defined under an ``if``, a one-line block, a method that returns early) raises
:class:`Unplaceable` and is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import libcst as cst

from graphsafe.fix._locate import Unplaceable
from graphsafe.paths import Attr, SlotPath

__all__ = ["Source"]

#: The names of graphsafe's public face a fix's lines may call, and those whose second argument is a slot path.
_GRAPHSAFE_NAMES = ("graph_visible", "register_derived", "stable_empty", "declare")
_DECLARING = frozenset({"register_derived", "stable_empty", "declare"})


def _callee(call: cst.Call) -> str | None:
    """``f`` for ``f(...)`` and ``mod.f(...)``."""
    if isinstance(call.func, cst.Name):
        return call.func.value
    if isinstance(call.func, cst.Attribute):
        return call.func.attr.value
    return None


def _string(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def _dotted(node: cst.BaseExpression) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else ``None``."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def _graph_visible_call(decorator: cst.Decorator) -> cst.Call | None:
    node = decorator.decorator
    return node if isinstance(node, cst.Call) and _callee(node) == "graph_visible" else None


def _is_static(call: cst.Call) -> bool:
    return any(
        arg.keyword is not None
        and arg.keyword.value == "static"
        and isinstance(arg.value, cst.Name)
        and arg.value.value == "True"
        for arg in call.args
    )


def _positional(call: cst.Call) -> list[cst.Arg]:
    return [arg for arg in call.args if arg.keyword is None and not arg.star]


class _Declared(cst.CSTVisitor):
    """Every slot path a piece of code declares: ``graph_visible`` arguments, and the path argument of
    ``register_derived``, ``stable_empty`` and ``declare`` calls."""

    def __init__(self) -> None:
        self.paths: set[str] = set()

    def visit_Call(self, node: cst.Call) -> None:
        name = _callee(node)
        positional = _positional(node)
        if name == "graph_visible":
            self.paths.update(p for p in (_string(a.value) for a in positional) if p is not None)
        elif name in _DECLARING and len(positional) >= 2:
            path = _string(positional[1].value)
            if path is not None:
                self.paths.add(path)


def _declared(node: cst.CSTNode) -> set[str]:
    visitor = _Declared()
    node.visit(visitor)
    return visitor.paths


class _Names(cst.CSTVisitor):
    """The graphsafe names a fix's lines call, and whether they use ``torch.``."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Name) and node.func.value in _GRAPHSAFE_NAMES:
            self.names.append(node.func.value)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if isinstance(node.value, cst.Name) and node.value.value == "torch":
            self.names.append("torch")


def _needed_names(nodes: Sequence[cst.CSTNode]) -> list[str]:
    visitor = _Names()
    for node in nodes:
        node.visit(visitor)
    return list(dict.fromkeys(visitor.names))


def _receiver(statement: cst.CSTNode) -> str | None:
    """The first argument of the first graphsafe call of a line: the name the line uses for the layer."""

    class Find(cst.CSTVisitor):
        found: str | None = None

        def visit_Call(self, node: cst.Call) -> None:
            if self.found is None and _callee(node) in _GRAPHSAFE_NAMES and node.args:
                first = node.args[0].value
                if isinstance(first, cst.Name):
                    self.found = first.value

    finder = Find()
    statement.visit(finder)
    return finder.found


def _params(function: cst.FunctionDef) -> set[str]:
    params = function.params
    every = [*params.posonly_params, *params.params, *params.kwonly_params]
    return {p.name.value for p in every}


def _body(node: cst.ClassDef | cst.FunctionDef) -> Sequence[cst.BaseStatement]:
    if not isinstance(node.body, cst.IndentedBlock):
        raise Unplaceable(f"{node.name.value} is written on one line")
    return node.body.body


def _only(candidates: list[cst.ClassDef] | list[cst.FunctionDef], what: str) -> cst.ClassDef | cst.FunctionDef:
    if len(candidates) != 1:
        where = "no" if not candidates else f"{len(candidates)}"
        raise Unplaceable(f"{where} definition(s) of {what} at the top of its block (one is needed to edit)")
    return candidates[0]


class _Assignments(cst.CSTVisitor):
    """Statement lines of one function (not of functions or classes nested in it) that assign one of
    ``spellings``; assignments in one-line blocks are counted apart."""

    def __init__(self, root: cst.FunctionDef, spellings: set[str]) -> None:
        self.root = root
        self.spellings = spellings
        self.lines: list[cst.SimpleStatementLine] = []
        self.in_suite = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return node is self.root

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def _assigns(self, statements: Sequence[cst.BaseSmallStatement]) -> bool:
        for small in statements:
            targets: list[cst.BaseExpression] = []
            value = getattr(small, "value", None)
            if isinstance(value, cst.Name) and value.value == "None":
                continue  # clears the path (``self.x = None``): nothing to declare there
            if isinstance(small, cst.Assign):
                for target in small.targets:
                    node = target.target
                    targets += [e.value for e in node.elements] if isinstance(node, cst.Tuple | cst.List) else [node]
            elif isinstance(small, cst.AnnAssign) and small.value is not None:
                targets.append(small.target)
            if any(_dotted(t) in self.spellings for t in targets):
                return True
        return False

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        if self._assigns(node.body):
            self.lines.append(node)

    def visit_SimpleStatementSuite(self, node: cst.SimpleStatementSuite) -> None:
        if self._assigns(node.body):
            self.in_suite += 1


class _InsertAfter(cst.CSTTransformer):
    """Insert ``statement`` after each of ``targets`` (statement lines of the original tree)."""

    def __init__(self, targets: list[cst.SimpleStatementLine], statement: cst.BaseStatement) -> None:
        self.targets = targets
        self.statement = statement

    def _spliced(
        self, original: Sequence[cst.BaseStatement], updated: Sequence[cst.BaseStatement]
    ) -> list[cst.BaseStatement]:
        body: list[cst.BaseStatement] = []
        for before, after in zip(original, updated, strict=True):
            body.append(after)
            if any(before is target for target in self.targets):
                body.append(self.statement)
        return body

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        return updated_node.with_changes(body=self._spliced(original_node.body, updated_node.body))


def _plain_attributes(path: str) -> bool:
    tokens = SlotPath(path).tokens
    return all(isinstance(token, Attr) for token in tokens)


@dataclass
class Source:
    """One source file's tree, edited fix by fix; :attr:`text` is the file as it would be written."""

    module: cst.Module
    #: The file's bytes as read.
    original: bytes

    @classmethod
    def parse(cls, data: bytes) -> Source:
        return cls(cst.parse_module(data), data)

    @property
    def data(self) -> bytes:
        return self.module.bytes

    @property
    def encoding(self) -> str:
        return self.module.encoding

    # -- finding the code ----------------------------------------------------------------------------------------
    def _class(self, qualname: Sequence[str]) -> cst.ClassDef:
        body: Sequence[cst.BaseStatement] = self.module.body
        found: cst.ClassDef | None = None
        for depth, part in enumerate(qualname):
            what = ".".join(qualname[: depth + 1])
            only = _only([s for s in body if isinstance(s, cst.ClassDef) and s.name.value == part], f"class {what}")
            assert isinstance(only, cst.ClassDef)
            found, body = only, _body(only)
        if found is None:
            raise Unplaceable("no class to edit")
        return found

    def _methods(self, cls: cst.ClassDef) -> list[cst.FunctionDef]:
        return [s for s in _body(cls) if isinstance(s, cst.FunctionDef)]

    def _method(self, cls: cst.ClassDef, name: str) -> cst.FunctionDef:
        found = _only([m for m in self._methods(cls) if m.name.value == name], f"{cls.name.value}.{name}")
        assert isinstance(found, cst.FunctionDef)
        return found

    def _replace(self, old: cst.CSTNode, new: cst.CSTNode) -> None:
        replaced = self.module.deep_replace(old, new)
        assert isinstance(replaced, cst.Module)
        self.module = replaced

    # -- the three edits -----------------------------------------------------------------------------------------
    def decorate(self, qualname: Sequence[str], method: str, lines: Sequence[str]) -> None:
        """Put each ``@graph_visible(...)`` line on the method, merged into one of the same ``static`` already
        there; paths the class already declares are left out."""
        cls = self._class(qualname)
        function = self._method(cls, method)
        declared = _declared(cls)
        needed: list[cst.CSTNode] = []
        for line in lines:
            wanted = cst.parse_statement(f"{line}\ndef _(): pass\n")
            assert isinstance(wanted, cst.FunctionDef) and len(wanted.decorators) == 1
            decorator = wanted.decorators[0]
            call = _graph_visible_call(decorator)
            if call is None:
                raise Unplaceable(f"the line {line!r} is not a graph_visible decorator")
            new = [arg for arg in _positional(call) if _string(arg.value) not in declared]
            if not new:
                continue
            declared.update(p for p in (_string(a.value) for a in new) if p is not None)
            needed.append(decorator)
            static = _is_static(call)
            same = [
                d for d in function.decorators if (c := _graph_visible_call(d)) is not None and _is_static(c) == static
            ]
            if same:
                existing = _graph_visible_call(same[0])
                assert existing is not None
                # After its last positional argument, before its keywords (a default comma is written as needed).
                cut = max((i + 1 for i, a in enumerate(existing.args) if a.keyword is None and not a.star), default=0)
                added = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in new]
                args = [*existing.args[:cut], *added, *existing.args[cut:]]
                merged = same[0].with_changes(decorator=existing.with_changes(args=args))
                decorators = [merged if d is same[0] else d for d in function.decorators]
            else:
                keywords = [a for a in call.args if a.keyword is not None]
                fresh = decorator.with_changes(decorator=call.with_changes(args=[*new, *keywords]))
                decorators = [*function.decorators, fresh]  # innermost: it sees the method's own signature
            updated = function.with_changes(decorators=decorators)
            self._replace(function, updated)
            cls = self._class(qualname)
            function = self._method(cls, method)
        self._import(_needed_names(needed))

    def after_assignments(
        self, qualname: Sequence[str], method: str | None, paths: Sequence[str], lines: Sequence[str]
    ) -> list[tuple[str, str]]:
        """Each line (one per path) right after every statement that assigns its path: in ``method`` (then in
        the class's other methods, the helpers it calls) or, without one, in any method of the class. Returns
        ``(path, why)`` for the paths it could not place."""
        if len(paths) != len(lines):
            raise Unplaceable(f"{len(lines)} line(s) for {len(paths)} path(s): no line per path")
        left: list[tuple[str, str]] = []
        needed: list[cst.CSTNode] = []
        for path, line in zip(paths, lines, strict=True):
            cls = self._class(qualname)
            if path in _declared(cls):
                continue
            statement = cst.parse_statement(line)
            try:
                targets = self._assigning(cls, method, path, _receiver(statement))
            except Unplaceable as why:
                left.append((path, str(why)))
                continue
            self.module = self.module.visit(_InsertAfter(targets, statement))
            needed.append(statement)
        self._import(_needed_names(needed))
        return left

    def _assigning(
        self, cls: cst.ClassDef, method: str | None, path: str, receiver: str | None
    ) -> list[cst.SimpleStatementLine]:
        if receiver is None:
            raise Unplaceable("the line names no layer to declare on")
        if not _plain_attributes(path):
            raise Unplaceable(f"{path} is not a plain attribute chain, so no assignment spells it")
        methods = self._methods(cls)
        if method is not None:
            first = self._method(cls, method)
            groups = [[first], [m for m in methods if m is not first]]
        else:
            groups = [methods]
        suites = 0
        for group in groups:
            found: list[cst.SimpleStatementLine] = []
            for function in group:
                params = _params(function)
                if receiver not in params:
                    continue  # the line could not name the layer there
                spellings = {f"{receiver}.{path}"}
                head, _, rest = path.partition(".")
                if receiver != "self" and head == "quant_method" and rest and "self" in params:
                    spellings.add(f"self.{rest}")  # in a quant method, self is layer.quant_method
                visitor = _Assignments(function, spellings)
                function.visit(visitor)
                found += visitor.lines
                suites += visitor.in_suite
            if found:
                return found
        if suites:
            raise Unplaceable(f"{path} is assigned in a one-line block (no line to insert after)")
        raise Unplaceable(
            f"no statement that assigns {receiver}.{path} in a method of {cls.name.value} taking {receiver}"
        )

    def at_end(self, qualname: Sequence[str], method: str, paths: Sequence[str], lines: Sequence[str]) -> None:
        """The lines (one per path) at the end of the method, but those whose path the class already declares."""
        cls = self._class(qualname)
        function = self._method(cls, method)
        declared = _declared(cls)
        if len(paths) != len(lines):
            raise Unplaceable(f"{len(lines)} line(s) for {len(paths)} path(s): no line per path")
        statements = [
            cst.parse_statement(line) for path, line in zip(paths, lines, strict=True) if path not in declared
        ]
        if not statements:
            return
        if any(True for _ in _returns(function)):
            raise Unplaceable(f"{method} has a return statement, so its end is not the one place it finishes")
        params = _params(function)
        for statement in statements:
            receiver = _receiver(statement)
            if receiver is None or receiver not in params:
                raise Unplaceable(f"{method} has no parameter {receiver!r}, which the lines use for the layer")
        body = _body(function)
        assert isinstance(function.body, cst.IndentedBlock)
        self._replace(function, function.with_changes(body=function.body.with_changes(body=[*body, *statements])))
        self._import(_needed_names(statements))

    # -- imports -------------------------------------------------------------------------------------------------
    def _bound(self) -> set[str]:
        """Names bound by the module's top-level imports."""
        names: set[str] = set()
        for statement in self.module.body:
            if not isinstance(statement, cst.SimpleStatementLine):
                continue
            for small in statement.body:
                if isinstance(small, cst.Import):
                    for alias in small.names:
                        names.add(_alias_name(alias, first=True))
                elif isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                    names.update(_alias_name(alias) for alias in small.names)
        return names

    def _import(self, names: Sequence[str]) -> None:
        missing = [n for n in names if n not in self._bound()]
        if "torch" in missing:
            self._insert_import(cst.parse_statement("import torch\n"))
        wanted = [n for n in missing if n in _GRAPHSAFE_NAMES]
        if not wanted:
            return
        existing = self._graphsafe_import()
        if existing is None:
            self._insert_import(cst.parse_statement(f"from graphsafe import {', '.join(sorted(wanted))}\n"))
            return
        line, statement = existing
        assert not isinstance(statement.names, cst.ImportStar)
        aliases = list(statement.names)
        current = [_alias_name(a) for a in aliases]
        template = next((a.comma for a in aliases if isinstance(a.comma, cst.Comma)), cst.MaybeSentinel.DEFAULT)
        for name in wanted:
            new = cst.ImportAlias(name=cst.Name(name))
            at = sum(1 for c in current if c < name) if current == sorted(current) else len(current)
            if at == len(aliases):  # the new last alias takes the old last one's comma (none, or a trailing one)
                last = aliases[-1]
                aliases[-1] = last.with_changes(comma=template)
                aliases.append(new.with_changes(comma=last.comma))
            else:
                aliases.insert(at, new.with_changes(comma=template))
            current.insert(at, name)
        updated = statement.with_changes(names=aliases)
        self._replace(line, line.with_changes(body=[updated if s is statement else s for s in line.body]))

    def _graphsafe_import(self) -> tuple[cst.SimpleStatementLine, cst.ImportFrom] | None:
        for statement in self.module.body:
            if not isinstance(statement, cst.SimpleStatementLine):
                continue
            for small in statement.body:
                if (
                    isinstance(small, cst.ImportFrom)
                    and not small.relative
                    and small.module is not None
                    and _dotted(small.module) == "graphsafe"
                    and not isinstance(small.names, cst.ImportStar)
                ):
                    return statement, small
        return None

    def _insert_import(self, statement: cst.BaseStatement) -> None:
        """After the module's leading imports (after its docstring when it has none)."""
        body: list[cst.BaseStatement] = list(self.module.body)
        at = 0
        for index, node in enumerate(body):
            if index == 0 and _is_docstring(node):
                at = 1
                continue
            if isinstance(node, cst.SimpleStatementLine) and all(
                isinstance(s, cst.Import | cst.ImportFrom) for s in node.body
            ):
                at = index + 1
                continue
            break
        body.insert(at, statement)
        self.module = self.module.with_changes(body=body)


def _alias_name(alias: cst.ImportAlias, first: bool = False) -> str:
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    dotted = _dotted(alias.name) or ""
    return dotted.split(".")[0] if first else dotted


def _is_docstring(node: cst.CSTNode) -> bool:
    return (
        isinstance(node, cst.SimpleStatementLine)
        and len(node.body) == 1
        and isinstance(node.body[0], cst.Expr)
        and isinstance(node.body[0].value, cst.SimpleString | cst.ConcatenatedString)
    )


def _returns(function: cst.FunctionDef) -> Iterator[cst.Return]:
    """The return statements of ``function`` itself (not of functions nested in it)."""

    class Find(cst.CSTVisitor):
        def __init__(self) -> None:
            self.found: list[cst.Return] = []

        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is function

        def visit_Lambda(self, node: cst.Lambda) -> bool:
            return False

        def visit_Return(self, node: cst.Return) -> None:
            self.found.append(node)

    finder = Find()
    function.visit(finder)
    yield from finder.found
