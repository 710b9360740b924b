"""The kernels' signatures as kernels.h declares them, for ctypes.

kernels.h is the one declaration of every exported native function: the C compiler checks each
definition against it, and this module reads it, so the Python side calls each function with the
argument types its definition has. The header keeps a deliberately regular form (see its top) and
anything outside that form raises here, so the parser stays a few regular expressions.

    C type        ctypes
    void          None (a return type only)
    int           c_int
    int64_t       c_int64
    float         c_float        a Python float
    const char *  c_char_p       (a return type only: simd_isa)
    T *           c_void_p       an address (tensor.data_ptr()) or None
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

HEADER = Path(__file__).with_name("kernels.h")

_VALUES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_POINTEES = {"void", "int", "int64_t", "float", "uint8_t", "uint16_t", "char"}
_TYPE = re.compile(r"(const\s+)?(\w+)\s*(\*?)")
_PROTOTYPE = re.compile(r"(.+?)\b(\w+)\s*\((.*)\)", re.DOTALL)
_PARAMETER = re.compile(r"(.+?)\b(\w+)")
_SECTION = re.compile(r"^/\* (\w+)\.c: ", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Parameter:
    type: str  # as written, whitespace normalized: "const float *"
    name: str


@dataclass(frozen=True, slots=True)
class Prototype:
    """One function of kernels.h. ``source``: the library (``<source>.c``) that exports it; None for
    simd_isa, which every library built against simd.h exports."""

    name: str
    restype: str
    params: tuple[Parameter, ...]
    source: str | None

    @property
    def argtypes(self) -> list[type]:
        return [ctype(p.type) for p in self.params]

    @property
    def ctypes_restype(self):
        return None if self.restype == "void" else ctype(self.restype)


@dataclass(frozen=True, slots=True)
class Header:
    prototypes: dict[str, Prototype]
    constants: dict[str, int]  # the #defines and enum entries


def ctype(c_type: str):
    """The ctypes type a parameter or return value of C type ``c_type`` is passed as."""
    m = _TYPE.fullmatch(c_type.strip())
    if m and m[3] and m[2] in _POINTEES:
        return ctypes.c_char_p if m[1] and m[2] == "char" else ctypes.c_void_p
    if m and not m[1] and not m[3] and m[2] in _VALUES:
        return _VALUES[m[2]]
    raise ValueError(f"kernels.h: type {c_type!r} is not one abi.py maps to ctypes (see kernels.h's top)")


def _normalized(c_type: str) -> str:
    m = _TYPE.fullmatch(c_type.strip())
    if m is None:
        raise ValueError(f"kernels.h: cannot read the type {c_type!r}")
    return f"{'const ' if m[1] else ''}{m[2]}{' *' if m[3] else ''}"


def _prototype(statement: str, source: str | None) -> Prototype:
    m = _PROTOTYPE.fullmatch(statement)
    if m is None:
        raise ValueError(f"kernels.h: not a prototype abi.py reads: {statement!r}")
    restype, name, params = _normalized(m[1]), m[2], m[3].strip()
    parsed = []
    for text in [] if params == "void" else params.split(","):
        p = _PARAMETER.fullmatch(text.strip())
        if p is None or not p[1].strip():
            raise ValueError(f"kernels.h: {name}: a parameter needs a type and a name, not {text.strip()!r}")
        parsed.append(Parameter(_normalized(p[1]), p[2]))
    for c_type in [p.type for p in parsed] + ([] if restype == "void" else [restype]):
        ctype(c_type)  # an unmapped type raises here, not at the first call
    return Prototype(name, restype, tuple(parsed), source)


def parse(text: str) -> Header:
    """The prototypes and constants of a header in kernels.h's form; ValueError for anything else."""
    prototypes, constants = {}, {}
    sources = [(m.start(), m[1]) for m in _SECTION.finditer(text)]
    for m in re.finditer(r"^#define\s+(\w+)\s+(-?\d+)\s*$", text, re.MULTILINE):
        constants[m[1]] = int(m[2])
    # comments and preprocessor lines blanked, not removed: offsets still find the sections
    code = re.sub(r"/\*.*?\*/|//[^\n]*|^#[^\n]*", lambda m: re.sub(r"\S", " ", m[0]), text,
                  flags=re.DOTALL | re.MULTILINE)
    end = 0
    for raw in code.split(";"):
        first, end = end + len(raw) - len(raw.lstrip()), end + len(raw) + 1
        statement = raw.strip()
        if not statement:
            continue
        if statement.startswith("enum"):
            constants.update(_enum(statement))
            continue
        source = next((name for offset, name in reversed(sources) if offset < first), None)
        proto = _prototype(" ".join(statement.split()), source)
        if proto.name in prototypes:
            raise ValueError(f"kernels.h: {proto.name} is declared twice")
        prototypes[proto.name] = proto
    return Header(prototypes, constants)


def _enum(statement: str) -> dict[str, int]:
    body = re.fullmatch(r"enum\s*\{(.*)\}", statement, re.DOTALL)
    entries = [e.strip() for e in body[1].split(",") if e.strip()] if body else [statement]
    out = {}
    for entry in entries:
        m = re.fullmatch(r"(\w+)\s*=\s*(-?\d+)", entry)
        if m is None:
            raise ValueError(f"kernels.h: enum entries are NAME = <number>, not {entry!r}")
        out[m[1]] = int(m[2])
    return out


@cache
def header() -> Header:
    return parse(HEADER.read_text())


def prototype(name: str) -> Prototype:
    try:
        return header().prototypes[name]
    except KeyError:
        raise LookupError(f"{name}: no prototype in native/kernels.h; declare it there") from None


def check(name: str, argtypes, restype) -> None:
    """Raises TypeError where a ctypes signature written by hand disagrees with kernels.h's."""
    proto = prototype(name)
    if list(argtypes) != proto.argtypes or restype is not proto.ctypes_restype:
        raise TypeError(f"{name}: ctypes signature {_show(argtypes)} -> {_show([restype])} disagrees with "
                        f"kernels.h's {_show(proto.argtypes)} -> {_show([proto.ctypes_restype])}")


def bind(library, name: str):
    """The function ``name`` of a loaded library with kernels.h's signature set."""
    proto = prototype(name)
    fn = getattr(library, name)
    fn.argtypes, fn.restype = proto.argtypes, proto.ctypes_restype
    return fn


def _show(types) -> str:
    return "(" + ", ".join("None" if t is None else t.__name__ for t in types) + ")"
