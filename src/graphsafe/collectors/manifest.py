"""The capture-time manifest: what captured graphs actually touched (public names; see ``docs/manifest.md``)."""

from graphsafe.collectors._manifest import CapturedStorage, Holder, Manifest, record_capture

__all__ = ["CapturedStorage", "Holder", "Manifest", "record_capture"]
