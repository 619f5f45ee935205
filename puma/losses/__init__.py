"""puma.losses."""
