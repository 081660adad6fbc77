"""Test support: worker functions the gloo tests run in spawned processes (importable by name)."""
