"""The kernel scan without a GPU: the node walk and the parameter decoding on recorded node tables, the address
classification against a fake allocator view, the manifest built from a fake driver, and the fallback paths."""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from graphsafe import GraphContract, ReloadFailedError
from graphsafe.adapters.vllm import _hooks as vllm_hooks
from graphsafe.collectors import (
    GraphNode,
    Manifest,
    RecordedDriver,
    ScanUnavailable,
    StorageView,
    pointer_words,
    record_capture,
    record_table,
    scan_graph,
)
from graphsafe.collectors import _kernelscan as kscan
from graphsafe.errors import GraphSafeError
from graphsafe.outcome import FindingKind, Status


def _word(value: int) -> bytes:
    return value.to_bytes(8, "little")


# -- decoding ------------------------------------------------------------------------------------------------------
def test_pointer_words_take_aligned_pointer_sized_words_of_each_parameter() -> None:
    layout = [(0, 8), (8, 4), (12, 4), (16, 24), (40, 8)]
    params = [
        _word(0x7F0000001000),
        (7).to_bytes(4, "little"),  # an int: too small to be a pointer
        (9).to_bytes(4, "little"),
        _word(0x7F0000002000) + _word(0) + _word(0x7F0000002100),  # a struct: two pointers and a null
        _word(0),  # a null pointer
    ]
    assert pointer_words(layout, params) == [0x7F0000001000, 0x7F0000002000, 0x7F0000002100]


def test_pointer_words_skip_misaligned_bytes_of_a_struct() -> None:
    # A 16-byte struct at offset 4 (packed after an int): only its word at buffer offset 8 is pointer-aligned.
    layout = [(0, 4), (4, 16)]
    params = [(1).to_bytes(4, "little"), b"\x11" * 4 + _word(0x7F00DEAD0000) + b"\x22" * 4]
    assert pointer_words(layout, params) == [0x7F00DEAD0000]


def test_pointer_words_refuse_a_short_parameter_buffer() -> None:
    with pytest.raises(ValueError, match="kernel scan: parameter at offset 0 has 4 bytes, expected 8"):
        pointer_words([(0, 8)], [b"\0" * 4])
    with pytest.raises(ValueError, match="2 parameter offsets but 1 parameter buffers"):
        pointer_words([(0, 8), (8, 8)], [_word(1)])


# -- parameter types from the kernel's name --------------------------------------------------------------------------
#: ``at::native::indexSelectSmallIndex<float, long, unsigned int, 2, 2, -2>(TensorInfo<float, unsigned int>,
#: TensorInfo<float const, unsigned int>, TensorInfo<long const, unsigned int>, int, int, unsigned int, long)``, with
#: the parameter layout cuFuncGetParamInfo gives for it (tests/data/cuda_index_graph.json).
INDEX_SELECT = (
    "_ZN2at6native44_GLOBAL__N__50c743a2_11_Indexing_cu_89862edb21indexSelectSmallIndexIfljLi2ELi2ELin2EEEvNS_4cuda6"
    "detail10TensorInfoIT_T1_EENS5_IKS6_S7_EENS5_IKT0_S7_EEiiS7_l"
)
INDEX_SELECT_LAYOUT = ((0, 216), (216, 216), (432, 216), (648, 4), (652, 4), (656, 4), (664, 8))


def _tensor_info(data: int, dims: list[int], tail: list[int], width: int = 4) -> bytes:
    """A TensorInfo's bytes: ``data``, ``dims`` sizes and strides, the unused entries as ``tail`` words left them."""
    filler = b"".join(_word(w) for w in tail) * 64
    sizes = b"".join(n.to_bytes(width, "little") for n in dims)
    unused = 25 * width - len(sizes)
    arrays = (sizes + filler[:unused]) * 2
    raw = _word(data) + arrays + len(dims).to_bytes(4, "little")
    return raw + filler[: -len(raw) % 8]


def test_a_tensor_info_parameter_gives_only_its_data_pointer() -> None:
    garbage = [0x7F0000123400, 0x7FFC00001000]  # earlier pointers the launch left in the unused dims
    params = [
        _tensor_info(0x7F0000001000, [4, 256], garbage),
        _tensor_info(0x7F0000002000, [4, 256], garbage),
        _tensor_info(0x7F0000003000, [4], garbage),
        (1).to_bytes(4, "little"),
        (0).to_bytes(4, "little"),
        (1024).to_bytes(4, "little"),
        _word(4),
    ]
    assert [len(p) for p in params] == [size for _, size in INDEX_SELECT_LAYOUT]
    words = pointer_words(INDEX_SELECT_LAYOUT, params, INDEX_SELECT)
    assert words == [0x7F0000001000, 0x7F0000002000, 0x7F0000003000, 4]
    # A name that proves nothing (a Triton kernel's, an extern "C" one) reads every word, the garbage too.
    assert set(garbage) <= set(pointer_words(INDEX_SELECT_LAYOUT, params, "triton_poi_fused_0"))


@pytest.mark.parametrize(
    ("why", "layout"),
    [
        ("a size that is not TensorInfo's", ((0, 224), *INDEX_SELECT_LAYOUT[1:])),
        ("a misaligned offset", ((4, 216), *INDEX_SELECT_LAYOUT[1:])),
        ("another parameter count", INDEX_SELECT_LAYOUT[:-1]),
    ],
)
def test_a_tensor_info_whose_layout_does_not_match_is_read_whole(why: str, layout: tuple[tuple[int, int], ...]) -> None:
    limits = kscan.pointer_limits(INDEX_SELECT, layout)
    if len(layout) == len(INDEX_SELECT_LAYOUT):
        assert limits[0] == layout[0][1] and limits[1:3] == (8, 8), why  # the others still match
    else:
        assert limits == tuple(size for _, size in layout), why


@pytest.mark.parametrize("dims", [26, -1, 0x7F00])
def test_a_tensor_info_whose_dims_field_holds_no_dimension_count_is_read_whole(dims: int) -> None:
    # The name and the size say TensorInfo, the bytes do not (another torch's struct): every word is read.
    info = bytearray(_tensor_info(0x7F0000001000, [4], [0x7F0000123400]))
    info[208:212] = dims.to_bytes(4, "little", signed=True)
    params = [bytes(info), _tensor_info(0x7F0000002000, [4], [0]), _tensor_info(0x7F0000003000, [4], [0])]
    params += [bytes(4), bytes(4), bytes(4), _word(0)]
    words = pointer_words(INDEX_SELECT_LAYOUT, params, INDEX_SELECT)
    assert 0x7F0000123400 in words and words[-2:] == [0x7F0000002000, 0x7F0000003000]


def test_a_table_recorded_on_the_gpu_reads_tensor_infos_at_their_data_pointers() -> None:
    # index_select, gather, cat, a sum and two multiplies captured on the GPU: the TensorInfo arrays of the index
    # kernel carry the host stack's earlier contents (host and device addresses) past their used dims.
    table = json.loads((Path(__file__).resolve().parents[1] / "data" / "cuda_index_graph.json").read_text("utf-8"))
    drv = RecordedDriver(table)
    (node,) = [n for n in scan_graph(drv.root, drv).nodes if "indexSelect" in n.name]
    assert node.params is not None and kscan.parameter_types(node.name) is not None
    src, ids, out = 0x7F9757E00600, 0x7F9757E00400, 0x7F9742601600  # out: in the graph's private pool
    assert node.words() == [out, src, ids, 4]
    tails = {int.from_bytes(p[at : at + 8], "little") for p in node.params[:3] for at in range(8, 216, 8)}
    assert any(0x7F0000000000 <= w < 0x800000000000 for w in tails)  # the tails do hold address-like words


