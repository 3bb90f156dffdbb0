"""Reusable launchers for real external services the tests need (redis-server, Redis Cluster)."""
