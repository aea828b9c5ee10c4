"""The Plexus coordinator: gRPC services, the round engine, strategies and the store."""
