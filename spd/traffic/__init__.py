"""Learning from traffic: a server's records of what it answered (:mod:`.records`)."""
