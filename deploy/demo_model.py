"""Make the quick start's model: a digits classifier trained here, packed as a signed bundle.

Trains scikit-learn's MLP on the 8×8 ``digits`` images that ship with scikit-learn (no
download), converts it to ONNX, and writes into OUT_DIR: ``digits.onnx``, ``labels.txt``,
``publisher.key``/``publisher.pub`` (made once), ``digits-1.0.0.mcpb`` (signed), and
``sample.json`` (an Open Inference Protocol request for two test images).

    python deploy/demo_model.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcp_edge.shared.bundle import build_bundle, sign_bundle
from mcp_edge.shared.signing import (
    PrivateKey,
    read_private_key,
    write_private_key,
    write_public_key,
)
from mcp_edge.tooling.models import train_digits_mlp, write_digits_onnx

LABELS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    mlp = train_digits_mlp()
    onnx_path = write_digits_onnx(mlp.model, out / "digits.onnx")
    (out / "labels.txt").write_text("\n".join(LABELS) + "\n")
    key_path = out / "publisher.key"
    if not key_path.exists():
        write_private_key(key_path, PrivateKey.generate())
    key = read_private_key(key_path)
    write_public_key(out / "publisher.pub", key.public_key)
    bundle = out / "digits-1.0.0.mcpb"
    bundle.unlink(missing_ok=True)
    build_bundle(
        onnx_path,
        bundle,
        name="digits",
        version="1.0.0",
        labels_path=out / "labels.txt",
        preprocessing={
            "kind": "image",
            "grayscale": True,
            "size": [8, 8],
            "scale": 1 / 255,
            "layout": "flat",
        },
    )
    sign_bundle(bundle, key)
    x = mlp.X_test[:2]
    sample = {
        "inputs": [
            {
                "name": "input",
                "shape": [2, 64],
                "datatype": "FP32",
                "data": [round(float(v), 4) for v in x.ravel()],
            }
        ]
    }
    (out / "sample.json").write_text(json.dumps(sample))
    print(
        f"model accuracy on held-out digits: {mlp.accuracy:.3f}; "
        f"expected answers for sample.json: {mlp.y_test[:2].tolist()}"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
