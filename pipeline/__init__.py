"""Offline builder of episodic KV caches for long conversations (EpiCache-style)."""
