"""Training-side fast checkpoint API (DESIGN section 7)."""
