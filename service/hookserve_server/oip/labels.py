"""Class names for classification answers: torchvision's ImageNet categories for an
architecture. torchvision is imported on first use only (the server has loaded it by
then), so the OIP package stays importable without torch."""

from __future__ import annotations

import functools


@functools.cache
def class_labels(arch: str) -> tuple[str, ...]:
    """The architecture's category names, or () when it has none."""
    try:
        from torchvision.models import get_model_weights
        return tuple(next(iter(get_model_weights(arch))).meta.get("categories", ()))
    except Exception:  # an architecture without pretrained weights: indices only
        return ()
