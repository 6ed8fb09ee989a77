"""A script ablate runs records what it reads from its first import on (nanomuon/reads.py)."""

import os

if os.environ.get("NANOMUON_RECORD_READS") == "1":  # set by ablate's launch, for its runs alone
    from nanomuon import reads

    reads.start()
