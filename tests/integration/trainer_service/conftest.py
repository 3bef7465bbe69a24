"""One torch thread for every trainer-service test (the machine's cores are shared)."""

import torch

torch.set_num_threads(1)
