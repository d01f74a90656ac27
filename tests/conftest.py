"""Suite-wide settings."""

import torch

# The tiny test models are far too small to gain from intra-op threads, and with other
# processes on the 2 cores (servers under test) spinning thread pools cost 10x.
torch.set_num_threads(1)
