"""Shared test helper: bind every call of a code block that cannot run here against the real signatures.

A block that needs a GPU or vLLM is compiled, its imports are run, and every call whose callee can be named from
them (an imported name, an attribute of one, a method of an object the block built from one, through return and
attribute annotations) is bound with :meth:`inspect.Signature.bind` to placeholder arguments of the same shape. A
renamed keyword, a removed function or a method that no longer exists fails the bind. Calls of the reader's own
code (names the block never imports) are left alone.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import sys
import typing
from dataclasses import dataclass, field
from typing import Any

#: Roots whose calls must bind: the rest (torch's C functions, the reader's own code) is best effort.
CHECKED_ROOTS = ("graphsafe", "vllm")


@dataclass
class Instance:
    """An object of ``cls`` the block made (a call of ``cls``, or a call annotated to return one)."""

    cls: type


@dataclass
class Report:
    bound: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    #: checked packages not installed here (vLLM outside its own venv): their calls are left unbound
    unavailable: list[str] = field(default_factory=list)


def _owner_module(obj: Any) -> str:
    target = obj.cls if isinstance(obj, Instance) else obj
    return getattr(target, "__module__", None) or getattr(target, "__name__", "") or ""


def _checked(obj: Any) -> bool:
    return _owner_module(obj).split(".")[0] in CHECKED_ROOTS


def _class_of_annotation(annotation: Any, module: str, owner: type | None) -> type | None:
    """The class an annotation names (``X``, ``X | None``, ``Optional[X]``, ``Self``, or its string form)."""
    if annotation is typing.Self and owner is not None:
        return owner
    if isinstance(annotation, type):
        # a Protocol names what an object can do, not what it is: its other methods stay unknown
        return None if getattr(annotation, "_is_protocol", False) else annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1:
        return _class_of_annotation(args[0], module, owner)
    if isinstance(annotation, str):
        names = [n.strip() for n in annotation.split("|") if n.strip() != "None"]
        if len(names) != 1:
            return None
        name = names[0].strip("'\"")
        if name == "Self":
            return owner
        found = getattr(sys.modules.get(module), name, None)
        if isinstance(found, type):
            return _class_of_annotation(found, module, owner)
        for mod_name, mod in list(sys.modules.items()):  # a name imported only under TYPE_CHECKING
            if mod_name.split(".")[0] in CHECKED_ROOTS and isinstance(getattr(mod, name, None), type):
                return _class_of_annotation(getattr(mod, name), module, owner)
    return None


def _returns(fn: Any, owner: type | None) -> Any:
    """What calling ``fn`` gives: an :class:`Instance` when its return annotation names a class, else ``None``."""
    if isinstance(fn, type):
        return Instance(fn)
    try:
        hints = typing.get_type_hints(fn)
        annotation = hints.get("return")
    except Exception:
        annotation = getattr(fn, "__annotations__", {}).get("return")
    cls = _class_of_annotation(annotation, getattr(fn, "__module__", ""), owner)
    return Instance(cls) if cls is not None else None


def _instance_attribute(cls: type, name: str) -> tuple[bool, Any]:
    """Whether ``self.name`` is declared (a class annotation, or an annotated assignment in ``__init__``), and an
    :class:`Instance` of its type when that is a class."""
    for klass in cls.__mro__:
        annotation = inspect.get_annotations(klass).get(name)
        if annotation is None and "__init__" in klass.__dict__:
            try:
                tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(klass.__init__)))
            except (OSError, TypeError, SyntaxError):
                continue
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.AnnAssign)
                    and isinstance(node.target, ast.Attribute)
                    and node.target.attr == name
                ):
                    annotation = ast.unparse(node.annotation)
        if annotation is not None:
            found = _class_of_annotation(annotation, klass.__module__, cls)
            return True, Instance(found) if found is not None else None
    return False, None


class _Resolver:
    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace
        self.variables: dict[str, Any] = {}
        self.report = Report()

    def value(self, node: ast.expr) -> Any:
        """What ``node`` evaluates to, as far as names and annotations tell; ``None`` when unknown."""
        if isinstance(node, ast.Name):
            if node.id in self.variables:
                return self.variables[node.id]
            return self.namespace.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.value(node.value)
            if base is None:
                return None
            if isinstance(base, Instance):
                attr = inspect.getattr_static(base.cls, node.attr, None)
                if attr is None:
                    declared, found = _instance_attribute(base.cls, node.attr)
                    if not declared and _checked(base):
                        self.report.failures.append(
                            f"line {node.lineno}: {base.cls.__qualname__} has no attribute {node.attr!r}"
                        )
                    return found
                if isinstance(attr, property):
                    return _returns(attr.fget, base.cls)
                return ("method", base.cls, getattr(base.cls, node.attr))
            found = getattr(base, node.attr, None)
            if found is None and _checked(base):
                self.report.failures.append(f"line {node.lineno}: {_owner_module(base)} has no {node.attr!r}")
            return found
        if isinstance(node, ast.Call):
            return self.call(node)
        return None

    def call(self, node: ast.Call) -> Any:
        callee = self.value(node.func)
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            self.value(arg)  # nested calls are checked too
        if callee is None:
            return None
        owner: type | None = None
        if isinstance(callee, tuple):  # a method looked up on an Instance: bind it unbound, self first
            _, owner, fn = callee
            self_args: list[Any] = [object()]
            if isinstance(inspect.getattr_static(owner, fn.__name__, None), (staticmethod, classmethod)):
                self_args = []
        else:
            fn, self_args = callee, []
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            if _checked(fn):
                self.report.failures.append(f"line {node.lineno}: no signature for {name}")
            return None
        starred = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
        args = [*self_args, *(object() for a in node.args if not isinstance(a, ast.Starred))]
        kwargs = {k.arg: object() for k in node.keywords if k.arg is not None}
        try:
            (signature.bind_partial if starred else signature.bind)(*args, **kwargs)
        except TypeError as exc:
            self.report.failures.append(f"line {node.lineno}: {name}{signature}: {exc}")
        else:
            if _checked(fn):
                self.report.bound.append(f"{name}({', '.join([*['_'] * len(node.args), *kwargs])})")
        return _returns(fn, owner)

    def statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            value = self.value(node.value) if node.value is not None else None
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    self.variables[target.id] = value
            return
        if isinstance(node, ast.With):
            for item in node.items:
                self.value(item.context_expr)
        elif isinstance(node, ast.Expr | ast.Return | ast.AugAssign) and node.value is not None:
            self.value(node.value)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                self.statement(child)


def check_calls(code: str, where: str) -> Report:
    """Compile ``code``, run its imports and bind every call it makes of what they bring in (see the module)."""
    tree = ast.parse(compile(code, where, "exec", flags=ast.PyCF_ONLY_AST))
    namespace: dict[str, Any] = {"__builtins__": builtins}
    missing: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            try:
                exec(compile(ast.Module([node], []), where, "exec"), namespace)
            except ImportError:
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                roots = {name.split(".")[0] for name in names}
                if not roots <= set(CHECKED_ROOTS) - {"graphsafe"}:
                    raise
                missing.extend(sorted(roots))
    resolver = _Resolver(namespace)
    resolver.report.unavailable = missing
    for stmt in tree.body:
        resolver.statement(stmt)
    return resolver.report
