"""`fngate up`: a whole deployment on one machine (fngate.up.supervisor), its local scaler, the
`--reload` watcher, the state folder other commands find it by, and the loopback Redis Cluster of
the tests and the benchmark. A runtime component, not a library: nothing serving imports it."""
