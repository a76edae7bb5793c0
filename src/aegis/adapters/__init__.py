"""Adapters: real implementations of the ports (NATS, gRPC, JetStream KV, processes)."""
