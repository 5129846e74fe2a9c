"""``graphsafe fix``: the migration report's fixes written into the kernel's source (see
``docs/migration-report.md``).

Sits above the report: it reads the report's :class:`~graphsafe.report.Fix` values (the class, the function, the
placement and the exact lines) and edits the classes' source files with LibCST, which keeps formatting and
comments (the optional extra ``graphsafe[fix]``; only :func:`propose` needs it).

* :func:`propose` turns fixes into a :class:`Patch`: a :class:`FileEdit` per changed file (``diff()``), the
  fixes left to place by hand (:class:`Unplaced`), and ``write()``, which writes every file or none.
* :class:`FixError` is a patch that must not be made at all (installed code, a file that cannot be written, no
  LibCST); its message is one line.
"""

from graphsafe.fix._locate import FixError
from graphsafe.fix._patch import FileEdit, Patch, Unplaced, propose

__all__ = ["FileEdit", "FixError", "Patch", "Unplaced", "propose"]
