"""The state the components share across processes: the Redis key names (state/keys.py), the
typed records with one encoder and one decoder each (state/records.py), and the `Store` that
reads and writes them (state/store.py over Redis, state/memory.py in one process)."""
