"""kvtier as SGLang's HiCache storage backend (its L3, below SGLang's own host pool):

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierStorage", "interface_v1": 1,
        "disk_kv_path": "/var/kvtier", "disk_kv_size": 100,
        "remote_kv_url": "redis://cache:6379/0", "remote_kv_secret_file": "/etc/kvtier/key"}'

Every page is verified on the way back (fingerprint, key, checksum, and the MAC under a
secret): a page of other weights, a damaged or a forged one is a miss, never served.
"""

from kvtier.integrations.sglang.storage import KvtierStorage

__all__ = ["KvtierStorage"]
