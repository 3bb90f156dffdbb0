"""Quality-measurement harness of the KV formats (the formats themselves live in hafiza.cache)."""
