"""Rank agreement over ``torch.distributed``: the part of agreement that knows about process groups.

The agreement itself (one store round per reload, the worst status wins, faulty ranks named, late ranks failed) is
a step of deciding an outcome and lives with the contract (:class:`graphsafe.contract.StoreAgreement`, see
``docs/distributed.md``). This adapter only turns a ``torch.distributed`` process group into the ranks and store
that agreement needs::

    from graphsafe.adapters.distributed import agreement

    with contract.reload(agreement=agreement(tp_group, timeout=60)) as txn:
        model.load_weights(shard)
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from graphsafe.contract import AgreementGroup, StoreAgreement
from graphsafe.errors import GraphSafeError

__all__ = ["agreement", "agreement_group"]


def agreement_group(group: Any = None) -> AgreementGroup:
    """The :class:`~graphsafe.contract.AgreementGroup` of ``group``: ``None`` or ``dist.group.WORLD`` (the default
    group), a ``torch.distributed`` process group (its ranks in group numbering, keys under its group name in the
    default store), or an :class:`~graphsafe.contract.AgreementGroup` (returned as is)."""
    if isinstance(group, AgreementGroup):
        return group
    if not dist.is_available() or not dist.is_initialized():
        raise GraphSafeError(
            "rank agreement needs torch.distributed initialised (init_process_group) before the reload, "
            "or an AgreementGroup with its own store"
        )
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._get_default_group() if group is None or group is dist.GroupMember.WORLD else group
    rank = dist.get_rank(pg)
    if rank < 0:
        raise GraphSafeError(f"this process (global rank {dist.get_rank()}) is not a member of group {pg!r}")
    name = getattr(pg, "group_name", None) or ",".join(map(str, dist.get_process_group_ranks(pg)))
    return AgreementGroup(c10d._get_default_store(), rank, dist.get_world_size(pg), str(name))


def agreement(group: Any = None, *, timeout: float | timedelta | None = None) -> StoreAgreement:
    """Agreement among the ranks of ``group`` (see :func:`agreement_group`), for ``contract.reload(agreement=...)``.

    ``timeout``: how long a rank waits for its peers (seconds or a ``timedelta``; ``None``: the default of
    :class:`~graphsafe.contract.StoreAgreement`).
    """
    return StoreAgreement(agreement_group(group), timeout)
