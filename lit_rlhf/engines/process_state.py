"""What a library started in this process may change in it, kept as it was: the global random generators
(Python's, NumPy's, torch's CPU and CUDA ones) and ``torch.set_num_threads``."""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["preserved_process_state"]


class preserved_process_state:
    """Keep the global random generators and ``torch.set_num_threads`` as they were around vLLM's start:
    vLLM seeds Python's, NumPy's and torch's generators and replaces ``torch.set_num_threads`` on CPU,
    which would change the run's random stream (and break an exact resume) and the trainer's threads."""

    def __enter__(self) -> None:
        import numpy as np

        self.state = (random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.get_num_threads())
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.set_num_threads = torch.set_num_threads

    def __exit__(self, *exc: Any) -> None:
        import numpy as np

        py, np_state, torch_state, threads = self.state
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        torch.set_num_threads = self.set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
