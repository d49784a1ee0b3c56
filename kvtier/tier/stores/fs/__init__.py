"""A shared filesystem store: one file per block under a directory that several instances (or
hosts, over NFS or a parallel filesystem) mount, read back into host rows and verified."""
