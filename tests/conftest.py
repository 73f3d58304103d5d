"""Test-session settings.

The persistent prediction cache (autotune/cache.py) is off for the suite: tests look at how a
prediction was made (traced depths, micro-batches) and must not be answered by an earlier test.
tests/test_cache.py turns it on, in a folder of its own, to test it.
"""

import os

os.environ["AUTOTUNE_CACHE"] = "off"
