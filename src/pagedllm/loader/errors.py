"""The one exception type the loaders raise for user-facing load failures.

`ModelLoadError` carries a clear one-line message (missing path, bad checkpoint, unsupported
architecture or tensor type, ...). It subclasses ValueError so generic handlers still catch it.
"""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model path, config, checkpoint or tokenizer could not be loaded."""
