"""``fa_records.Binder``: the flash-attn hooks' argument binding is ``inspect``'s — the same names, values, defaults
and order for every call, the same TypeError for a call that does not bind — on FA4's own signatures (the
stand-in's, which call as 4.0.0b36 does) and on signatures the template does not take."""
from __future__ import annotations

import inspect
import random

import pytest
import torch

from gproj_patch.hooks.fa_records import Binder
from tests.helpers import fa4_standin


def _inspect(signature, args, kwargs):
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _same(a, b) -> bool:
    """The same names in the same order bound to the very same objects (``*args`` / ``**kwargs`` collections
    compared item by item)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[n], b[n]) for n in a)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b


@pytest.mark.parametrize("fn", [fa4_standin._flash_attn_fwd, fa4_standin._flash_attn_bwd])
def test_every_split_of_a_call_binds_as_inspect_does(fn):
    signature = inspect.signature(fn)
    bind = Binder(signature)
    assert bind.simple
    names = list(signature.parameters)
    rng = random.Random(0)
    required = {n for n, p in signature.parameters.items() if p.default is inspect.Parameter.empty}
    assert required  # q, k, v (and the backward's tensors)
    values = {n: torch.zeros(1) if n in required else object() for n in names}
    for _ in range(300):
        given = [n for n in names if n in required or rng.random() < 0.3]
        n_positional = rng.randint(0, len(given))
        # positional arguments are a prefix of the signature's parameters
        prefix = names[:n_positional]
        args = tuple(values[n] for n in prefix)
        kwargs = {n: values[n] for n in given if n not in prefix}
        assert _same(bind(args, kwargs), _inspect(signature, args, kwargs))


def _with_var_keyword(q, k, /, v=None, *args, scale=1.0, **kwargs):
    return q


@pytest.mark.parametrize("fn", [fa4_standin._flash_attn_fwd, _with_var_keyword])
@pytest.mark.parametrize("call", ["too_many", "unknown", "repeated", "missing"])
def test_a_call_that_does_not_bind_raises_inspects_type_error(fn, call):
    signature = inspect.signature(fn)
    n = len(signature.parameters)
    q = torch.zeros(1)
    args, kwargs = {"too_many": ((q,) * (n + 2), {}), "unknown": ((q, q, q), {"no_such_argument": 1}),
                    "repeated": ((q, q, q), {"k": q}), "missing": ((q,), {})}[call]
    if fn is _with_var_keyword and call != "missing":  # *args / **kwargs take them (k is positional-only)
        assert _same(Binder(signature)(args, kwargs), _inspect(signature, args, kwargs))
        return
    with pytest.raises(TypeError) as want:
        _inspect(signature, args, kwargs)
    with pytest.raises(TypeError) as got:
        Binder(signature)(args, kwargs)
    assert str(got.value) == str(want.value)


def test_positional_only_and_variadic_signatures_bind_through_inspect():
    signature = inspect.signature(_with_var_keyword)
    bind = Binder(signature)
    assert not bind.simple
    q = torch.zeros(1)
    for args, kwargs in [((q, q), {}), ((q, q, q, 1, 2), {"scale": 2.0, "extra": 3})]:
        assert _same(bind(args, kwargs), _inspect(signature, args, kwargs))
