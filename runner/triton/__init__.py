"""Triton's Python backend inside fngate's Python function sandbox: the module a `model.py` imports
as `triton_python_backend_utils` (python_backend) and the adapter that runs its `TritonPythonModel`
(model)."""
