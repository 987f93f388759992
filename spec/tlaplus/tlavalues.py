"""TLA+ values in Python, and the small runtime the compiled spec calls (spec/tlaplus/tlaeval.py).

Integers, strings and booleans are Python's own; a set is a frozenset; a model value is an
interned ModelValue, so that equality and hashing are identity (C speed, no Python call);
a function is a Fcn, which is also a record (string keys), a tuple and a sequence (domain
1..n). Fcn is a dict subclass so that the compiled `f[x]` is one C-level subscript and
equality is dict equality; it is treated as immutable once built (EXCEPT copies) and caches
its hash. Infinite and lazily enumerated sets (Nat, Int, Seq(S), [S -> T]) are objects that
support `in`.

Every helper raises EvalError for a value outside the subset; the compiled code's caller
adds the TLA+ line (spec/tlaplus/tlaeval.py maps the generated code's line back to the spec's).
"""

from __future__ import annotations

from functools import total_ordering
from itertools import product
from typing import Callable, Iterable


class EvalError(ValueError):
    """A construct the evaluator does not support, or an evaluation error, with its line."""


@total_ordering
class ModelValue:
    """A TLC model value (an element of Requests, or NoReq). One object per name, so that
    equality and hashing are object identity; ordered by name."""

    __slots__ = ("name",)
    _interned: dict[str, "ModelValue"] = {}

    def __new__(cls, name: str) -> "ModelValue":
        value = cls._interned.get(name)
        if value is None:
            value = super().__new__(cls)
            object.__setattr__(value, "name", name)
            cls._interned[name] = value
        return value

    def __setattr__(self, key, value) -> None:
        raise AttributeError("a model value is immutable")

    def __reduce__(self):
        return ModelValue, (self.name,)  # unpickles to the interned object

    def __lt__(self, other: "ModelValue") -> bool:
        if not isinstance(other, ModelValue):
            return NotImplemented
        return self.name < other.name

    def __repr__(self) -> str:
        return self.name


class Fcn(dict):
    """A TLA+ function (record, tuple, sequence): a dict that is never mutated once shared."""

    __slots__ = ("_hash",)

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash = hash(frozenset(self.items()))
            return self._hash

    def __contains__(self, key: object) -> bool:
        # `x \in f` for a function f is a type error in TLA+, not a domain test.
        raise EvalError(f"\\in applied to the function {self!r}, which is not a set")

    def __repr__(self) -> str:
        return "(" + " @@ ".join(f"{k!r} :> {v!r}" for k, v in self.items()) + ")"


def seq(items: Iterable) -> Fcn:
    return Fcn(enumerate(items, 1))


def sort_key(x: object):
    """A fixed order for enumeration (CHOOSE, [S -> T]): by kind, then by printed form."""
    return (type(x).__name__, repr(x))


def sorted_values(s) -> list:
    return sorted(enumerable(s), key=sort_key)


class _Infinite:
    def __init__(self, name: str, test: Callable[[object], bool]) -> None:
        self.name, self.test = name, test

    def __contains__(self, x: object) -> bool:
        return self.test(x)

    def __repr__(self) -> str:
        return self.name


NAT = _Infinite("Nat", lambda x: type(x) is int and x >= 0)
INT = _Infinite("Int", lambda x: type(x) is int)
BOOLEAN = frozenset({False, True})


class SeqSet:
    """Seq(S): testable, not enumerable."""

    def __init__(self, base) -> None:
        self.base = base

    def __contains__(self, x: object) -> bool:
        return (type(x) is Fcn and set(x) == set(range(1, len(x) + 1))
                and all(v in self.base for v in x.values()))

    def __repr__(self) -> str:
        return f"Seq({self.base!r})"


class FunctionSet:
    """[S -> T]: enumerable when T is finite, always testable."""

    def __init__(self, domain, codomain) -> None:
        self.domain, self.codomain = enumerable(domain), codomain

    def __contains__(self, f: object) -> bool:
        return (type(f) is Fcn and f.keys() == set(self.domain)
                and all(v in self.codomain for v in f.values()))

    def __iter__(self):
        keys = sorted(self.domain, key=sort_key)
        for values in product(sorted_values(self.codomain), repeat=len(keys)):
            yield Fcn(zip(keys, values))

    def __repr__(self) -> str:
        return f"[{self.domain!r} -> {self.codomain!r}]"


def enumerable(s):
    """s as a set the compiled code may iterate over: a frozenset or [S -> T]."""
    if type(s) is frozenset or type(s) is FunctionSet:
        return s
    raise EvalError(f"cannot enumerate {s!r}")


