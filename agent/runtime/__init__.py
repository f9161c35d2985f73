"""Local inference: model runners (onnxruntime, TFLite), dynamic batching, the model manager."""
