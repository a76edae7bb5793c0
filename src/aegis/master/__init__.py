"""The master: one core state machine per job, NATS in and out, status in the store."""
