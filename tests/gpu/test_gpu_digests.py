"""Weighted digests on a real device: the int64 sums a GPU computes over blocks of rows are the exact sums, and equal
the host's float64 ones for the same bytes (one tensor, one witness, wherever it lives)."""

from __future__ import annotations

import pytest
import torch

from graphsafe.contract._samples import DIGEST_ROW, _row_sums, _row_weights, digest, digests


@pytest.mark.parametrize("rows", [1, 7, 1024, 1025, 3000])
def test_the_device_weighted_row_sums_are_the_exact_int64_sums(device: torch.device, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    words = torch.randint(-(2**31), 2**31, (rows, DIGEST_ROW), generator=g, dtype=torch.int64)
    words[0, :] = -(2**31)  # the extreme word in every position of a row
    words = words.to(torch.int32)
    exact = (words.to(torch.int64) * _row_weights(torch.device("cpu"))).sum(1)
    on_device = _row_sums(words.to(device), torch.int32, True)
    assert on_device.device == device
    assert torch.equal(on_device.cpu(), exact)


def test_device_and_host_digests_of_the_same_bytes_are_equal(device: torch.device) -> None:
    g = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(n, generator=g).to(dtype)
        for n, dtype in ((5, torch.float32), (70_000, torch.bfloat16), (3 << 20, torch.float32), (1023, torch.int8))
    ]
    on_host = digests(tensors, weighted=True)
    on_device = digests([t.to(device) for t in tensors], weighted=True)
    for host, dev, tensor in zip(on_host, on_device, tensors, strict=True):
        assert host is not None and dev is not None
        assert torch.equal(host, dev.cpu())
        single = digest(tensor.to(device), weighted=True)
        assert single is not None and torch.equal(single.cpu(), host)