_BUILTINS = {"i": "int", "j": "unsigned int", "l": "long", "m": "unsigned long", "f": "float", "d": "double",
             "b": "bool", "h": "unsigned char", "x": "long long"}  # fmt: skip
_SIZES = {"int": 4, "unsigned int": 4, "long": 8, "unsigned long": 8, "float": 4, "double": 8, "bool": 1,
          "unsigned char": 1, "long long": 8}  # fmt: skip
#: sizeof(TensorInfo<T, IndexType>) by IndexType width, as the GPU's cuFuncGetParamInfo reports it (4) and as the
#: struct's definition gives it (8: 8 + 2 * 25 * 8 + 4, padded to 8).
_INFO_BYTES = {4: 216, 8: 416}


@st.composite
def _parameter(draw: st.DrawFn) -> tuple[str, str, int, bool]:
    """``(mangled, demangled, size, tensor_info)`` of one by-value kernel parameter."""
    kind = draw(st.sampled_from(["builtin", "pointer", "const_pointer", "info", "struct", "pair"]))
    code, spelled = draw(st.sampled_from(sorted(_BUILTINS.items())))
    if kind == "builtin":
        return code, spelled, _SIZES[spelled], False
    if kind == "pointer":
        return "P" + code, spelled + "*", 8, False
    if kind == "const_pointer":
        return "PK" + code, spelled + " const*", 8, False
    if kind == "struct":
        return "N2ns6ParamsE", "ns::Params", draw(st.sampled_from([8, 16, 216, 416])), False
    if kind == "pair":
        return "N2ns4PairIijEE", "ns::Pair<int, unsigned int>", draw(st.sampled_from([8, 216])), False
    const = draw(st.booleans())
    indices = [("j", "unsigned int"), ("i", "int"), ("m", "unsigned long"), ("l", "long")]
    index_code, index = draw(st.sampled_from(indices))
    element = ("K" if const else "") + code
    mangled = f"N2at4cuda6detail10TensorInfoI{element}{index_code}EE"
    spelled_info = f"at::cuda::detail::TensorInfo<{spelled}{' const' if const else ''}, {index}>"
    return mangled, spelled_info, _INFO_BYTES[_SIZES[index]], True


