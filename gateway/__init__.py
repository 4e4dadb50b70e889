"""The HTTP edge of fngate: validates invocations, queues them on Redis and routes replies back."""
