"""Each script runs as a process that records what it reads, from its first import on (reads.py)."""

from nanomuon import reads

reads.start()