@settings(max_examples=200, deadline=None)
@given(
    parameters=st.lists(_parameter(), max_size=6),
    templated=st.booleans(),
    resize=st.lists(st.sampled_from([0, 0, 0, 8, -8]), min_size=6, max_size=6),
    dims=st.lists(st.integers(-2, 40), min_size=6, max_size=6),
    words=st.lists(st.integers(1, 2**64 - 1), min_size=64, max_size=64),
)
def test_parameter_types_and_limits_match_the_demangled_signature(
    parameters: list[tuple[str, str, int, bool]],
    templated: bool,
    resize: list[int],
    dims: list[int],
    words: list[int],
) -> None:
    head = "_ZN2at6native6kernelIfLi4EEEv" if templated else "_Z6kernel"
    name = head + ("".join(p[0] for p in parameters) or "v")
    assert kscan.parameter_types(name) == [p[1] for p in parameters]

    layout: list[tuple[int, int]] = []
    expected_limits: list[int] = []
    at = 0
    for (_, _, size, info), delta in zip(parameters, resize, strict=False):
        size = size + delta if info else size  # a TensorInfo of another size is not one the scan knows
        align = min(size, 8)
        at = -(-at // align) * align
        layout.append((at, size))
        expected_limits.append(8 if info and delta == 0 else size)
        at += size
    assert kscan.pointer_limits(name, tuple(layout)) == tuple(expected_limits)

    stream = itertools.cycle(words)
    params = [b"".join(_word(next(stream)) for _ in range(-(-size // 8)))[:size] for _, size in layout]
    for index, (limit, count) in enumerate(zip(expected_limits, dims, strict=False)):
        size = layout[index][1]
        if limit < size:  # a TensorInfo: its dims field after the pointer and the two arrays
            at = 8 + 2 * 25 * {216: 4, 416: 8}[size]
            params[index] = params[index][:at] + count.to_bytes(4, "little", signed=True) + params[index][at + 4 :]
            if not 0 <= count <= 25:
                expected_limits[index] = size  # bytes that are no TensorInfo: read whole
    expected = []
    for (offset, size), data, limit in zip(layout, params, expected_limits, strict=True):
        for start in range(0, size - 7):
            if (offset + start) % 8 == 0 and start + 8 <= limit:
                expected.append(int.from_bytes(data[start : start + 8], "little"))
    assert pointer_words(layout, params, name) == [w for w in expected if w]


_INFO_FLOAT_INT = "N2at4cuda6detail10TensorInfoIfiEE"  # at::cuda::detail::TensorInfo<float, int>, 216 bytes


def _pointer_batch(pointers: list[int], count: int) -> bytes:
    """``struct { float* ptrs[26]; int n; }``: 216 bytes, 8-aligned, ``n`` where TensorInfo keeps ``dims``."""
    return b"".join(_word(p) for p in pointers) + count.to_bytes(4, "little") + bytes(4)


_BATCH = [0x7F0000100000 + 0x1000 * i for i in range(26)]
#: Kernels ``k(X<...>, Z<...>, TensorInfo<float, int>, W<...>)`` whose template arguments hold comparisons or
#: operator names: an angle there is no bracket, and a split by brackets would move TensorInfo's type onto ``Z``, a
#: by-value pointer batch of 216 bytes whose count sits where TensorInfo keeps ``dims``.
_ANGLED_NAMES = {
    "comparison expressions": "_Z1kILi2EEv1XIXltT_Li3EEE1ZIXgtT_Li3EEE" + _INFO_FLOAT_INT + "1WIXgtT_Li1EEXltT_Li4EEE",
    "operator names": "_Z1k1XIXadL_ZltiiEEE1ZIXadL_ZgtiiEEE" + _INFO_FLOAT_INT + "1WIXadL_ZgtiiEEXadL_ZltiiEEE",
}


@pytest.mark.parametrize("why", sorted(_ANGLED_NAMES))
def test_a_name_whose_angles_may_be_operators_proves_nothing(why: str) -> None:
    name = _ANGLED_NAMES[why]
    assert kscan.parameter_types(name) is None, why
    layout = ((0, 8), (8, 216), (224, 216), (440, 8))
    params = [_word(0x7F0000000100), _pointer_batch(_BATCH, 3), _tensor_info(0x7F0000200000, [4], [0]), _word(8)]
    assert set(_BATCH) <= set(pointer_words(layout, params, name))


_OPERATORS = ["lt", "gt", "le", "ge", "ls", "rs", "pl", "mi", "eq", "ne"]


@st.composite
def _angled_struct(draw: st.DrawFn) -> str:
    """A struct type ``S<...>`` whose template arguments are expressions or operator functions (mangled)."""
    arguments = []
    for _ in range(draw(st.integers(1, 3))):
        operator = draw(st.sampled_from(_OPERATORS))
        if draw(st.booleans()):
            left, right = draw(st.sampled_from(["T_", "Li3E"])), f"Li{draw(st.integers(0, 9))}E"
            arguments.append(f"X{operator}{left}{right}E")
        else:
            arguments.append(f"XadL_Z{operator}iiEE")
    return f"1{draw(st.sampled_from('SUV'))}I{''.join(arguments)}E"


_SHIFTING = ["1XIXltT_Li3EEE", "1ZIXgtT_Li3EEE", "", "1WIXgtT_Li1EEXltT_Li4EEE", ""]  # the shapes that shift a split


@settings(max_examples=300, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["info", "angled", "angled", "plain"]), min_size=1, max_size=5),
    structs=st.lists(_angled_struct(), min_size=5, max_size=5),
)
@example(kinds=["angled", "angled", "info", "angled"], structs=_SHIFTING)
@example(kinds=["angled", "angled", "info", "angled"], structs=[s.replace("T_", "Li2E") for s in _SHIFTING])
def test_no_parameter_but_a_tensor_info_is_ever_read_short(kinds: list[str], structs: list[str]) -> None:
    # Whatever the demangler prints inside template arguments, a 216-byte parameter that is not a TensorInfo (here a
    # pointer batch whose count sits where TensorInfo keeps dims) is read whole.
    mangled = {"info": _INFO_FLOAT_INT, "plain": "1P"}
    name = "_Z1kILi2EEv" + "".join(mangled.get(kind, struct) for kind, struct in zip(kinds, structs, strict=False))
    layout = tuple((216 * i, 216) for i in range(len(kinds)))
    limits = kscan.pointer_limits(name, layout)
    assert all(limit == 216 for limit, kind in zip(limits, kinds, strict=True) if kind != "info"), (
        name,
        kscan.parameter_types(name),
    )
    params = [_pointer_batch(_BATCH, 3) for _ in kinds]
    words = pointer_words(layout, params, name)
    assert words.count(_BATCH[1]) >= sum(kind != "info" for kind in kinds)


def test_a_type_mangling_that_is_no_function_name_proves_nothing() -> None:
    # An extern "C" kernel's name the demangler also reads as a type, "void (TensorInfo<float, int>)".
    name = "Fv" + _INFO_FLOAT_INT + "E"
    assert kscan.parameter_types(name) is None
    assert set(_BATCH) <= set(pointer_words(((0, 216),), [_pointer_batch(_BATCH, 3)], name))


def test_a_type_nested_in_a_tensor_info_is_not_a_tensor_info() -> None:
    name = "_Z1kN2at4cuda6detail10TensorInfoIfiE1XIciEE"  # k(TensorInfo<float, int>::X<char, int>)
    assert kscan.parameter_types(name) == ["at::cuda::detail::TensorInfo<float, int>::X<char, int>"]
    assert kscan.pointer_limits(name, ((0, 216),)) == (216,)


@pytest.mark.parametrize("name", ["_Z1k\ud800", "\ud800", "_Z1k\u00e9i"])
def test_a_name_that_is_no_ascii_proves_nothing_and_raises_nothing(name: str) -> None:
    # A recorded table (JSON) may carry any string; the driver decodes with errors="replace".
    assert kscan.parameter_types(name) is None
    assert pointer_words(((0, 8),), [_word(0x7F0000001000)], name) == [0x7F0000001000]
    assert GraphNode("kernel", name=name, layout=((0, 8),), params=(_word(0x1000),)).words() == [0x1000]


# -- names whose template arguments compare names -------------------------------------------------------------------
#: k(X<a<b>, Z<a>=b>, TensorInfo<float, int>, W<a>=b, a<b>): four parameters. The demangler prints ``a<b`` and
#: ``a>=b`` between names bare (only ``>`` is wrapped), so their angles follow an identifier as a template bracket's
#: would, and a split by brackets gives ``["X<a<b>, Z<a>=b>", "TensorInfo<float, int>", "W<a>=b", "a<b>"]``: four
#: parts, the count matches, and TensorInfo's type lands on the 216-byte ``Z<...>``. No such name is read.
SHIFTED_NAMES = {
    "unresolved names": "_Z1k1XIXlt1a1bEE1ZIXge1a1bEE" + _INFO_FLOAT_INT + "1WIXge1a1bEXlt1a1bEE",
    "external names": "_Z1k1XIXltL_Z1aEL_Z1bEEE1ZIXgeL_Z1aEL_Z1bEEE"
    + _INFO_FLOAT_INT
    + "1WIXgeL_Z1aEL_Z1bEEXltL_Z1aEL_Z1bEEE",
    # The SFINAE shape of real templates: enable_if<(T::value < N)>, printed "float::value<b".
    "dependent member": "_Z1kIfEv1XIXltsrT_5valueL_Z1bEEE1ZIXgesrT_5valueL_Z1bEEE" + _INFO_FLOAT_INT
    + "1WIXgesrT_5valueL_Z1bEEXltsrT_5valueL_Z1bEEE",
}  # fmt: skip


def test_comparisons_between_names_do_not_move_a_tensor_info_onto_another_parameter() -> None:
    layout = ((0, 8), (8, 216), (224, 216), (440, 8))
    params = [_word(0x7F0000000100), _pointer_batch(_BATCH, 3), _tensor_info(0x7F0000200000, [1], [0]), _word(8)]
    failures = {}
    for why, name in SHIFTED_NAMES.items():
        limits = kscan.pointer_limits(name, layout)
        missing = set(_BATCH) - set(pointer_words(layout, params, name))
        if limits[1] != 216 or missing:
            failures[why] = (kscan.parameter_types(name), limits, len(missing))
    assert not failures, failures


#: k(TensorInfo<X<a<b>, int>::N<c>=d, int>): one parameter, a member template ``N`` of a TensorInfo, no TensorInfo.
#: ``X<a<b>`` opens one angle too many and ``c>=d`` closes it, so the type's text starts with TensorInfo's prefix,
#: ends with ``>``, and splits into ``["X<a<b>, int>::N<c>=d", "int"]``.
NESTED = "_Z1kN2at4cuda6detail10TensorInfoI1XIXlt1a1bEEiE1NIXge1c1dEiEE"


def test_a_member_template_of_a_tensor_info_with_comparison_arguments_is_not_a_tensor_info() -> None:
    assert kscan.pointer_limits(NESTED, ((0, 216),)) == (216,), kscan.parameter_types(NESTED)
    assert set(_BATCH) <= set(pointer_words(((0, 216),), [_pointer_batch(_BATCH, 3)], NESTED))


#: void (*k<int>(ns::Params))(TensorInfo<float, int>): the last balanced (...) is the returned function type's
#: parameter list, not k's (k takes one 216-byte ns::Params). No __global__ kernel returns non-void, so a real
#: kernel name never has this shape; it still reads a non-TensorInfo short.
RETURNS_FUNCTION = "_Z1kIiEPFv" + _INFO_FLOAT_INT + "EN2ns6ParamsE"


def test_a_returned_function_types_parameter_list_is_not_the_kernels() -> None:
    assert kscan.pointer_limits(RETURNS_FUNCTION, ((0, 216),)) == (216,), kscan.parameter_types(RETURNS_FUNCTION)


_COMPARED = ["1a", "1b", "L_Z1cE", "srT_5valueE", "Li3E", "T_"]
_COMPARISONS = ["lt", "gt", "le", "ge", "rs", "ls", "eq"]


@st.composite
def _comparison(draw: st.DrawFn) -> str:
    return (
        f"X{draw(st.sampled_from(_COMPARISONS))}{draw(st.sampled_from(_COMPARED))}{draw(st.sampled_from(_COMPARED))}E"
    )


@st.composite
def _compared_struct(draw: st.DrawFn) -> str:
    arguments = draw(st.lists(st.one_of(_comparison(), st.sampled_from(["i", "f", "Li2E"])), min_size=1, max_size=3))
    return f"1{draw(st.sampled_from('SUVW'))}I{''.join(arguments)}E"


@st.composite
def _compared_parameter(draw: st.DrawFn) -> tuple[str, bool]:
    """``(mangled, is_tensor_info)`` of a 216-byte by-value parameter."""
    kind = draw(st.sampled_from(["info", "struct", "struct", "nested"]))
    if kind == "info":
        return _INFO_FLOAT_INT, True
    if kind == "struct":
        return draw(_compared_struct()), False
    inner = draw(_compared_struct())  # TensorInfo<S<...>, int>::N<...>: a member template of a TensorInfo
    return f"N2at4cuda6detail10TensorInfoI{inner}iE1NI{draw(_comparison())}iEE", False


@settings(max_examples=500, deadline=None)
@given(parameters=st.lists(_compared_parameter(), min_size=1, max_size=5), templated=st.booleans())
@example(
    parameters=[
        ("1XIXlt1a1bEE", False),
        ("1ZIXge1a1bEE", False),
        (_INFO_FLOAT_INT, True),
        ("1WIXge1a1bEXlt1a1bEE", False),
    ],
    templated=False,
)
def test_no_parameter_but_a_tensor_info_is_read_short_whatever_the_comparisons(
    parameters: list[tuple[str, bool]], templated: bool
) -> None:
    name = ("_Z1kIfEv" if templated else "_Z1k") + "".join(mangled for mangled, _ in parameters)
    layout = tuple((216 * i, 216) for i in range(len(parameters)))
    limits = kscan.pointer_limits(name, layout)
    wrong = [
        i for i, ((_, info), limit) in enumerate(zip(parameters, limits, strict=True)) if not info and limit != 216
    ]
    assert not wrong, (name, kscan.parameter_types(name), limits)


_SPELLED = "at::cuda::detail::TensorInfo<float, int>"


def test_a_source_name_that_spells_a_tensor_info_proves_nothing() -> None:
    # One source name of 40 characters whose bytes spell the type: the demangler prints them as they are,
    # "f(at::cuda::detail::TensorInfo<float, int>, TensorInfo<int>)", though no C++ name holds ':', '<', ',' or ' '.
    name = f"_Z1f{len(_SPELLED)}{_SPELLED}10TensorInfoIiE"  # f(<that name>, TensorInfo<int>)
    assert kscan.parameter_types(name) is None
    layout = ((0, 216), (216, 8))
    assert kscan.pointer_limits(name, layout) == (216, 8)
    assert set(_BATCH) <= set(pointer_words(layout, [_pointer_batch(_BATCH, 0), _word(1)], name))


def _doubling(levels: int) -> str:
    """``f(A<int>, B<A<int>, A<int> >, B<B<...>, B<...> >, ...)``: each parameter names the one before twice through
    a back-reference, so the signature doubles per parameter while the name grows by 8 characters."""
    name = "_Z1f1AIiE1BIS0_S0_E"
    for earlier in range(2, 2 + levels):
        ref = f"S{earlier if earlier < 10 else chr(ord('A') + earlier - 10)}_"
        name += f"S1_I{ref}{ref}E"
    return name


def test_a_name_that_spells_no_tensor_info_is_not_demangled(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(name: str) -> str:
        raise AssertionError(f"demangled {name[:40]}")

    kscan.pointer_limits.cache_clear()
    monkeypatch.setattr(torch._C, "_demangle", refuse, raising=False)
    name = _doubling(19)  # a 231-character name whose signature is about 25 MB
    assert len(name) < 300
    assert kscan.pointer_limits(name, ((0, 8),) * 21) == (8,) * 21
    assert kscan.pointer_limits("triton_poi_fused_0", ((0, 8),)) == (8,)
    kscan.pointer_limits.cache_clear()


def test_a_signature_past_its_bound_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    types = ", ".join([_SPELLED] + ["int"] * (kscan.SIGNATURE_CHARS // 5))
    monkeypatch.setattr(torch._C, "_demangle", lambda name: f"k({types})", raising=False)
    assert kscan.parameter_types("_Z1kN2at4cuda6detail10TensorInfoIfiEE") is None
    assert kscan.parameter_types("_Z1k" + "i" * kscan.MANGLED_NAME_CHARS) is None


def test_names_that_prove_nothing_give_no_parameter_types() -> None:
    assert kscan.parameter_types("triton_poi_fused_add_0") is None  # not mangled
    assert kscan.parameter_types("") is None
    assert kscan.parameter_types("_Z6kernelv") == []
    assert kscan.parameter_types("_ZN12_GLOBAL__N_16kernelEfi") == ["float", "int"]  # (anonymous namespace)
    assert kscan.parameter_types("_ZN12_GLOBAL__N_16kernelEPFviEi") is None  # a function type: not read for certain


# -- the node walk on a recorded table ------------------------------------------------------------------------------
TABLE: dict[str, Any] = {
    "root": 100,
    "graphs": {
        "100": [
            {"type": "kernel", "name": "gemm", "layout": [[0, 8], [8, 8], [16, 4]],
             "params": [_word(0x1000).hex(), _word(0x2008).hex(), "05000000"]},
            {"type": "memset", "pointers": [0x3000]},
            {"type": "graph", "graph": 200},
            {"type": "kernel", "name": "packed", "layout": [[0, 8]], "params": None},
            {"type": "host"},
            {"type": "empty"},
        ],
        "200": [
            {"type": "memcpy", "pointers": [0x4000, 0x5000]},
            {"type": "kernel", "name": "triton_fused", "layout": [[0, 8]], "params": [_word(0x6000).hex()]},
        ],
    },
}  # fmt: skip


def test_node_walk_reads_kernels_copies_and_child_graphs() -> None:
    drv = RecordedDriver(TABLE)
    scan = scan_graph(drv.root, drv)
    assert scan.kernel_names == ["gemm", "packed", "triton_fused"]
    assert scan.counts() == {"kernel": 3, "memset": 1, "memcpy": 1}
    words = sorted(w for node in scan.nodes for w in node.words())
    assert words == [0x1000, 0x2008, 0x3000, 0x4000, 0x5000, 0x6000]


def test_node_walk_notes_extra_parameters_and_unread_node_types() -> None:
    drv = RecordedDriver(TABLE)
    scan = scan_graph(drv.root, drv)
    assert scan.notes == [
        "kernel packed: parameters passed through 'extra' are not read by the kernel scan",
        "a host node is not read by the kernel scan",
    ]
    packed = next(n for n in scan.nodes if n.name == "packed")
    assert packed.words() == []


def test_recorded_table_round_trips() -> None:
    drv = RecordedDriver(TABLE)
    again = RecordedDriver(record_table(drv.root, drv))
    assert scan_graph(again.root, again).nodes == scan_graph(drv.root, drv).nodes


def test_unknown_graph_is_unavailable() -> None:
    with pytest.raises(ScanUnavailable, match="no recorded graph 7"):
        scan_graph(7, RecordedDriver(TABLE))


# -- addresses to storages -----------------------------------------------------------------------------------------
def _segments() -> list[dict[str, Any]]:
    return [
        {"address": 0x10000, "total_size": 0x4000, "segment_pool_id": (0, 0), "blocks": [
            {"address": 0x10000, "size": 0x1000, "state": "active_allocated"},  # model weight
            {"address": 0x11000, "size": 0x1000, "state": "active_allocated"},  # a module-level cache
            {"address": 0x12000, "size": 0x1000, "state": "inactive"},  # freed
            {"address": 0x13000, "size": 0x1000, "state": "active_allocated"},  # a library's workspace
        ]},
        {"address": 0x20000, "total_size": 0x2000, "segment_pool_id": (1, 0), "blocks": [
            {"address": 0x20000, "size": 0x1000, "state": "active_allocated"},
            {"address": 0x21000, "size": 0x1000, "state": "inactive"},
        ]},
        {"address": 0x30000, "total_size": 0x1000, "segment_pool_id": (0, 0), "blocks": [
            {"address": 0x30000, "size": 0x1000, "state": "active_allocated"},  # a static input
        ]},
    ]  # fmt: skip


def test_storage_view_says_what_each_address_is() -> None:
    weight, cache, static_input = object(), object(), torch.zeros(2)
    view = StorageView(
        [(0x10000, 0x1000, weight)],
        [],
        _segments(),
        others=[(0x11000, 0x1000, cache)],
    )
    view._ignored = kscan._Intervals([(0x30000, 0x1000, static_input)])
    got = {hex(a): view.locate(a).what for a in (0x10010, 0x11000, 0x12040, 0x13000, 0x20010, 0x21010, 0x30008, 0x99)}
    assert got == {
        "0x10010": "model",
        "0x11000": "unowned",
        "0x12040": "freed",
        "0x13000": "foreign",  # allocated, but no Python tensor holds it (a library's workspace)
        "0x20010": "private",
        "0x21010": "private",  # a graph pool's free block still backs that graph's intermediates
        "0x30008": "ignored",
        "0x99": "foreign",  # the allocator never handed it out (NCCL's, cuBLAS's own)
    }
    assert view.locate(0x10010).offset == 0x10 and view.locate(0x10010).storage is weight


class _NoMemory(torch.Tensor):
    """Stands for the FakeTensors compiling leaves on the heap: asking for their memory raises."""

    def untyped_storage(self) -> torch.UntypedStorage:
        raise RuntimeError("Cannot access data pointer of Tensor (e.g. FakeTensor, FunctionalTensor)")


def test_live_tensors_without_memory_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = torch.Tensor._make_subclass(_NoMemory, torch.zeros(4))
    cache = torch.zeros(4)
    address = cache.untyped_storage().data_ptr()
    monkeypatch.setattr(kscan, "live_tensors", lambda: iter([fake, cache]))
    segment = {"address": address, "total_size": 16, "blocks": [{"address": address, "size": 16, "state": "active"}]}
    view = StorageView([], [], [segment])
    assert view.locate(address).what == "unowned" and view.locate(address).storage is cache


def test_views_of_one_storage_share_a_range_without_comparing_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = torch.zeros(4, 4)
    address = cache.untyped_storage().data_ptr()
    monkeypatch.setattr(kscan, "live_tensors", lambda: iter([cache, cache.t(), cache[1:]]))
    segment = {"address": address, "total_size": 64, "blocks": [{"address": address, "size": 64, "state": "active"}]}
    view = StorageView([(address, 64, cache), (address, 64, cache.view(16))], [], [segment])
    assert view.locate(address + 8).what == "model"
    assert StorageView([], [], [segment]).locate(address + 8).what == "unowned"


def test_a_range_nested_in_a_larger_one_does_not_hide_it() -> None:
    # A storage made over part of another's memory (from_blob, DLPack): an address past the inner one, inside the
    # outer one, is still the outer one's, even with a disjoint range after the inner one.
    outer, inner, after = object(), object(), object()
    ranges = kscan._Intervals([(0x1000, 0x1000, outer), (0x1100, 0x100, inner), (0x1400, 0x100, after)])
    assert ranges.find(0x1180) == (0x1100, 0x1200, inner)
    assert ranges.find(0x1300) == (0x1000, 0x2000, outer)
    assert ranges.find(0x1480) == (0x1400, 0x1500, after)
    assert ranges.find(0x1500) == (0x1000, 0x2000, outer)
    assert ranges.find(0x2000) is None and ranges.find(0xFFF) is None


def test_attribute_keeps_the_lowest_offset_and_first_kernel() -> None:
    weight, cache = torch.zeros(4), torch.zeros(4)
    view = StorageView([(0x10000, 0x1000, weight)], [], _segments(), others=[(0x11000, 0x1000, cache)])
    scan = kscan.GraphScan(
        nodes=[
            GraphNode("kernel", "a", ((0, 8), (8, 8)), (_word(0x10100), _word(0x12000))),
            GraphNode("kernel", "b", ((0, 8), (8, 8)), (_word(0x10008), _word(0x11000))),
        ]
    )
    facts = kscan.attribute(scan, view)
    (model_fact,) = facts.model.values()
    assert model_fact[1:] == (0x8, "a")
    assert [fact[0] is cache for fact in facts.unowned.values()] == [True]
    assert facts.freed == [(0x12000, 0x1000, "a")]
    assert facts.counts == {"model": 2, "freed": 1, "unowned": 1}


# -- the manifest from a fake driver --------------------------------------------------------------------------------
_CACHE: dict[str, torch.Tensor] = {}


class Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.register_buffer("held_unread", torch.randn(4))
        _CACHE["table"] = torch.randn(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + _CACHE["table"]


class FakeGraph:
    """A keep_graph CUDAGraph stand-in whose raw graph is a recorded table's root."""

    def __init__(self, root: int | None) -> None:
        self.root = root

    def raw_cuda_graph(self) -> int:
        if self.root is None:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance unless CUDAGraph was initialized "
                               "with keep_graph=true")  # fmt: skip
        return self.root


def _table(*tensors: torch.Tensor) -> dict[str, Any]:
    params = [_word(t.untyped_storage().data_ptr()).hex() for t in tensors]
    layout = [[8 * i, 8] for i in range(len(tensors))]
    return {"root": 1, "graphs": {"1": [{"type": "kernel", "name": "fused", "layout": layout, "params": params}]}}


def test_kernel_scan_manifest_flags_unowned_alive_storage_and_counts_unread_slots(fake_cuda: dict[str, Any]) -> None:
    model = Cached()
    x, out = torch.randn(2, 4), torch.zeros(2, 4)
    fake_cuda["table"] = _table(model.weight, _CACHE["table"], x, out)
    fake_cuda["tensors"] = [model.weight, model.held_unread, _CACHE["table"], x, out]
    contract = GraphContract(model, "recapture").seal()
    with record_capture(contract, name="g", graph=FakeGraph(1), ignore=[x, out]) as manifest:
        pass
    assert manifest.backends() == {"g": "kernel-scan"} and manifest.complete
    (unowned,) = manifest.unowned()
    assert unowned.storage_ref() is _CACHE["table"].untyped_storage()
    held = {h.where for e in manifest.storages() for h in e.holders}
    assert held == {"<model>:weight"}  # inputs and outputs are registered, never unowned; held_unread is not read
    assert all(e.backend == "kernel-scan" and e.op == "fused" for e in manifest.storages())

    with contextlib.suppress(ReloadFailedError), contract.reload(), torch.no_grad():
        model.weight.copy_(torch.randn(4, 4))
    outcome = contract.last_outcome
    # read by the graph, held at no model path and unwritten by the reload: a recapture would read the same bytes
    assert outcome is not None and outcome.status is Status.FAILED
    (finding,) = outcome.problems
    assert finding.kind is FindingKind.STALE and finding.path == ""
    assert "capture manifest (kernel scan): unowned captured storage" in finding.detail
    assert outcome.slots_unread == 1  # held_unread

    contract.reseal(recaptured=True)  # as if recaptured (the same table is read again)
    with contextlib.suppress(ReloadFailedError), contract.reload(), torch.no_grad():
        _CACHE["table"].add_(1)  # written in place: a recapture reads what PWAL left there
    outcome = contract.last_outcome
    assert outcome is not None and [f.kind for f in outcome.problems] == [FindingKind.ORPHANED]


@pytest.mark.parametrize("name", [INDEX_SELECT, "index_select_kernel"])
def test_an_earlier_pointer_left_in_a_tensor_info_is_no_unowned_read(fake_cuda: dict[str, Any], name: str) -> None:
    # The unused dims of a TensorInfo hold a pointer to a live tensor no model path holds (an earlier op's): the
    # graph never reads it. Only a name that proves the layout lets the scan pass it by.
    model = Cached()
    ids, out, stray = torch.tensor([1, 0, 3, 2]), torch.zeros(4, 4), torch.randn(16)
    garbage = [stray.untyped_storage().data_ptr()]
    params = [
        _tensor_info(out.untyped_storage().data_ptr(), [4, 4], garbage),
        _tensor_info(model.weight.untyped_storage().data_ptr(), [4, 4], garbage),
        _tensor_info(ids.untyped_storage().data_ptr(), [4], garbage),
        (1).to_bytes(4, "little"), (0).to_bytes(4, "little"), (4).to_bytes(4, "little"), _word(4),
    ]  # fmt: skip
    row = {"type": "kernel", "name": name, "layout": INDEX_SELECT_LAYOUT, "params": [p.hex() for p in params]}
    fake_cuda["table"] = {"root": 1, "graphs": {"1": [row]}}
    fake_cuda["tensors"] = [model.weight, ids, out, stray]
    contract = GraphContract(model, "recapture").seal()
    with record_capture(contract, name="g", graph=FakeGraph(1), ignore=[ids, out]) as manifest:
        pass
    unowned = [entry.storage_ref() for entry in manifest.unowned()]
    if name == INDEX_SELECT:
        assert unowned == []
        with contract.reload(), torch.no_grad():
            model.weight.copy_(torch.randn(4, 4))
        assert contract.last_outcome is not None and contract.last_outcome.committed
    else:
        assert unowned == [stray.untyped_storage()]


def test_dispatch_recorded_captures_leave_unread_unknown(fake_cuda: dict[str, Any]) -> None:
    model = Cached()
    contract = GraphContract(model, "recapture").seal()
    with torch.no_grad(), record_capture(contract, name="eager", backend="dispatch") as manifest:
        model(torch.randn(2, 4))
    assert manifest.backends() == {"eager": "dispatch"} and not manifest.complete
    assert manifest.unread(contract) is None


def test_a_word_into_a_free_block_is_noted_and_a_scanned_storage_freed_later_is_dead(
    fake_cuda: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Cached()
    fake_cuda["table"] = _table(model.weight, _CACHE["table"])
    contract = GraphContract(model, "recapture").seal()
    free = torch.randn(8)
    address = free.untyped_storage().data_ptr()
    fake_cuda["table"]["graphs"]["1"].append({"type": "memset", "pointers": [address]})
    fake_cuda["tensors"] = [model.weight, _CACHE["table"]]
    base = kscan.allocator_segments
    block = {"address": address, "total_size": 32, "blocks": [{"address": address, "size": 32, "state": "inactive"}]}
    monkeypatch.setattr(kscan, "allocator_segments", lambda: [*base(), block])
    with record_capture(contract, name="g", graph=FakeGraph(1)) as manifest:
        pass
    (note,) = manifest.notes
    assert "1 parameter word(s) point into free allocator blocks" in note and "not attributed" in note
    with contextlib.suppress(ReloadFailedError), contract.reload():
        pass
    outcome = contract.last_outcome
    # alive, unowned and unwritten
    assert outcome is not None and [f.kind for f in outcome.problems] == [FindingKind.STALE]
    contract.reseal(recaptured=True)  # as if recaptured (the same table is read again)

    # The cache the graph reads (no model path holds it) is replaced and freed: replay reads freed memory.
    fake_cuda["tensors"] = []  # the fake allocator view held it too
    with contract.reload():
        _CACHE["table"] = torch.randn(4)
    outcome = contract.last_outcome
    assert outcome is not None and outcome.status is Status.NEEDS_RECAPTURE
    (dead,) = outcome.problems
    assert dead.kind is FindingKind.DEAD and "capture manifest (kernel scan): unowned" in dead.detail


# -- fallbacks -----------------------------------------------------------------------------------------------------
def test_graph_without_keep_graph_falls_back_to_the_dispatch_recorder_with_a_note(fake_cuda: dict[str, Any]) -> None:
    model = Cached()
    contract = GraphContract(model, "recapture").seal()
    with (
        pytest.warns(UserWarning, match=r"capture 'g': kernel scan unavailable: .*keep_graph=True.*dispatch recorder"),
        torch.no_grad(),
        record_capture(contract, name="g", graph=FakeGraph(None)) as manifest,
    ):
        model(torch.randn(2, 4))
    assert manifest.backends() == {"g": "dispatch"}
    assert len(manifest.notes) == 1 and "keep_graph" in manifest.notes[0]
    assert {h.where for e in manifest.storages() for h in e.holders} == {"<model>:weight"}


def test_kernel_backend_refuses_what_it_cannot_scan(fake_cuda: dict[str, Any]) -> None:
    model = Cached()
    contract = GraphContract(model, "recapture").seal()
    with (
        pytest.raises(GraphSafeError, match="collectors: capture 'g': kernel scan unavailable"),
        record_capture(contract, name="g", graph=FakeGraph(None), backend="kernel"),
    ):
        pass
    with (
        pytest.raises(GraphSafeError, match=r"backend='kernel'\) for capture 'h' needs graph="),
        record_capture(contract, name="h", backend="kernel"),
    ):
        pass
    with (
        pytest.raises(GraphSafeError, match="record_capture\\(backend='cupti'\\) is not a backend"),
        record_capture(contract, backend="cupti"),
    ):
        pass


def test_missing_cuda_bindings_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setattr(kscan, "_DRIVER", None)
    with pytest.raises(ScanUnavailable, match=r"pip install 'cuda-bindings>=12.4'"):
        kscan.driver()


def test_missing_bindings_fall_back_in_auto_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setattr(kscan, "_DRIVER", None)
    model = Cached()
    contract = GraphContract(model, "recapture").seal()
    with (
        pytest.warns(UserWarning, match="cuda-bindings is not installed"),
        torch.no_grad(),
        record_capture(contract, name="g", graph=FakeGraph(1)) as manifest,
    ):
        model(torch.randn(2, 4))
    assert isinstance(manifest, Manifest) and manifest.backends() == {"g": "dispatch"}


# -- a node table recorded on the H200 (tests/gpu/test_kernel_scan.py writes it) ------------------------------------
def test_a_table_recorded_on_the_gpu_decodes_to_the_storages_the_graph_reads() -> None:
    # Mlp(64): up = Linear(64, 256), gelu, down = Linear(256, 64), a held but unread buffer; x is 8 x 64. Captured by
    # the torch adapter: cuBLAS gemv, ATen's gelu, cuBLAS gemv, the copy into the static output.
    table = json.loads(
        (Path(__file__).resolve().parents[1] / "data" / "h200_mlp_graph.json").read_text(encoding="utf-8")
    )
    drv = RecordedDriver(table)
    scan = scan_graph(drv.root, drv)
    assert [n.kind for n in scan.nodes] == ["kernel", "kernel", "kernel", "memcpy"]
    assert "cublas" in scan.nodes[0].name and "Gelu" in scan.nodes[1].name
    base, private = 0x7F9B27E00000, 0x7F9B1AA00000
    model = {
        "up.weight": (base, 0x10000),
        "up.bias": (base + 0x10000, 0x400),
        "down.weight": (base + 0x10400, 0x10000),
        "down.bias": (base + 0x20400, 0x100),
        "held_unread": (base + 0x20500, 0x100),
    }
    segments = [
        {"address": base, "total_size": 0x200000, "segment_pool_id": (0, 0), "blocks": [
            *({"address": a, "size": n, "state": "active_allocated"} for a, n in model.values()),
            {"address": base + 0x21000, "size": 0x800, "state": "active_allocated"},  # x
            {"address": base + 0x21800, "size": 0x800, "state": "active_allocated"},  # the static output
        ]},
        {"address": private, "total_size": 0x200000, "segment_pool_id": (1, 0), "blocks": [
            {"address": private, "size": 0x200000, "state": "inactive"},
        ]},
    ]  # fmt: skip
    view = StorageView([(a, n, name) for name, (a, n) in model.items()], [], segments, others=[])
    view._ignored = kscan._Intervals([(base + 0x21000, 0x800, "x"), (base + 0x21800, 0x800, "out")])
    facts = kscan.attribute(scan, view)
    assert sorted(payload for payload, _, _ in facts.model.values()) == [
        "down.bias",
        "down.weight",
        "up.bias",
        "up.weight",
    ]  # held_unread: not read
    assert facts.unowned == {} and facts.freed == []
    assert facts.counts["ignored"] == 2  # x read by the first gemv, the output written by the copy
    assert facts.counts["private"] == 8  # the intermediates, chained through the graph's pool
    # cuBLAS's parameter struct also holds host pointers (alpha, beta) and packed integers: not device memory.
    assert facts.counts["foreign"] == 18


# -- the vLLM runner's capture (no vLLM needed: the hook's recording step with a fake runner) --------------------------
class FakeTorchGraph:
    """Stands for torch.cuda.CUDAGraph on CPU: scannable only when made with keep_graph=True."""

    def __new__(cls, keep_graph: bool = False) -> FakeTorchGraph:
        graph = super().__new__(cls)
        graph.keep_graph = keep_graph
        return graph

    def raw_cuda_graph(self) -> int:
        if not self.keep_graph:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance unless CUDAGraph was initialized "
                               "with keep_graph=true")  # fmt: skip
        return 1


def test_vllm_capture_hook_scans_every_graph_the_runner_makes(
    fake_cuda: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Cached()
    input_ids, kv_cache = torch.zeros(8), torch.zeros(16)
    runner = SimpleNamespace(model=model, input_ids=SimpleNamespace(gpu=input_ids), kv_caches=[kv_cache])
    fake_cuda["table"] = _table(model.weight, _CACHE["table"], input_ids, kv_cache)
    fake_cuda["tensors"] = [model.weight, _CACHE["table"], input_ids, kv_cache]
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeTorchGraph)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    contract = GraphContract(model, "recapture").seal()
    state = SimpleNamespace(config=SimpleNamespace(record_manifest=True))
    with vllm_hooks._maybe_record(state, contract, runner):  # type: ignore[arg-type]
        graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]  # what vLLM's capture does
    assert all(g.keep_graph for g in graphs) and torch.cuda.CUDAGraph is FakeTorchGraph
    manifest = contract.manifest
    assert isinstance(manifest, Manifest)
    assert manifest.backends() == {"vllm-0": "kernel-scan", "vllm-1": "kernel-scan"}
    contract.reseal()  # what the capture wrapper does next: it ties the scanned storages to model paths
    # the runner's input buffer and KV cache are registered: only the module-level cache is unowned
    assert [id(e.storage_ref()) for e in manifest.unowned()] == [id(_CACHE["table"].untyped_storage())]
    assert {h.where for e in manifest.storages() for h in e.holders} == {"<model>:weight"}


def test_vllm_capture_hook_falls_back_to_the_dispatch_recorder_without_the_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = Cached()
    contract = GraphContract(model, "recapture").seal()
    state = SimpleNamespace(config=SimpleNamespace(record_manifest=True))
    with torch.no_grad(), vllm_hooks._maybe_record(state, contract, None):  # type: ignore[arg-type]
        model(torch.randn(2, 4))
    assert isinstance(contract.manifest, Manifest) and contract.manifest.backends() == {"vllm": "dispatch"}


def test_read_ranges_take_words_near_the_top_of_the_address_space() -> None:
    """A kernel word like 0xffff_ffff_ffff_fff8 (a sentinel, -8) plus its span passes 2**64: the ranges keep it,
    bounded, instead of failing the whole scan (seen on the H200 with a Marlin-style workspace kernel)."""
    top = (1 << 64) - 8
    ranges = kscan.ReadRanges([(top, top + 64), (0x1000, 0x2000)])
    assert ranges.overlaps(top, top + 8)
    assert ranges.overlaps(0x1800, 0x1801)
    assert not ranges.overlaps(0x3000, 0x4000)


# -- pointer tables over POINTER_ARRAY_BYTES: searched on their own device ---------------------------------------------
_FAR = 0x1000_0000_0000  # synthetic memory, far from any real allocation of this process


def _kernel_reading(*addresses: int) -> kscan.GraphScan:
    return kscan.GraphScan([GraphNode("kernel", "grouped", tuple((8 * i, 8) for i in range(len(addresses))),
                                tuple(_word(a) for a in addresses))])  # fmt: skip


def _located_reads(scan: kscan.GraphScan, view: StorageView, table: torch.Tensor) -> kscan.ReadRanges:
    """The oracle: the reads when the whole table is read to host and every word of it located, whatever its size."""
    ranges = []
    for node in scan.nodes:
        for address in node.words():
            where = view.locate(address)
            ranges.append((where.base, where.base + max(where.nbytes, 1)))
    for address in set(kscan.pointer_array_words(table)):
        where = view.locate(address)
        if where.what != "foreign" or where.nbytes:
            ranges.append((where.base, where.base + max(where.nbytes, 1)))
    return kscan.ReadRanges(ranges)


@st.composite
def _memory(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[tuple[int, int, Any]], list[tuple[int, int, Any]]]:
    """Synthetic allocator segments (blocks allocated, free or private), model storages and other tensors in them."""
    segments: list[dict[str, Any]] = []
    model: list[tuple[int, int, Any]] = []
    others: list[tuple[int, int, Any]] = []
    for index in range(draw(st.integers(1, 3))):
        at = base = _FAR + index * 0x100000
        blocks = []
        for _ in range(draw(st.integers(1, 4))):
            size = draw(st.sampled_from([0x200, 0x1000, 0x3000]))
            state = draw(st.sampled_from(["active_allocated", "inactive"]))
            blocks.append({"address": at, "size": size, "state": state})
            if state == "active_allocated":
                held = draw(st.sampled_from(["model", "other", "nothing"]))
                nbytes = draw(st.sampled_from([size, size // 2, 8]))
                if held != "nothing":
                    (model if held == "model" else others).append((at, nbytes, torch.zeros(1)))
            at += size
        private = draw(st.booleans())
        segments.append({"address": base, "total_size": at - base + draw(st.sampled_from([0, 0x800])),
                         "segment_pool_id": (1, 0) if private else (0, 0), "blocks": blocks})  # fmt: skip
    return segments, model, others


@settings(max_examples=200, deadline=None, derandomize=True)
@given(memory=_memory(), data=st.data())
def test_a_large_table_searched_on_its_device_reads_what_locating_every_word_would(
    data: st.DataObject, memory: Any
) -> None:
    """The rule: a storage over POINTER_ARRAY_BYTES is searched on its device against the memory not yet known to be
    read (``StorageView.unread_spans``, ``search_words``); the reads must be exactly those of copying it to host and
    locating every aligned word (the small tables' rule), whatever the table holds: pointers to the start, inside,
    last byte or just past any storage, block or segment, to a registered input, to memory the kernel reads
    directly, and integers; in steps of any size."""
    segments, model, others = memory
    table = torch.zeros(kscan.POINTER_ARRAY_BYTES // 8 + 1, dtype=torch.int64)
    given_input = torch.zeros(4)
    ranges = [(int(s["address"]), int(s["address"]) + int(s["total_size"])) for s in segments]
    ranges += [(b["address"], b["address"] + b["size"]) for s in segments for b in s["blocks"]]
    ranges += [(at, at + n) for at, n, _ in model + others]
    ranges.append((given_input.data_ptr(), given_input.data_ptr() + 16))
    targets = [start + d for start, end in ranges for d in (-1, 0, 8, end - start - 1, end - start)]
    words = data.draw(st.lists(st.sampled_from(targets) | st.integers(0, (1 << 64) - 1), max_size=12))
    last = table.numel() - 1
    edges = st.sampled_from([0, 1023, 1024, last])  # the first and last word, a step's edges
    positions = data.draw(st.lists(edges | st.integers(0, last), min_size=len(words), max_size=len(words)))
    for position, value in zip(positions, words, strict=True):
        table[position] = value - (1 << 64) if value >= 1 << 63 else value
    held = [at for at, _, _ in model + others]  # a kernel reading a storage leaves the rest of its block unread
    direct = data.draw(st.lists(st.sampled_from(held or targets) | st.sampled_from(targets), max_size=4))
    view = StorageView([(table.data_ptr(), table.untyped_storage().nbytes(), table), *model], [given_input], segments,
                       others=others)  # fmt: skip
    scan = _kernel_reading(table.data_ptr(), *direct)
    with mock.patch.object(kscan, "SEARCH_CHUNK_WORDS", data.draw(st.sampled_from([1 << 10, 1 << 24]))):
        facts = kscan.attribute(scan, view)
    expected = _located_reads(_kernel_reading(table.data_ptr(), *direct), view, table)
    assert not scan.incomplete, scan.incomplete
    assert facts.tables == 1
    assert (list(facts.reads._starts), list(facts.reads._ends)) == (list(expected._starts), list(expected._ends))


@pytest.mark.parametrize("nbytes", [64, kscan.POINTER_ARRAY_BYTES + 64], ids=["small", "large"])
def test_a_table_at_an_unaligned_address_is_read_at_its_aligned_words(nbytes: int) -> None:
    """A table whose storage does not start at an 8-aligned address (memory wrapped with ``frombuffer`` or DLPack):
    a kernel loads its pointers from 8-aligned addresses, so those are the words read, not the storage's first
    eight bytes and every eighth after (which straddle two pointers); a large one is searched all the same."""
    memory = bytearray(nbytes + 16)
    table = torch.frombuffer(memory, dtype=torch.uint8, offset=3, count=nbytes)
    base = table.untyped_storage().data_ptr()
    assert base % 8, "frombuffer gave an aligned storage: the test needs another offset"
    target = torch.zeros(4)
    at = -base % 8 + 8  # the second aligned word
    table[at : at + 8] = torch.tensor([target.data_ptr()], dtype=torch.int64).view(torch.uint8)
    view = StorageView([(base, nbytes, table), (target.data_ptr(), 16, target)])
    scan = _kernel_reading(base)
    facts = kscan.attribute(scan, view)
    assert not scan.incomplete, scan.incomplete
    assert facts.reads.overlaps(target.data_ptr(), target.data_ptr() + 16)


@pytest.mark.parametrize("nbytes", [64, kscan.POINTER_ARRAY_BYTES + 8], ids=["small", "large"])
def test_a_storage_that_cannot_be_read_for_pointers_makes_the_scan_incomplete(nbytes: int) -> None:
    """A storage a kernel points into that has no memory to read (what the view holds for it is no strided tensor)
    may hold pointers to anything: the scan must say what it reads is unknown, never pass over it."""
    view = StorageView([(_FAR, nbytes, object()), (_FAR + 0x100000, 64, torch.zeros(1))])
    scan = _kernel_reading(_FAR)
    kscan.attribute(scan, view)
    assert scan.incomplete and "cannot be read for pointers" in scan.incomplete[0], scan.incomplete


def test_a_search_that_fails_on_the_device_makes_the_scan_incomplete(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device search of a large table runs out of memory (or the storage cannot be viewed): fail closed."""

    def out_of_memory(tensor: torch.Tensor, spans: Any) -> list[int]:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(kscan, "search_words", out_of_memory)
    table = torch.zeros(kscan.POINTER_ARRAY_BYTES // 4 + 2)  # float32, over the limit
    view = StorageView([(table.data_ptr(), table.untyped_storage().nbytes(), table), (_FAR, 64, torch.zeros(1))])
    scan = _kernel_reading(table.data_ptr())
    facts = kscan.attribute(scan, view)
    assert facts.tables == 1
    assert scan.incomplete and "searching it on its device failed" in scan.incomplete[0], scan.incomplete


def test_a_large_table_is_not_searched_when_nothing_is_left_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every storage the view knows is read directly: no word of a large table can add to the reads, so the search
    gets no spans and returns without touching the table (no device work at all)."""
    seen: list[Any] = []
    real = kscan.search_words
    monkeypatch.setattr(kscan, "search_words", lambda tensor, spans: seen.append(spans) or real(tensor, spans))
    table, weight = torch.zeros(kscan.POINTER_ARRAY_BYTES // 4 + 2), torch.zeros(4)
    view = StorageView([(table.data_ptr(), table.untyped_storage().nbytes(), table), (weight.data_ptr(), 16, weight)])
    kscan.attribute(_kernel_reading(table.data_ptr(), weight.data_ptr()), view)
    assert seen == [[]]
    assert kscan.search_words(torch.Tensor._make_subclass(_NoMemory, torch.zeros(4)), []) == []  # reads nothing
