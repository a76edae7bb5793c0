"""The ``aegis`` command line (DESIGN section 12)."""
