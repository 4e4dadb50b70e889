"""fngate's benchmark: a fngate deployment on this machine driven by a closed-loop load generator,
compared with the same model called in-process by onnxruntime."""
