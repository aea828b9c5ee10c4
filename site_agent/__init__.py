"""The Plexus site agent: dials out to the coordinator, trains on local data, sends updates."""
