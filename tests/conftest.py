import os

# Every rank and the test process itself use one intra-op thread: the machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
