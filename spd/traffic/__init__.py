"""Learning from traffic: a server's records of what it answered (:mod:`.records`), the loop that fine-tunes its head
on them (:mod:`.adapt`, ``spd-adapt``; its settings: :mod:`.config`; a round's data: :mod:`.snapshot`) and the versions
it publishes (:mod:`.versions`)."""
