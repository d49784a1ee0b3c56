"""A shared key-value tier: one Redis or Valkey server, or a cluster of them, where every
instance's blocks live under its namespace and are verified (and MAC-checked) on the way up."""
