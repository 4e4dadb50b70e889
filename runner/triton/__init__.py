"""Triton's Python backend inside fngate's Python function sandbox: the `triton_python_backend_utils`
module a `model.py` imports (utils) and the adapter that runs its `TritonPythonModel` (model)."""
