"""Value digests (``contract._samples``): the batched form gives each tensor exactly its single-tensor digest.

A freshness check compares a digest taken before the load with one taken after it; the "before" side is taken in
one batch at ``begin()`` (small tensors of one device and word width joined into one reduction), the "after" side
may be taken alone. Equal bytes must give equal digests either way, and a change of one word must show in both.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphsafe.contract._samples import DIGEST_ROW, digest, digests

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64, torch.float64, torch.bool)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    numel = draw(st.sampled_from((0, 1, 3, DIGEST_ROW - 1, DIGEST_ROW, DIGEST_ROW + 1, 3 * DIGEST_ROW + 5, 70_000)))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-100, 100, (numel,), generator=g)
    tensor = values.to(dtype) if dtype is not torch.bool else values > 0
    if draw(st.booleans()) and numel > 4:  # a strided view: its own elements, not its storage's
        tensor = tensor[::2]
    return tensor


@settings(max_examples=200, deadline=None)
@given(st.lists(tensors(), min_size=1, max_size=12))
def test_batched_digests_equal_single_digests(batch: list[torch.Tensor]) -> None:
    for single, joined in zip(map(digest, batch), digests(batch), strict=True):
        assert (single is None) == (joined is None)
        if single is not None and joined is not None:
            assert torch.equal(single, joined)


@settings(max_examples=100, deadline=None)
@given(st.lists(tensors(), min_size=2, max_size=8), st.data())
def test_one_changed_word_changes_its_batched_digest(batch: list[torch.Tensor], data: st.DataObject) -> None:
    batch = [t.contiguous() for t in batch]
    candidates = [i for i, t in enumerate(batch) if t.numel() and t.dtype is not torch.bool]
    if not candidates:
        return
    index = data.draw(st.sampled_from(candidates))
    before = digests(batch)[index]
    changed = batch[index].clone()
    position = data.draw(st.integers(0, changed.numel() - 1))
    changed.view(-1)[position] += 1
    after = digests([*batch[:index], changed, *batch[index + 1 :]])[index]
    assert before is not None and after is not None
    assert not torch.equal(before, after)


@settings(max_examples=200, deadline=None)
@given(st.lists(tensors(), min_size=1, max_size=12))
def test_batched_weighted_digests_equal_single_weighted_digests(batch: list[torch.Tensor]) -> None:
    for single, joined in zip((digest(t, weighted=True) for t in batch), digests(batch, weighted=True), strict=True):
        assert (single is None) == (joined is None)
        if single is not None and joined is not None:
            assert torch.equal(single, joined)


@settings(max_examples=200, deadline=None)
@given(tensors(), st.data())
def test_an_exchange_of_two_words_changes_the_weighted_digest(tensor: torch.Tensor, data: st.DataObject) -> None:
    """What a holder's permutation within a row does to the witness of its bytes (the plain digest misses it)."""
    words = tensor.contiguous().view(-1)
    if words.numel() < 2:
        return
    first, second = data.draw(st.lists(st.integers(0, words.numel() - 1), min_size=2, max_size=2, unique=True))
    if torch.equal(words[first], words[second]):
        return
    swapped = words.clone()
    swapped[first], swapped[second] = words[second].clone(), words[first].clone()
    before, after = digest(words, weighted=True), digest(swapped, weighted=True)
    assert before is not None and after is not None
    assert not torch.equal(before, after)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 300), st.integers(1, DIGEST_ROW), st.integers(0, 2**16))
def test_the_host_weighted_row_sums_are_the_exact_int64_sums(rows: int, width: int, seed: int) -> None:
    """The host computes the weighted sums in float64, a block of rows at a time; a GPU in int64: both must give the
    exact integer sums, so that one tensor has one witness wherever it lives (extreme words included, and tensors
    of several blocks)."""
    from graphsafe.contract._samples import _row_sums, _row_weights

    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31, (rows, width), generator=g, dtype=torch.int64)
    words[0, 0] = -(2**31)
    words = words.to(torch.int32)
    exact = (words.to(torch.int64) * _row_weights(words.device)[:width]).sum(1)
    assert torch.equal(_row_sums(words, torch.int32, True), exact)


@pytest.mark.parametrize("rows", [0, 1, 1024, 1025])
def test_the_device_weighted_row_sums_give_one_sum_per_row_none_for_no_row(rows: int) -> None:
    """The device route of the weighted row sums (int64 blocks of rows; run here on the meta device, which keeps
    shapes and dtypes only): one int64 sum per row, and none for no row (a device tensor shorter than one row has
    no full row, and summing its blocks raised ``torch.cat`` of nothing on a GPU)."""
    from graphsafe.contract._samples import _row_sums

    sums = _row_sums(torch.empty(rows, DIGEST_ROW, dtype=torch.int32, device="meta"), torch.int32, True)
    assert sums.dtype == torch.int64 and sums.device.type == "meta"
    assert sums.shape == (rows,)
