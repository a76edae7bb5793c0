"""The wire: msgspec structs for messages between master and agents, strict decoding, and the
translation of a decoded message into a core event. No I/O."""
