"""Every test's jobs measure into, and read, a cache of their own (tidal/launch/auto.py): a rate measured on
this machine by a user's run never changes what a test's launch chooses."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ["TIDAL_CACHE_DIR"] = tempfile.mkdtemp(prefix="tidal-test-cache-")
atexit.register(shutil.rmtree, os.environ["TIDAL_CACHE_DIR"], ignore_errors=True)
