"""The `ferry worker` process: intake from Redis Streams, the engine loop, the publisher, health and metrics."""
