"""Which tensor object a slot was sealed on, held without a weak reference to it.

``torch.utils.swap_tensors`` (and ``load_state_dict`` under
``torch.__future__.set_swap_module_params_on_conversion(True)``, which swaps every parameter and buffer) refuses a
tensor that has a weak reference, so the contract must not keep one on a model's tensors. It keeps the object's
identity instead: its ``id`` and the address of the ``TensorImpl`` it points at. A swap keeps the Python object
and gives it another ``TensorImpl``, so a swapped tensor is no longer the sealed one (its memory may be elsewhere),
and the contract takes the captured memory from the fingerprint's storage reference (or finds it freed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorRef"]


@dataclass(frozen=True, slots=True)
class TensorRef:
    """The identity of one tensor object and the ``TensorImpl`` it pointed at when taken.

    :meth:`holds` answers whether a live object is that one, still on that implementation. It never resurrects
    the object: where no path holds it any more, the caller rebuilds a view on the captured storage.
    """

    ident: int
    impl: int
    kind: type

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorRef:
        return cls(id(tensor), tensor._cdata, type(tensor))

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is the object taken, still on the same ``TensorImpl`` (not swapped since).

        A live object with the same ``id`` is the same object; the implementation address rules out a swap. (An
        object freed and another made at both addresses reads as the same one: the caller's layout and storage
        checks still judge what it reads.)
        """
        return id(value) == self.ident and isinstance(value, torch.Tensor) and value._cdata == self.impl
