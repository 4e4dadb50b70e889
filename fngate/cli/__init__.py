"""The `fngate` console script (fngate.cli.main) and its commands: deploy, ls, rm, validate,
invoke, traffic, rollback, keys, import-triton. Built on the shared core in `fngate`; neither
gateway nor runner imports it."""
