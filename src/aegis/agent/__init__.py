"""The agent: PID-1 supervisor of the training command (DESIGN section 5)."""
