"""``POST /v1/infer`` inputs: a base64 image or plain numbers, turned into the model's input with
the bundle's preprocessing, and top-k labels out.

Body::

    {"model": "digits",            # optional when one model is loaded
     "image": "<base64 PNG/JPEG>", # or "images": [...]; needs image preprocessing
     "data": [[...64 numbers...]], # or numbers: one sample or a batch
     "top_k": 3}

Images are decoded with Pillow (imported only when an image arrives), converted to grayscale
when the preprocessing says so, resized to ``size`` (height, width), multiplied by ``scale``,
normalised by ``mean``/``std``, and laid out as ``flat``, ``NHWC`` or ``NCHW``. Without
preprocessing in the bundle, numbers are fed as they are.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import TYPE_CHECKING, Any

import numpy as np

from mcp_edge.agent.runtime.runner import Array

if TYPE_CHECKING:
    from mcp_edge.agent.runtime.manager import LoadedVersion

MAX_IMAGES = 64
MAX_IMAGE_BYTES = 4 * 1024 * 1024
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_TOP_K = 100


class PreprocessError(ValueError):
    """The /v1 body cannot be turned into model input (message says why)."""


def prepare_v1_inputs(doc: dict[str, Any], lv: LoadedVersion) -> tuple[dict[str, Array], int]:
    """Feeds for ``lv``'s single input and the requested k. Raises :class:`PreprocessError`."""
    info = lv.info
    if len(info.inputs) != 1:
        raise PreprocessError("/v1/infer serves single-input models; use /v2 for this one")
    spec = info.inputs[0]
    k = doc.get("top_k", 5)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_TOP_K:
        raise PreprocessError(f"top_k must be an integer from 1 to {MAX_TOP_K}")
    pre = lv.source.preprocessing or {}
    images = doc.get("images") if "images" in doc else ([doc["image"]] if "image" in doc else None)
    if images is not None:
        if pre.get("kind") != "image":
            raise PreprocessError(
                f'model {lv.name!r} has no image preprocessing in its bundle; send "data"'
            )
        if not isinstance(images, list) or not 1 <= len(images) <= MAX_IMAGES:
            raise PreprocessError(f'"images" must be a list of 1 to {MAX_IMAGES} base64 strings')
        rows = np.stack([_image_row(img, pre) for img in images])
    elif "data" in doc:
        try:
            rows = np.asarray(doc["data"], dtype=np.float64)
        except (TypeError, ValueError):
            raise PreprocessError('"data" must be a regular array of numbers') from None
        rows = _apply_numeric(rows, pre)
    else:
        raise PreprocessError('send "image" (base64), "images" or "data"')
    per_row = tuple(1 if d < 0 else d for d in spec.shape[1:])
    want = int(np.prod(per_row)) if per_row else 1
    if rows.size % max(want, 1) or rows.size == 0:
        raise PreprocessError(
            f"input needs {want} values per sample (shape {list(spec.shape)}), got {rows.size}"
        )
    batch = (
        rows.reshape((-1, *per_row))
        if spec.shape and spec.shape[0] < 0
        else rows.reshape(spec.shape)
    )
    return {spec.name: batch.astype(spec.datatype.numpy_dtype)}, k


def _apply_numeric(arr: Array, pre: dict[str, Any]) -> Array:
    if pre.get("scale") is not None:
        arr = arr * float(pre["scale"])
    if pre.get("mean") is not None:
        arr = arr - float(pre["mean"][0])
    if pre.get("std") is not None:
        arr = arr / float(pre["std"][0])
    return arr


def _image_row(encoded: object, pre: dict[str, Any]) -> Array:
    if not isinstance(encoded, str) or len(encoded) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise PreprocessError(
            f"an image must be a base64 string of at most {MAX_IMAGE_BYTES} bytes"
        )
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise PreprocessError("image is not valid base64") from None
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise PreprocessError(f"image larger than {MAX_IMAGE_PIXELS} pixels")
            img = img.convert("L" if pre.get("grayscale") else "RGB")
            if pre.get("size"):
                h, w = pre["size"]
                img = img.resize((int(w), int(h)), Image.Resampling.BILINEAR)
            pixels = np.asarray(img, dtype=np.float64)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError):
        raise PreprocessError(
            "image could not be decoded (PNG, JPEG, BMP or GIF expected)"
        ) from None
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    scale = pre.get("scale")
    pixels = pixels * (float(scale) if scale is not None else 1.0)
    if pre.get("mean") is not None:
        pixels = pixels - np.asarray(pre["mean"], dtype=np.float64)
    if pre.get("std") is not None:
        pixels = pixels / np.asarray(pre["std"], dtype=np.float64)
    layout = pre.get("layout") or "flat"
    if layout == "NCHW":
        return np.transpose(pixels, (2, 0, 1))
    if layout == "NHWC":
        return pixels
    return pixels.reshape(-1)


def top_k(scores: Array, labels: tuple[str, ...], k: int) -> list[list[dict[str, Any]]]:
    """Per row of ``scores`` (batch × classes), the k best ``{index, label, score}``."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim == 1:
        s = s[None, :]
    s = s.reshape(s.shape[0], -1)
    k = min(k, s.shape[1])
    order = np.argsort(-s, axis=1)[:, :k]
    return [
        [
            {
                "index": int(i),
                "label": labels[i] if i < len(labels) else str(int(i)),
                "score": float(row[i]),
            }
            for i in idx
        ]
        for row, idx in zip(s, order, strict=True)
    ]
