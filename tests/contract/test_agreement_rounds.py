"""An agreement round names the contract it decides. Two contracts sharing one agreement group, reloaded in
different orders on two ranks, would pair contract A on one rank with contract B on the other, and each rank would
adopt a decision about the wrong model. A round whose ranks decide different contracts fails closed on every rank,
with a finding that names both; the same order on every rank agrees as before."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from _ranks import on_threads
from graphsafe import FindingKind, GraphContract, Status
from graphsafe.contract import AgreementGroup, StoreAgreement


class Target(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)


class Draft(Target):
    pass


def reload(contract: GraphContract, group: AgreementGroup, *, replace: bool) -> Status:
    """A reload under the group's agreement: in place (commits), or a new shape (a recapture)."""
    model = contract.model
    agreement = StoreAgreement(group, timeout=10)
    try:
        with contract.reload(agreement=agreement):
            if replace:
                model.weight = nn.Parameter(torch.randn(5, 4), requires_grad=False)  # respecified
            else:
                with torch.no_grad():
                    model.weight.copy_(torch.randn(4, 4))
    except Exception:
        pass
    outcome = contract.last_outcome
    assert outcome is not None
    return outcome.status


def test_two_contracts_reloaded_in_different_orders_on_two_ranks_fail_closed() -> None:
    def rank(group: AgreementGroup) -> list[Any]:
        models = Target(), Draft()  # held: a contract holds its model weakly
        target = GraphContract(models[0], "recapture").seal()
        draft = GraphContract(models[1], "recapture").seal()
        order = [target, draft] if group.rank == 0 else [draft, target]
        statuses = [reload(contract, group, replace=contract is draft) for contract in order]
        return [*statuses, *(contract.last_outcome for contract in order)]

    results = on_threads(2, rank)
    for result in results:
        assert not isinstance(result, BaseException), result
        assert result[:2] == [Status.FAILED, Status.FAILED]
        for outcome in result[2:]:
            mismatch = [f for f in outcome.problems if f.kind is FindingKind.RELOAD_ERROR and f.rank is not None]
            assert mismatch and "Target" in mismatch[0].detail and "Draft" in mismatch[0].detail


def test_two_contracts_reloaded_in_the_same_order_agree() -> None:
    def rank(group: AgreementGroup) -> list[Status]:
        models = Target(), Draft()
        target = GraphContract(models[0], "recapture").seal()
        draft = GraphContract(models[1], "recapture").seal()
        return [reload(contract, group, replace=contract is draft) for contract in (target, draft)]

    for result in on_threads(2, rank):
        assert result == [Status.COMMITTED, Status.NEEDS_RECAPTURE], result


def test_a_contract_is_named_by_its_model_class_unless_named() -> None:
    model = Target()
    assert GraphContract(model).name == "Target"
    assert GraphContract(model, name="draft-7b").name == "draft-7b"
