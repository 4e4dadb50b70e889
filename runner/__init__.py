"""The fngate worker: consumes function streams, batches invocations, runs models, replies."""
