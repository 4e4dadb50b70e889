"""Operator tooling: the `fngate` console script (deploy, ls, rm, validate, invoke, keys, schema),
`fngate up` (a whole deployment on one machine: private Redis, gateway, local scaler), and the
Kubernetes renderer. Built on the shared core in `fngate`; neither gateway nor runner imports it."""