def apply_error(f: object, key: object) -> EvalError:
    if type(f) is Fcn:
        return EvalError(f"{key!r} is not in the domain of {f!r}")
    return EvalError(f"{f!r} is not a function, cannot apply it to {key!r}")


def except_(f, key, value):
    """[f EXCEPT ![key] = value]."""
    if type(f) is not Fcn or not dict.__contains__(f, key):
        except_outside(f, key)
    g = Fcn(f)
    g[key] = value
    return g


def except_at(f, key, update: Callable):
    """[f EXCEPT ![key] = e] where e mentions @ (the old f[key])."""
    if type(f) is not Fcn or not dict.__contains__(f, key):
        except_outside(f, key)
    g = Fcn(f)
    g[key] = update(f[key])
    return g


def except_outside(f, key):
    """EXCEPT on something that is not a function, or at a key outside its domain: TLA+
    would leave f unchanged, TLC and this evaluator report it."""
    if type(f) is not Fcn:
        raise EvalError(f"EXCEPT on {f!r}, which is not a function")
    raise EvalError(f"EXCEPT: {key!r} is not in the domain of {f!r}")


def domain(f) -> frozenset:
    if type(f) is not Fcn:
        raise EvalError(f"DOMAIN of {f!r}, which is not a function")
    return frozenset(f.keys())


def domain_keys(f) -> Fcn:
    """What a loop over DOMAIN f iterates: f itself (a dict iterates its keys)."""
    if type(f) is not Fcn:
        raise EvalError(f"DOMAIN of {f!r}, which is not a function")
    return f


def length(s) -> int:
    if type(s) is not Fcn:
        raise EvalError(f"Len of {s!r}, which is not a sequence")
    return len(s)


def cardinality(s) -> int:
    if type(s) is not frozenset:
        raise EvalError(f"Cardinality of {s!r}, which is not a finite set")
    return len(s)


# a..b is built as a set up to this many elements; above it, it is only tested for
# membership, as TLC does for a large interval: a shell's run may carry a constant like the
# simulator's Tokens (2^62 token kinds: a page's token is a hash), and `1..Tokens` in
# PromptsOf and TypeOK must not be built to say that a token is in it.
INTERVAL_ENUMERATED_MAX = 1 << 16


class Interval:
    """a..b of many integers: testable, not enumerable."""

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b = a, b

    def __contains__(self, x: object) -> bool:
        return type(x) is int and self.a <= x <= self.b

    def __repr__(self) -> str:
        return f"{self.a}..{self.b}"


def interval(a: int, b: int) -> frozenset | Interval:
    if b - a + 1 > INTERVAL_ENUMERATED_MAX:
        return Interval(a, b)
    return frozenset(range(a, b + 1))


# SUBSET S is enumerated up to this many elements of S (65,536 subsets); above it, it is a
# set that is only tested for membership, as TLC does: a run's model may have thousands
# of requests (engine/process_engine.py numbers 10,000), and TypeOK's `SUBSET Requests`
# must not enumerate 2^10,000 subsets to say that readers[d][p] is one.
SUBSET_ENUMERATED_MAX = 16


class PowerSet:
    """SUBSET S of a large S: testable, not enumerable."""

    def __init__(self, base: frozenset) -> None:
        self.base = base

    def __contains__(self, x: object) -> bool:
        return type(x) is frozenset and x <= self.base

    def __repr__(self) -> str:
        return f"SUBSET {self.base!r}"


def subsets(s) -> frozenset | PowerSet:
    items = sorted_values(s)
    if len(items) > SUBSET_ENUMERATED_MAX:
        return PowerSet(frozenset(items))
    return frozenset(frozenset(x for x, keep in zip(items, mask) if keep)
                     for mask in product((False, True), repeat=len(items)))


_NOTHING = object()


def chosen(value):
    if value is _NOTHING:
        raise EvalError("CHOOSE found no value")
    return value


def no_case_applies():
    raise EvalError("no CASE arm applies")


def unassigned(name: str):
    raise EvalError(f"{name}' is read before it is assigned")


# The names the compiled code sees, besides its folded constants.
RUNTIME = {
    "Fcn": Fcn, "EvalError": EvalError, "NAT": NAT, "INT": INT, "BOOLEAN": BOOLEAN,
    "SeqSet": SeqSet, "FunctionSet": FunctionSet, "enumerable": enumerable,
    "sorted_values": sorted_values, "except_": except_, "except_at": except_at,
    "except_outside": except_outside, "domain": domain, "domain_keys": domain_keys,
    "length": length, "cardinality": cardinality, "interval": interval, "subsets": subsets,
    "NOTHING": _NOTHING, "chosen": chosen, "no_case_applies": no_case_applies,
    "unassigned": unassigned,
}
