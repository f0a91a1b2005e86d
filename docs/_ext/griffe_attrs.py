"""A griffe extension for the API reference (``docs/api.md``), loaded by ``mkdocs.yml``.

Static analysis sees no ``__init__`` on an ``attrs`` class, so griffe would render
``Envelope()`` with no parameters and warn that every ``:param x:`` of its docstring
"does not appear in the function signature". This extension does for
``@attrs.define`` / ``@attrs.frozen`` classes what griffe's built-in dataclasses
extension does for ``@dataclass``: it recreates ``__init__`` from the annotated fields
(``init=False`` fields left out, a leading underscore dropped as attrs does,
``kw_only``, ``default=`` and ``factory=`` honoured).

It also fills in what griffe's Sphinx support leaves out:

- ``#:`` comments above an attribute (Sphinx autodoc's attribute docs, used for
  envq's value fields, enum members and type aliases) become its docstring;
- a role such as ``:class:`envq.Queue` `` becomes a code span (mkdocstrings does not
  render Sphinx roles);
- ``:raises A, B: text`` (which griffe cannot parse and would drop) becomes one
  ``:raises A: text`` line per exception, so the page lists each.

Nothing here changes envq: it only shapes what griffe reads.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import (
    Attribute,
    Class,
    Docstring,
    Expr,
    ExprCall,
    ExprKeyword,
    Extension,
    Function,
    GriffeLoader,
    Module,
    Object,
    Parameter,
    ParameterKind,
    Parameters,
)

_ATTRS_DECORATORS = frozenset(
    {"attrs.define", "attrs.frozen", "attrs.mutable", "attr.s", "attr.attrs", "attr.define"}
)
_FIELD_CALLS = frozenset({"attrs.field", "attr.ib", "attr.attrib", "attr.field"})
_ROLE = re.compile(r":(?:class|meth|func|attr|data|mod|exc|obj|const):`~?([^`]+)`")
_MULTI_RAISES = re.compile(r"^(?P<indent>[ \t]*):raises (?P<names>[\w.]+(?:,[ \t]*[\w.]+)+):")


def _call_args(expr: object) -> dict[str, Any]:
    """Keyword arguments of a call expression (names to expressions or strings)."""
    if not isinstance(expr, ExprCall):
        return {}
    return {arg.name: arg.value for arg in expr.arguments if isinstance(arg, ExprKeyword)}


def _attrs_decorator(cls: Class) -> Expr | str | None:
    for decorator in cls.decorators:
        value = decorator.value
        if isinstance(value, Expr) and value.canonical_path in _ATTRS_DECORATORS:
            return value
    return None


def _parameters(cls: Class) -> list[Parameter]:
    decorator = _attrs_decorator(cls)
    kw_only_class = str(_call_args(decorator).get("kw_only")) == "True"
    params: list[Parameter] = []
    for member in cls.members.values():
        if member.is_alias or not isinstance(member, Attribute) or member.annotation is None:
            continue
        if "property" in member.labels or (
            "class-attribute" in member.labels and "instance-attribute" not in member.labels
        ):
            continue
        value = member.value
        field = (
            _call_args(value)
            if isinstance(value, ExprCall) and value.canonical_path in _FIELD_CALLS
            else None
        )
        if field is not None and str(field.get("init")) == "False":
            continue
        if field is None:
            default: str | Expr | None = value
        elif "factory" in field:
            default = ExprCall(function=field["factory"], arguments=[])
        else:
            default = field.get("default")
        if isinstance(default, ExprCall) and default.canonical_path == "typing.cast":
            # ``default=cast(T, None)``: required, but validated by envq rather than
            # rejected with a TypeError by attrs; show it as required.
            default = None
        kw_only = kw_only_class or (field is not None and str(field.get("kw_only")) == "True")
        params.append(
            Parameter(
                member.name.lstrip("_"),
                annotation=member.annotation,
                kind=ParameterKind.keyword_only if kw_only else ParameterKind.positional_or_keyword,
                default=default,
                docstring=member.docstring,
            )
        )
    return params


def _add_init(cls: Class) -> None:
    if "__init__" in cls.members or _attrs_decorator(cls) is None:
        return
    self_ = Parameter("self", kind=ParameterKind.positional_or_keyword)
    init = Function(
        "__init__",
        lineno=0,
        endlineno=0,
        parent=cls,
        parameters=Parameters(self_, *_parameters(cls)),
        returns="None",
    )
    cls.set_member("__init__", init)


def _comment_docstring(attr: Attribute) -> None:
    """Use the ``#:`` comment lines right above ``attr`` as its docstring."""
    if attr.docstring is not None or attr.lineno is None:
        return
    lines = attr.module.lines
    found: list[str] = []
    n = attr.lineno - 2  # 0-based index of the line above
    while n >= 0 and lines[n].lstrip().startswith("#:"):
        found.insert(0, lines[n].lstrip()[2:].strip())
        n -= 1
    if found:
        attr.docstring = Docstring("\n".join(found), lineno=n + 2, parent=attr)


def _walk(obj: Module | Class, seen: set[str]) -> None:
    if obj.path in seen:
        return
    seen.add(obj.path)
    for member in list(obj.members.values()):
        if member.is_alias:
            continue
        if isinstance(member, Attribute):
            _comment_docstring(member)
        elif isinstance(member, Module | Class):
            _walk(member, seen)
    if isinstance(obj, Class):
        _add_init(obj)


def plain_roles(text: str) -> str:
    """``:class:`envq.Queue` `` → ```envq.Queue` ``."""
    return _ROLE.sub(r"`\1`", text)


def split_raises(text: str) -> str:
    """``:raises A, B: why`` → ``:raises A: why`` and ``:raises B: why``."""
    lines: list[str] = []
    for line in text.splitlines():
        match = _MULTI_RAISES.match(line)
        if match is None:
            lines.append(line)
            continue
        rest = line[match.end() :]
        for name in re.split(r",[ \t]*", match["names"]):
            lines.append(f"{match['indent']}:raises {name}:{rest}")
    return "\n".join(lines)


class AttrsExtension(Extension):
    """Recreate ``__init__`` of attrs classes; read ``#:`` comments; tidy Sphinx fields."""

    def on_package(self, *, pkg: Module, loader: GriffeLoader, **kwargs: Any) -> None:
        _walk(pkg, set())
        for obj in _objects(pkg, set()):
            doc = obj.docstring
            if doc is not None:
                doc.value = split_raises(plain_roles(doc.value))


def _objects(obj: Object, seen: set[str]) -> list[Object]:
    """``obj`` and every object defined under it (aliases left out)."""
    if obj.path in seen:
        return []
    seen.add(obj.path)
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias and isinstance(member, Object):
            found += _objects(member, seen)
    return found
