"""Every public callable documents its parameters: a google-style `Args:` entry for each
parameter and none for a parameter it does not have, and a `Returns:` or `Yields:`
section where it returns something. The API reference (mkdocstrings, google style)
renders these sections; this keeps them complete as signatures change."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

import pytest

PUBLIC = ("asynclock", "asynclock.torch", "asynclock.cuda", "asynclock.torch.elastic")
_PARAMETERS = ("Args", "Arguments", "Parameters")
_SECTION = re.compile(r"^([A-Z][A-Za-z ]*):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_]\w*)(?:\s*\([^)]*\))?:(.*)$")


def sections(doc: str) -> dict[str, dict[str, str]]:
    """A google-style docstring's sections (unindented `Name:` lines), each as its
    entries: `name` or `name (type)` at the section's first indentation, then the
    description (the rest of that line and the deeper lines below it)."""
    found: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    indent: int | None = None
    entry = ""
    for line in doc.splitlines():
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        header = _SECTION.match(line)
        if depth == 0:
            current = found.setdefault(header.group(1), {}) if header else None
            indent = None
            continue
        if current is None:
            continue
        if indent is None:
            indent = depth
        if depth == indent:
            match = _ENTRY.match(line.strip())
            entry = match.group(1) if match else line.strip()
            current[entry] = (match.group(2) if match else "").strip()
        elif entry:
            current[entry] = (current[entry] + " " + line.strip()).strip()
    return found


def _parameters(obj: Any) -> list[str] | None:
    """The names a docstring must document: `*args`/`**kwargs` with their stars,
    without `self`/`cls`; None where there is no signature to read."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    names = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls"):
            continue
        stars = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        names.append(stars + p.name)
    return names


def _returns_something(fn: Any) -> bool:
    try:
        annotation = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):
        return False
    return annotation not in (inspect.Signature.empty, None, "None", "NoReturn", "Never")


def _own(cls: type, name: str) -> Any:
    """`cls`'s attribute `name` where asynclock defines it (None where torch, enum or
    the builtins do: their documentation is theirs)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name] if klass.__module__.startswith("asynclock") else None
    return None


def _init_is_ours(cls: type) -> bool:
    if issubclass(cls, enum.Enum):
        return False
    return any(_own(cls, n) is not None for n in ("__init__", "__new__")) or \
        dataclasses.is_dataclass(cls)


def _module(dotted: str) -> Any:
    """`asynclock.torch.elastic` is an attribute of `asynclock.torch`, not a module
    of that name (it is `hvd.elastic`, as in Horovod)."""
    head, _, tail = dotted.rpartition(".")
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        return getattr(importlib.import_module(head), tail)


def public_callables() -> Iterator[tuple[str, Any, str]]:
    """(qualified name, object, "function" | "class" | "method") for every callable in
    the public modules' `__all__`, and every public method asynclock defines on a
    public class (inherited ones included)."""
    seen: set[int] = set()
    for module in PUBLIC:
        mod = _module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if id(obj) in seen or inspect.ismodule(obj) or not callable(obj):
                continue
            seen.add(id(obj))
            if not inspect.isclass(obj):
                yield f"{module}.{name}", obj, "function"
                continue
            if _init_is_ours(obj):
                yield f"{module}.{name}", obj, "class"
            for attr in sorted(dir(obj)):
                member = _own(obj, attr) if not attr.startswith("_") else None
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member):
                    yield f"{module}.{name}.{attr}", member, "method"


def problems(qualname: str, obj: Any, kind: str) -> list[str]:
    """What the docstring of one public callable lacks or gets wrong."""
    doc = inspect.getdoc(obj) or ""
    if kind == "class":
        init = _own(obj, "__init__")
        doc += "\n\n" + ((inspect.getdoc(init) or "") if init is not None else "")
    found = sections(doc)
    documented: dict[str, str] = {}
    for title in _PARAMETERS:
        documented.update(found.get(title, {}))
    wanted = _parameters(obj) or []
    if kind == "class" and dataclasses.is_dataclass(obj):
        documented.update(found.get("Attributes", {}))
    out = [f"{qualname}: parameter {p!r} has no Args entry" for p in wanted
           if p not in documented]
    out += [f"{qualname}: Args names {d!r}, which is not a parameter" for d in documented
            if d not in wanted]
    out += [f"{qualname}: Args entry {d!r} says nothing" for d, text in documented.items()
            if d in wanted and not text]
    if kind != "class" and _returns_something(obj) and not (
            found.get("Returns") or found.get("Yields")):
        out.append(f"{qualname}: returns a value but has no Returns/Yields section")
    return out


def test_every_public_parameter_is_documented() -> None:
    callables = list(public_callables())
    assert len(callables) > 100  # the walk reaches the whole face
    missing = [p for q, obj, kind in callables for p in problems(q, obj, kind)]
    assert not missing, f"{len(missing)} docstring problems:\n" + "\n".join(missing)


def test_the_walk_reaches_methods_classes_and_inherited_members() -> None:
    names = {q for q, _, _ in public_callables()}
    assert "asynclock.Coordinator.allreduce" in names  # from the Collectives mixin
    assert "asynclock.Checkpointer" in names and "asynclock.Checkpointer.save" in names
    assert "asynclock.torch.elastic.run" in names
    assert not any(q.startswith("asynclock.torch.SyncBatchNorm.load_state") for q in names)


def _sample(a: int, *rest: int, b: str = "", **more: Any) -> int:
    """Summary.

    Args:
        a: the first.
        *rest: the others.
        b (str): a name,
            over two lines.
        ghost: not a parameter.

    Returns:
        Something.
    """
    return a


def _silent(a: int) -> int:
    """Summary, and no sections."""
    return a


@pytest.mark.parametrize(("fn", "expected"), [
    (_sample, ["parameter '**more' has no Args entry", "Args names 'ghost'"]),
    (_silent, ["parameter 'a' has no Args entry", "no Returns/Yields section"]),
])
def test_the_check_finds_what_a_docstring_lacks(fn: Any, expected: list[str]) -> None:
    found = problems("f", fn, "function")
    assert len(found) == len(expected), found
    for text, problem in zip(expected, found, strict=True):
        assert text in problem
    assert sections(inspect.getdoc(_sample) or "")["Args"]["b"] == "a name, over two lines."
