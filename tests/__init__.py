# Imported first by every test module and by every rank that unpickles a test's rank function,
# so a device asked for in GRADSYNC_RANK_DEVICE applies to the ranks too
# (tests/support/rank_device.py).
from tests.support import rank_device

rank_device.install()
