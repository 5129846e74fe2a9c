"""The walker: every device tensor reachable from a layer, named by a slot path.

After a reload, ``process_weights_after_loading`` re-creates derived tensors (workspaces, strides, permutations,
scales) wherever it likes under a layer; a captured graph keeps reading the old memory. :func:`walk` finds those
tensors so undeclared drift can be detected.

What is walked: the layer's own instance attributes that are not torch's ``nn.Module`` bookkeeping (parameters,
buffers and child modules are someone else's business), then, recursively, plain objects (``__dict__`` and
``__slots__``), dicts (``str``/``int`` keys), lists, deques, tuples, NamedTuples, ``functools.partial``
(``func``, ``args``, ``keywords``), functions (closure cells, ``__defaults__``, ``__kwdefaults__``), bound
methods (``__func__`` and ``__self__``), builtin methods (``__self__``) and
mappingproxies; a class held as a value for its class attributes (never restorable), and for its methods that hold
a tensor themselves (a closure cell, a default: ``kernel.scale.__closure__[0]``); instances of user subclasses
of enums, threads, loggers, handlers and files for their ``__dict__``; the stdlib's own threads for the arguments
they were given (``_args``, ``_kwargs``), never their target; Python modules for the device tensors among their
globals only (``ops.workspace``: one pass over the namespace, no global entered, so ``torch`` or ``numpy`` costs
one object). Untrackable (read, but no slot path can name what they hold): a weak reference's referent, what a C
object without instance state holds (a generator's frame, a ``staticmethod``/``property`` over anything but code
without tensors), a method holding a tensor read through an instance (a descriptor), the items of a numpy object
array, and a raw storage (``UntypedStorage``) on a walked device. Never entered: child modules (each is its own
reload unit), the builtin and stdlib enum, logger and file classes' own instances, slices,
streams/events/graphs, dtypes, devices, scalars, strings and code, nor
compiled artifacts: instances of classes defined by torch.compile (``torch._dynamo``, ``torch._inductor``,
``torch._functorch``, ``torch._guards``, ``torch.fx``) or by ``vllm.compilation``. A compiled callable runs on
the module's own tensors, which the walk reaches through the module; constants an artifact keeps itself are for
the graph truth (the captured kernels' arguments) to see. Nor torch's hook handles
(``torch.utils.hooks.RemovableHandle``): the hooks they remove are read where they are registered.

The walker never runs user code: attributes are read through the C-level ``__dict__``/slot descriptors found in
the class dictionaries, containers through the builtin methods of ``dict``/``list``/``tuple``/``set``, type
tests compare ids along the MRO, and no user object is hashed or compared. Tensor metadata is read with
subclass ``__torch_function__`` disabled.

Alias policy: every distinct object is read once (``objects_visited`` counts them, which also makes cycles
harmless), but a tensor is reported under *every* simple path (one that passes through no object twice) from the
layer to it, through whatever containers: an aliased workspace, or a dict shared by two owners, shows up under
each path. Restoring needs all of them, since a rebound tuple or a replaced attribute only changes one parent.
Tensors that no path can name (members of sets, values under non-``str``/``int`` dict keys, attributes shadowed
by a data descriptor) are not reported; :attr:`WalkResult.notes` says where they are.

Budgets: ``max_objects`` bounds how many distinct objects are read (each container is read in full) and how many
path steps the alias enumeration takes; ``max_depth`` bounds path length. Hitting either is never silent:
:attr:`WalkResult.exhausted` names the budget and the first path where it cut.
"""

from graphsafe.collectors.walker._results import TensorRef, WalkResult
from graphsafe.collectors.walker._walk import collect, walk

__all__ = ["TensorRef", "WalkResult", "collect", "walk"]
