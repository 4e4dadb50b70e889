"""A Triton model repository as fngate reads it: config.pbtxt through Triton's own schema (the
generated model_config_pb2 that tritonclient ships) and protobuf's text_format, mapped onto
FunctionManifest; the fields fngate does not honour named in warnings; ONNX models without a
configuration completed from the model itself, as Triton's auto-complete does.

Imported only where a Triton repository is read (fngate.repository, the CLI): protobuf and
tritonclient load with it, never with the rest of fngate.
"""
