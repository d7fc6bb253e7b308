"""Every test's jobs measure into, and read, a cache of their own (tidal/launch/auto.py): a rate measured on
this machine by a user's run never changes what a test's launch chooses.

And the resolver gives up on a lost packet after 1 s, not 5: torch's store client looks the address it
connected to up in reverse DNS (c10d's formatSockAddr: getnameinfo of ::ffff:127.0.0.1, which /etc/hosts
does not answer), and where the name server drops a query (this sandbox: about 1 in 9) the connect waits
out glibc's 5 s timeout. A rank opens several store clients, so most 3-rank jobs stalled 5 s at start
(measured: 8 short jobs 22.4 s, 11.5 s with this). A failed lookup makes torch log addresses as numbers
for the rest of the process. Only this session's processes; a job never depends on the name server."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ["TIDAL_CACHE_DIR"] = tempfile.mkdtemp(prefix="tidal-test-cache-")
atexit.register(shutil.rmtree, os.environ["TIDAL_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
