"""``aegis verify``: an explicit-state model checker over the production ``step``."""
