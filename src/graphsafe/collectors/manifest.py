"""The capture-time manifest: what captured graphs actually touched (public names; see ``docs/manifest.md``)."""

from graphsafe.collectors._manifest import (
    CapturedStorage,
    GradedStorage,
    Grading,
    Holder,
    Manifest,
    grade,
    record_capture,
)

__all__ = ["CapturedStorage", "GradedStorage", "Grading", "Holder", "Manifest", "grade", "record_capture"]
