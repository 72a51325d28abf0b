"""The answer cache: content-addressed keys (key.py), an in-memory LRU with
single-flight (local.py), an optional Redis tier shared by replicas (shared.py), and
the one place the engine consults them (front.py)."""
