"""A small writer of TFLite flatbuffers, for test and benchmark models made without TensorFlow.

`TFLiteGraph` collects float32 activations (batch resizable through `shape_signature` -1),
constants and builtin operators of one subgraph, and writes the model through the schema that
ai-edge-litert ships (`ai_edge_litert.schema_py_generated`) with one signature,
`serving_default`. Constant buffers are aligned to 16 bytes, as TFLite's own converter does.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import flatbuffers
import numpy as np
import numpy.typing as npt

TFLITE_SIGNATURE_KEY = "serving_default"
# TFLite's own converter aligns constant buffers to 16 bytes so kernels can read floats in
# place; we do the same.
_TFLITE_BUFFER_ALIGNMENT = 16

FloatArray = npt.NDArray[np.float32]


def atomic_write(path: Path, data: bytes) -> Path:
    """Write `data` to `path` through a temporary file, fsync, and rename."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    return path


def _aligned_buffer(data: bytes) -> Any:
    """A schema `BufferT` whose bytes start on a 16-byte boundary of the finished file."""
    from ai_edge_litert import schema_py_generated as schema

    class AlignedBufferT(schema.BufferT):  # type: ignore[misc]  # generated code, untyped
        def Pack(self, builder: flatbuffers.Builder) -> int:
            builder.StartVector(1, len(data), _TFLITE_BUFFER_ALIGNMENT)
            builder.head -= len(data)
            builder.Bytes[builder.head : builder.head + len(data)] = data
            vector = builder.EndVector()
            schema.BufferStart(builder)
            schema.BufferAddData(builder, vector)
            return int(schema.BufferEnd(builder))

    return AlignedBufferT()


