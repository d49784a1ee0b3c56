"""A local disk tier: one preallocated slot file per process, locked, rebuilt after a restart."""
