"""gRPC: the credential handshake. Generated code in ``_generated`` (from ``proto/``)."""