class TFLiteGraph:
    """A one-subgraph TFLite model under construction, written with ai-edge-litert's schema.

    Activations are float32 tensors with batch 1 in `shape` and -1 in `shape_signature`, so
    the interpreter may resize the batch; constants keep their static shape.
    """

    def __init__(self) -> None:
        from ai_edge_litert import schema_py_generated as schema

        self.schema: Any = schema
        self._buffers: list[Any] = [schema.BufferT()]  # buffer 0: the empty sentinel
        self._tensors: list[Any] = []
        self._opcodes: list[int] = []
        self._operators: list[Any] = []

    def activation(self, name: str, shape: list[int]) -> int:
        """A float32 tensor computed at run time; `shape[0]` is the (resizable) batch."""
        return self._tensor(name, shape, self.schema.TensorType.FLOAT32, 0, [-1, *shape[1:]])

    def constant(self, name: str, array: npt.NDArray[Any]) -> int:
        """A constant tensor (float32 or int32) holding `array`."""
        if array.dtype == np.int32:
            data, tensor_type = np.ascontiguousarray(array, "<i4"), self.schema.TensorType.INT32
        else:
            data, tensor_type = np.ascontiguousarray(array, "<f4"), self.schema.TensorType.FLOAT32
        self._buffers.append(_aligned_buffer(data.tobytes()))
        shape = list(array.shape)
        return self._tensor(name, shape, tensor_type, len(self._buffers) - 1, shape)

    def tensor_name(self, index: int) -> str:
        """The name of tensor `index`."""
        return str(self._tensors[index].name)

    def _tensor(
        self, name: str, shape: list[int], tensor_type: int, buffer: int, signature: list[int]
    ) -> int:
        t = self.schema.TensorT()
        t.name, t.shape, t.type, t.buffer, t.shapeSignature = (
            name,
            shape,
            tensor_type,
            buffer,
            signature,
        )
        self._tensors.append(t)
        return len(self._tensors) - 1

    def op(
        self,
        builtin: int,
        inputs: list[int],
        output: int,
        options_type: int = 0,
        options: Any = None,
    ) -> None:
        """Append one builtin operator (opcodes are shared between operators of one kind)."""
        if builtin not in self._opcodes:
            self._opcodes.append(builtin)
        op = self.schema.OperatorT()
        op.opcodeIndex, op.inputs, op.outputs = self._opcodes.index(builtin), inputs, [output]
        if options is not None:
            op.builtinOptionsType, op.builtinOptions = options_type, options
        self._operators.append(op)

    def write(
        self,
        path: Path,
        inputs: Mapping[str, int],
        outputs: Mapping[str, int],
        description: str,
    ) -> Path:
        """Finish the model and write it atomically to `path`.

        Args:
            inputs, outputs: the subgraph's input and output tensors by the names the
                `serving_default` signature gives them.
            description: the model's description string.

        Returns:
            `path`.
        """
        schema = self.schema
        subgraph = schema.SubGraphT()
        subgraph.name = "main"
        subgraph.tensors = self._tensors
        subgraph.inputs, subgraph.outputs = list(inputs.values()), list(outputs.values())
        subgraph.operators = self._operators

        signature = schema.SignatureDefT()
        signature.signatureKey, signature.subgraphIndex = TFLITE_SIGNATURE_KEY, 0
        signature.inputs = [_tensor_map(schema, k, v) for k, v in inputs.items()]
        signature.outputs = [_tensor_map(schema, k, v) for k, v in outputs.items()]

        codes = []
        for builtin in self._opcodes:
            code = schema.OperatorCodeT()
            # Builtins below 127 are also written to the deprecated int8 field, which
            # older readers (tflite-runtime) still look at.
            code.builtinCode = builtin
            code.deprecatedBuiltinCode = min(builtin, 127)
            code.version = 1
            codes.append(code)

        model = schema.ModelT()
        model.version = 3
        model.description = description
        model.operatorCodes = codes
        model.subgraphs, model.buffers, model.signatureDefs = [subgraph], self._buffers, [signature]

        builder = flatbuffers.Builder(1024)
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
        return atomic_write(path, bytes(builder.Output()))

    def fully_connected(
        self, x: int, weights: FloatArray, bias: FloatArray, output: int, relu: bool
    ) -> None:
        """FULLY_CONNECTED with `weights` as [out, in] (TFLite's layout)."""
        schema = self.schema
        name = self.tensor_name(output)
        options = schema.FullyConnectedOptionsT()
        options.fusedActivationFunction = (
            schema.ActivationFunctionType.RELU if relu else schema.ActivationFunctionType.NONE
        )
        w = self.constant(f"{name}/weights", weights)
        b = self.constant(f"{name}/bias", bias)
        self.op(
            schema.BuiltinOperator.FULLY_CONNECTED,
            [x, w, b],
            output,
            schema.BuiltinOptions.FullyConnectedOptions,
            options,
        )

    def softmax(self, x: int, output: int) -> None:
        """SOFTMAX over the last axis, beta 1."""
        schema = self.schema
        options = schema.SoftmaxOptionsT()
        options.beta = 1.0
        self.op(
            schema.BuiltinOperator.SOFTMAX,
            [x],
            output,
            schema.BuiltinOptions.SoftmaxOptions,
            options,
        )

    def conv_2d(
        self, x: int, filters: FloatArray, bias: FloatArray, output: int, relu: bool
    ) -> None:
        """CONV_2D, stride 1, SAME padding, `filters` as [out, kh, kw, in] (TFLite's OHWI)."""
        schema = self.schema
        name = self.tensor_name(output)
        options = schema.Conv2DOptionsT()
        options.padding, options.strideW, options.strideH = schema.Padding.SAME, 1, 1
        options.dilationWFactor = options.dilationHFactor = 1
        options.fusedActivationFunction = (
            schema.ActivationFunctionType.RELU if relu else schema.ActivationFunctionType.NONE
        )
        w = self.constant(f"{name}/filter", filters)
        b = self.constant(f"{name}/bias", bias)
        self.op(
            schema.BuiltinOperator.CONV_2D,
            [x, w, b],
            output,
            schema.BuiltinOptions.Conv2DOptions,
            options,
        )

    def max_pool_2d(self, x: int, size: int, output: int) -> None:
        """MAX_POOL_2D over `size` x `size` windows, stride `size`, VALID padding."""
        schema = self.schema
        options = schema.Pool2DOptionsT()
        options.padding, options.strideW, options.strideH = schema.Padding.VALID, size, size
        options.filterWidth = options.filterHeight = size
        self.op(
            schema.BuiltinOperator.MAX_POOL_2D,
            [x],
            output,
            schema.BuiltinOptions.Pool2DOptions,
            options,
        )

    def mean(self, x: int, axes: list[int], output: int) -> None:
        """MEAN over `axes`, which are dropped from the shape."""
        schema = self.schema
        options = schema.ReducerOptionsT()
        options.keepDims = False
        axes_t = self.constant(f"{self.tensor_name(output)}/axes", np.array(axes, np.int32))
        self.op(
            schema.BuiltinOperator.MEAN,
            [x, axes_t],
            output,
            schema.BuiltinOptions.ReducerOptions,
            options,
        )

    def transpose(self, x: int, perm: list[int], output: int) -> None:
        """TRANSPOSE by `perm` (output dim i is input dim perm[i])."""
        schema = self.schema
        perm_t = self.constant(f"{self.tensor_name(output)}/perm", np.array(perm, np.int32))
        self.op(
            schema.BuiltinOperator.TRANSPOSE,
            [x, perm_t],
            output,
            schema.BuiltinOptions.TransposeOptions,
            schema.TransposeOptionsT(),
        )


def _tensor_map(schema: Any, name: str, index: int) -> Any:
    mapping = schema.TensorMapT()
    mapping.name, mapping.tensorIndex = name, index
    return mapping
